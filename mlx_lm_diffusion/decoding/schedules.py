"""Mask schedules of the step-schedule protocol (shared/seeds/004): linear, cosine, sigmoid.

gamma(x) is the fraction of the M generated positions still masked at time x in [0, 1].
The protocol's text sets m_t = floor(M * gamma(t / N)) masked at the *start* of step t;
read literally, step 0 unmasks nothing and floor(M * gamma((N - 1) / N)) positions stay
masked after the last step, which breaks its own autoregressive-equivalence invariant.
We implement the intent: after step t, floor(M * gamma((t + 1) / N)) positions are still
masked, and none after the last step (sigmoid's gamma(1) is 0.0067, not 0). So the
quotas k_t sum to M and the canvas is full after N steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.commit_rules import LowConfidence

SIGMOID_STEEPNESS = 10.0  # the protocol's normative C

GAMMAS: dict[str, Callable[[float], float]] = {
    "linear": lambda x: 1.0 - x,
    "cosine": lambda x: math.cos(0.5 * math.pi * x),
    "sigmoid": lambda x: 1.0 - 1.0 / (1.0 + math.exp(-SIGMOID_STEEPNESS * (x - 0.5))),
}


def schedule_name(name: str) -> str:
    if name not in GAMMAS:
        raise ValueError(f"Unknown mask schedule {name!r}; choose one of: {', '.join(GAMMAS)}")
    return name


def masked_after(name: str, total: int, steps: int) -> list[int]:
    """Positions still masked after each step t = 0 .. steps - 1 (the last is 0)."""
    gamma = GAMMAS[schedule_name(name)]
    # the 1e-9 absorbs float error where M * gamma is an integer (linear: M (N - t - 1) / N)
    left = [min(total, max(0, math.floor(total * gamma((t + 1) / steps) + 1e-9))) for t in range(steps)]
    left[-1] = 0
    for t in range(1, steps):  # never re-mask: the count only goes down
        left[t] = min(left[t], left[t - 1])
    return left


def quotas(name: str, total: int, steps: int) -> list[int]:
    """k_t, the positions unmasked at each step; they sum to `total`."""
    left = masked_after(name, total, steps)
    return [prev - now for prev, now in zip([total] + left[:-1], left)]


@dataclass
class ScheduleQuota(LowConfidence):
    """The protocol's selection: at step t, unmask the k_t most confident masked
    positions, k_t from the mask schedule over the block's masks (per row). That is
    LLaDA's low_confidence with the schedule's quotas in place of the even split."""

    schedule: str = "linear"
    name: ClassVar[str] = "schedule"

    def quotas(self, masked: np.ndarray, steps: int) -> mx.array:
        return mx.array([quotas(self.schedule, int(m), steps) for m in masked.tolist()], dtype=mx.int32)
