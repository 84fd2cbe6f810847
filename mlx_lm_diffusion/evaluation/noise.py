"""The Monte Carlo noise of the likelihood bound: which positions of a block are masked.

`stratified_masks` reproduces LLaDA's evaluation (ML-GSAI/LLaDA `eval_llada.py`,
`_forward_process`): in a batch of b samples over a block of L positions, the numbers
of masked positions are stratified rather than drawn independently: k ~ U{1..L}, then
x_i = round(linspace(k, k + (b - 1) L / b, b)), wrapped into 1..L; sample i masks x_i
positions chosen uniformly at random, and its time is p_i = x_i / L. The b times then
cover (0, 1] evenly, which lowers the estimate's variance for the same forwards.
Pure numpy, so that a test can check the estimate against these draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MaskDraw:
    """One batch's noise over one block: `masks` (b, L) True where a position is masked,
    `times` (b,) each sample's share of masked positions (x_i / L, the 1/p weight's p)."""

    masks: np.ndarray
    times: np.ndarray

    @property
    def samples(self) -> int:
        return int(self.masks.shape[0])


def stratified_masks(rng: np.random.Generator, length: int, batch: int) -> MaskDraw:
    """LLaDA's `_forward_process` for one batch of `batch` samples over `length` positions
    (torch.round and np.round both round half to even, so the counts are the reference's)."""
    if length < 1 or batch < 1:
        raise ValueError(f"a noise draw needs at least one position and one sample, got {length} and {batch}")
    k = int(rng.integers(1, length + 1))
    counts = np.round(np.linspace(k, k + (batch - 1) * (length / batch), batch)).astype(np.int64)
    counts = (counts - 1) % length + 1
    masks = np.zeros((batch, length), dtype=bool)
    for row, count in enumerate(counts):
        masks[row, rng.permutation(length)[:count]] = True
    return MaskDraw(masks, counts / length)


def single_masks(length: int) -> MaskDraw:
    """Each position masked alone (is_greedy's rows): `length` samples, one mask each."""
    return MaskDraw(np.eye(length, dtype=bool), np.full(length, 1.0 / length))
