"""What each task's requests cost: tokens, forwards and seconds, beside lm-eval's scores.

lm-eval reports accuracy only; a diffusion model trades accuracy for speed through its
decoding options (threshold, caches, block length), so every evaluation also counts,
per task, what generating its answers took (`generation`: tokens emitted, EOS included,
and the forwards each answer's decode needed alone, summed) and what scoring its
continuations took (`scoring`: likelihood forwards). Tokens per forward is the parallel
decoding's gain (1.0 for one token per forward); tokens per second is the batched
generation's wall-clock throughput.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class TaskSpeed:
    """One task's costs."""

    generated: int = 0  # generate_until requests
    tokens: int = 0  # tokens they emitted (EOS included)
    forwards: int = 0  # forwards their decodes needed
    seconds: float = 0.0  # wall-clock seconds generating
    scored: int = 0  # loglikelihood / loglikelihood_rolling requests
    scoring_forwards: int = 0  # the forwards scoring them took
    scoring_seconds: float = 0.0

    @property
    def tokens_per_forward(self) -> Optional[float]:
        return self.tokens / self.forwards if self.forwards else None

    @property
    def tokens_per_second(self) -> Optional[float]:
        return self.tokens / self.seconds if self.seconds > 0 else None

    @property
    def all_forwards(self) -> int:
        return self.forwards + self.scoring_forwards

    def record(self) -> dict:
        """The counts and the two rates, for the results JSON."""
        return {
            **asdict(self),
            "tokens_per_forward": self.tokens_per_forward,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass
class SpeedTally:
    """Costs per task name (lm-eval's Instance.task_name)."""

    tasks: dict = field(default_factory=dict)

    def task(self, name: Optional[str]) -> TaskSpeed:
        return self.tasks.setdefault(name or "unnamed", TaskSpeed())

    def record(self) -> dict:
        return {name: speed.record() for name, speed in self.tasks.items()}
