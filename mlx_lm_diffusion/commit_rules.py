"""Commit rules: which masked positions of the current block to fill at a step.

One small class per decoding algorithm behind one interface, selected by name
(`make_rule`). The ranking and the commit itself are mlx-arsenal's primitives;
a rule only chooses the score and the count. Every rule works per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import mlx.core as mx
import numpy as np
from mlx_arsenal.diffusion import (
    entropy_bound_transfer,
    factor_transfer,
    threshold_transfer,
    topk_transfer,
    transfer_schedule,
)


@dataclass
class StepInputs:
    """What a rule sees at one step of one block (block-local (B, Lb) arrays)."""

    x0: mx.array  # proposed tokens
    prob: mx.array  # probability of x0 under the temperature-1 softmax
    entropy: mx.array  # entropy of the temperature-1 softmax
    logprobs: mx.array  # (B, Lb, V) log-softmax of the processed logits
    candidates: mx.array  # bool: masked positions of unfinished rows
    step: int  # index of this step within the block
    steps: int  # the block's step budget
    masked: Optional[np.ndarray] = None  # (B,) host count of candidates per row, when known


class CommitRule:
    """Interface: `start_block` once per block, then `select` once per step."""

    name: ClassVar[str]
    # True: the rule ends a block within `steps` (its last step commits the rest).
    # False: it commits at least one token per step, so it ends within the block length.
    fixed_steps: ClassVar[bool] = True

    def start_block(self, candidates: mx.array, steps: int) -> None:
        pass

    def select(self, s: StepInputs) -> mx.array:
        raise NotImplementedError

    def known_commits(self, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        """(B,) how many positions each row commits at this step, when that follows from
        the rows' mask counts alone; None when it depends on the model's output. The
        engine then queues the next forward before this step's tokens are read back.
        A rule that is not `fixed_steps` commits at least one per step, so a row with
        at most one mask left commits exactly what it has."""
        if not self.fixed_steps and (masked <= 1).all():
            return masked
        return None


class LowConfidence(CommitRule):
    """LLaDA `generate`, remasking="low_confidence": LLaDA's even split of the block's
    masks over its steps (`get_num_transfer_tokens`), filled by the most confident
    proposals first. Deviation: the quota is per row (the reference is batch 1)."""

    name = "low_confidence"

    def start_block(self, candidates: mx.array, steps: int) -> None:
        # The engine builds `candidates` from host data, so reading it back costs no sync;
        # blocks with the same mask counts reuse their schedule (at block length 1, every
        # block), which keeps transfer_schedule's host check off the per-token path.
        counts = np.array(candidates).sum(axis=1)
        key = (tuple(counts.tolist()), steps)
        if getattr(self, "_schedule_key", None) != key:
            self.quota = transfer_schedule(mx.array(counts, dtype=mx.int32), steps)
            self._schedule_key = key

    def host_quota(self, step: int) -> np.ndarray:
        """(B,) the step's quotas on the host (the block's quotas are read back once)."""
        if getattr(self, "_host_quota", (None, None))[0] is not self.quota:
            self._host_quota = (self.quota, np.array(self.quota))
        return self._host_quota[1][:, step]

    def step_quota(self, step: int):
        """The step's quota: a plain int when every row has the same, so topk_transfer
        needs no host sync per step."""
        k = self.host_quota(step)
        return int(k[0]) if (k == k[0]).all() else self.quota[:, step]

    def known_commits(self, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        return np.minimum(self.host_quota(step), masked)  # top-k of the candidates

    def scores(self, s: StepInputs) -> mx.array:
        return s.prob

    def select(self, s: StepInputs) -> mx.array:
        return topk_transfer(self.scores(s), s.candidates, self.step_quota(s.step))


class RandomRemasking(LowConfidence):
    """LLaDA `generate`, remasking="random": the same quota, positions in random order."""

    name = "random"

    def scores(self, s: StepInputs) -> mx.array:
        return mx.random.uniform(shape=s.prob.shape)


@dataclass
class Threshold(CommitRule):
    """Fast-dLLM `get_transfer_index` with a threshold: commit every proposal with
    probability >= threshold, and the most confident one when none passes."""

    threshold: float = 0.9
    name: ClassVar[str] = "threshold"
    fixed_steps: ClassVar[bool] = False

    def select(self, s: StepInputs) -> mx.array:
        return threshold_transfer(s.prob, s.candidates, self.threshold)


def _block_length_quota(rule: LowConfidence, candidates: mx.array, steps: int) -> None:
    """With `rule.block_length`, SDAR's and LLaDA2.x's `get_num_transfer_tokens(
    block_length, steps)`: the whole block length split evenly over the steps, whatever
    the block holds (a first block that also holds the prompt's tail, a last block cut
    at max_tokens), where LLaDA splits the masks left."""
    LowConfidence.start_block(rule, candidates, steps)
    if rule.block_length is not None:
        rule.quota = transfer_schedule(mx.full((candidates.shape[0],), rule.block_length, mx.int32), steps)


@dataclass
class LowConfidenceDynamic(LowConfidence):
    """SDAR `low_confidence_dynamic` and LLaDA2.x `generate`: commit every proposal whose
    probability exceeds the threshold (strictly, as both references compare with >);
    when fewer pass than the step's even-split quota, commit the quota's top-k instead
    (at most the masks left, as LLaDA2.x caps it; SDAR's uncapped top-k would overwrite
    committed or prompt positions). With `block_length` the quota splits the block
    length over the steps, as both references do."""

    threshold: float = 0.9
    strict: bool = True
    block_length: Optional[int] = None
    name: ClassVar[str] = "low_confidence_dynamic"

    def start_block(self, candidates: mx.array, steps: int) -> None:
        _block_length_quota(self, candidates, steps)

    def known_commits(self, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        # a quota covering every mask commits them all, whatever passes the threshold
        return masked if (self.host_quota(step) >= masked).all() else None

    def select(self, s: StepInputs) -> mx.array:
        quota = self.step_quota(s.step)
        passing = threshold_transfer(s.prob, s.candidates, self.threshold, force_one=False, strict=self.strict)
        enough = mx.sum(passing, axis=1) >= quota
        return mx.where(enough[:, None], passing, topk_transfer(s.prob, s.candidates, quota))


@dataclass
class LowConfidenceStatic(LowConfidence):
    """SDAR `low_confidence_static`: the step's even-split quota of the block length,
    filled by the most confident masked proposals. Deviation: the count is capped at
    the masks left (the reference's top-k then picks non-mask positions and overwrites
    committed or prompt tokens)."""

    block_length: Optional[int] = None
    name: ClassVar[str] = "low_confidence_static"

    def start_block(self, candidates: mx.array, steps: int) -> None:
        _block_length_quota(self, candidates, steps)


@dataclass
class EntropyBounded(CommitRule):
    """SDAR `entropy_bounded`: sort the masked positions by entropy (ascending) and
    commit the longest prefix whose running entropy sum, its own term included, stays
    strictly below `bound` (the reference's `searchsorted(cumsum, eb_threshold)`), at
    least one. Unlike EB-Sampler (`entropy_bound`) the last term counts. Deviation, the
    evident intent: the reference sums -p log p of the chosen token's probability over
    the block (one number for every position) and never creates `transfer_index`;
    here each position's entropy is that of its predictive distribution."""

    bound: float = 0.35
    name: ClassVar[str] = "entropy_bounded"
    fixed_steps: ClassVar[bool] = False

    def select(self, s: StepInputs) -> mx.array:
        entropy = mx.where(s.candidates, s.entropy.astype(mx.float32), mx.inf)
        within = mx.cumsum(mx.sort(entropy, axis=1), axis=1) < self.bound
        count = mx.maximum(mx.sum(within, axis=1), 1).astype(mx.int32)
        return topk_transfer(-s.entropy, s.candidates, count)


@dataclass
class Factor(CommitRule):
    """Fast-dLLM `get_transfer_index_dynamic`: the longest confidence-sorted prefix with
    (i + 1)(1 - c_i) <= factor (without the reference's last-candidate off-by-one)."""

    factor: float = 1.0
    name: ClassVar[str] = "factor"
    fixed_steps: ClassVar[bool] = False

    def select(self, s: StepInputs) -> mx.array:
        return factor_transfer(s.prob, s.candidates, self.factor)


@dataclass
class EntropyBound(CommitRule):
    """EB-Sampler: the longest entropy-sorted prefix whose entropy, less its last
    term, stays within `bound`; at least one per step."""

    bound: float = 0.35
    name: ClassVar[str] = "entropy_bound"
    fixed_steps: ClassVar[bool] = False

    def select(self, s: StepInputs) -> mx.array:
        return entropy_bound_transfer(s.entropy, s.candidates, self.bound)


def dream_timesteps(steps: int, eps: float = 1e-3) -> np.ndarray:
    """Dream's `torch.linspace(1, eps, steps + 1)`, in float32 as the reference."""
    return np.linspace(1.0, eps, steps + 1, dtype=np.float64).astype(np.float32)


@dataclass
class DreamConfidence(CommitRule):
    """Dream `diffusion_generate` with alg in {maskgit_plus, topk_margin, entropy}: at
    step i of N, commit int(M * (1 - s / t)) of the M masks (all of them at the last
    step), t, s = linspace(1, eps, N + 1)[i : i + 2], ranked by the algorithm's
    confidence; alg_temp > 0 draws the positions from softmax(confidence / alg_temp)
    without replacement (Gumbel top-k). Deviations: counts are per row (the reference
    averages them over the batch); with sampling, confidence is taken from the
    temperature-1 softmax rather than the tempered one."""

    alg: str = "maskgit_plus"
    alg_temp: float = 0.0
    eps: float = 1e-3
    name: ClassVar[str] = "maskgit_plus"

    def start_block(self, candidates: mx.array, steps: int) -> None:
        self.timesteps = dream_timesteps(steps, self.eps)

    def confidence(self, s: StepInputs) -> mx.array:
        if self.alg == "maskgit_plus":
            return s.prob
        if self.alg == "topk_margin":
            top2 = mx.topk(s.logprobs, 2, axis=-1)  # unordered pair of the two largest
            p = mx.exp(top2.astype(mx.float32))
            return mx.abs(p[..., 0] - p[..., 1])
        return -s.entropy  # "entropy": Dream ranks by negative entropy

    def known_commits(self, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        if step >= steps - 1:
            return masked
        t, u = self.timesteps[step], self.timesteps[step + 1]
        fraction = np.float32(1.0) - u / t  # float32 like the reference
        # int() of a float32 product, per row
        return np.floor(masked.astype(np.float32) * fraction).astype(np.int64)

    def count(self, s: StepInputs):
        """The step's count: a plain int when every row has the same (no host sync)."""
        masked = s.masked if s.masked is not None else np.array(mx.sum(s.candidates, axis=1))
        k = self.known_commits(s.step, s.steps, masked)
        return int(k[0]) if (k == k[0]).all() else mx.array(k, dtype=mx.int32)

    def select(self, s: StepInputs) -> mx.array:
        conf = self.confidence(s)
        if self.alg_temp > 0:
            gumbel = -mx.log(-mx.log(mx.random.uniform(shape=conf.shape)))
            conf = conf / self.alg_temp + gumbel
        return topk_transfer(conf, s.candidates, self.count(s))


@dataclass
class DreamOrigin(DreamConfidence):
    """Dream `diffusion_generate` with alg="origin": each mask is revealed independently
    with probability 1 - s / t (1 at the last step)."""

    alg: str = "origin"
    name: ClassVar[str] = "origin"

    def known_commits(self, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        return masked if step >= steps - 1 else None  # independent coin flips before

    def select(self, s: StepInputs) -> mx.array:
        if s.step >= s.steps - 1:
            return s.candidates
        t, u = self.timesteps[s.step], self.timesteps[s.step + 1]
        p = float(np.float32(1.0) - u / t)
        return mx.logical_and(s.candidates, mx.random.uniform(shape=s.candidates.shape) < p)


RULES: tuple[str, ...] = (
    "low_confidence",
    "low_confidence_dynamic",
    "low_confidence_static",
    "random",
    "threshold",
    "factor",
    "entropy_bound",
    "entropy_bounded",
    "maskgit_plus",
    "topk_margin",
    "entropy",
    "origin",
)


# rules that read `threshold`
THRESHOLD_RULES: tuple[str, ...] = ("threshold", "low_confidence_dynamic")


def make_rule(
    name: str,
    *,
    threshold: Optional[float] = None,
    factor: float = 1.0,
    entropy_bound: float = 0.35,
    alg_temp: float = 0.0,
    block_length: Optional[int] = None,
) -> CommitRule:
    """Build a commit rule by name (see `RULES`). `block_length` sets the quota of the
    block-diffusion rules (low_confidence_dynamic / _static) as their references do."""
    if name == "low_confidence":
        return LowConfidence()
    if name == "low_confidence_dynamic":
        return LowConfidenceDynamic(0.9 if threshold is None else threshold, block_length=block_length)
    if name == "low_confidence_static":
        return LowConfidenceStatic(block_length=block_length)
    if name == "entropy_bounded":
        return EntropyBounded(entropy_bound)
    if name == "random":
        return RandomRemasking()
    if name == "threshold":
        return Threshold(0.9 if threshold is None else threshold)
    if name == "factor":
        return Factor(factor)
    if name == "entropy_bound":
        return EntropyBound(entropy_bound)
    if name in ("maskgit_plus", "topk_margin", "entropy"):
        return DreamConfidence(alg=name, alg_temp=alg_temp)
    if name == "origin":
        return DreamOrigin()
    raise ValueError(f"Unknown strategy {name!r}; choose one of: {', '.join(RULES)}")
