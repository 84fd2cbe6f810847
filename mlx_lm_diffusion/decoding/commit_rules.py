"""Commit rules: which masked positions of the current block to fill at a step.

One small class per decoding algorithm behind one interface, registered by name
(`RULES`, built from the classes; `make_rule`). The ranking and the commit itself are
mlx-arsenal's primitives; a rule only chooses the score and the count. Every rule works
per row. A rule's per-block state (its quotas, its timesteps) is returned by
`start_block` and handed back to `select` and `known_commits`; the rule object itself
holds only its settings (and a memo of schedules it already built).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import mlx.core as mx
import numpy as np
from mlx_arsenal.diffusion import (
    entropy_bound_transfer,
    factor_transfer,
    threshold_transfer,
    topk_transfer,
    transfer_schedule,
)

THRESHOLD = 0.9  # Fast-dLLM's and SDAR's confidence threshold
ENTROPY_BOUND = 0.35  # SDAR's eb_threshold, also EB-Sampler's budget here


@dataclass
class StepInputs:
    """What a rule sees at one step of one block (block-local (B, Lb) arrays)."""

    x0: mx.array  # proposed tokens
    prob: mx.array  # probability of x0 under the temperature-1 softmax
    entropy: mx.array  # entropy of the temperature-1 softmax
    logprobs: mx.array  # (B, Lb, V) log-softmax of the processed logits; (B, K, V) with `rows`
    candidates: mx.array  # bool: masked positions of unfinished rows
    step: int  # index of this step within the block
    steps: int  # the block's step budget
    masked: Optional[np.ndarray] = None  # (B,) host count of candidates per row, when known
    # Block positions of `logprobs`' rows (B, K) when the step gathered the positions it
    # reads (mlx_lm_diffusion.decoding.decoders.gathered_rows); None: one row per block position.
    rows: Optional[mx.array] = None

    def per_position(self, values: mx.array) -> mx.array:
        """(B, Lb) of `values` computed per row of `logprobs` (B, K): 0 where not gathered
        (never a candidate)."""
        if self.rows is None:
            return values
        base = mx.zeros((values.shape[0], self.candidates.shape[1]), dtype=values.dtype)
        return mx.put_along_axis(base, self.rows, values, axis=1)


class CommitRule:
    """Interface: `start_block` once per block (returns the block's rule state), then
    `select` once per step. `takes` maps the options a rule reads to its fields."""

    name: ClassVar[str]
    takes: ClassVar[dict[str, str]] = {}
    # True: the rule ends a block within `steps` (its last step commits the rest).
    # False: it commits at least one token per step, so it ends within the block length.
    fixed_steps: ClassVar[bool] = True
    # The option that, given alone, selects this rule (threshold alone: Threshold), if any
    selected_by: ClassVar[Optional[str]] = None
    # How a running batch selects for several rows at once (decoders/fused_commit.py):
    # "quota" (from each row's count at its step), "stateless" (from the step's inputs
    # only), None (row by row: a rule that draws random numbers, reads a schedule, ...);
    # `compiled`: that joint selection runs in one compiled function (it reads nothing on
    # the host). Each rule declares its own (`__init_subclass__`): a subclass that selects
    # otherwise must not batch as its parent does.
    joint: ClassVar[Optional[str]] = None
    compiled: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for trait, default in (("selected_by", None), ("joint", None), ("compiled", False)):
            if trait not in cls.__dict__:
                setattr(cls, trait, default)

    def start_block(self, masked: np.ndarray, steps: int) -> Any:
        """The block's rule state, from each row's mask count (host) and the step budget."""
        return None

    def select(self, s: StepInputs, state: Any) -> mx.array:
        raise NotImplementedError

    def step_bound(self, steps: int, block_size: int) -> int:
        """The most steps this rule can take to fill a block: its schedule's length, or
        one token per step."""
        return steps if self.fixed_steps else block_size

    def known_commits(self, state: Any, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        """(B,) how many positions each row commits at this step, when that follows from
        the rows' mask counts alone; None when it depends on the model's output. The
        engine then queues the next forward before this step's tokens are read back.
        A rule that is not `fixed_steps` commits at least one per step, so a row with
        at most one mask left commits exactly what it has."""
        if not self.fixed_steps and (masked <= 1).all():
            return masked
        return None


@dataclass
class Quota:
    """A block's per-step quotas (B, steps), on device and on the host."""

    quota: mx.array
    host: np.ndarray

    @classmethod
    def of(cls, quota: mx.array) -> "Quota":
        return cls(quota, np.array(quota))

    def step_quota(self, step: int):
        """The step's quota: a plain int when every row has the same, so topk_transfer
        needs no host sync per step."""
        k = self.host[:, step]
        return int(k[0]) if (k == k[0]).all() else self.quota[:, step]


@dataclass
class LowConfidence(CommitRule):
    """LLaDA `generate`, remasking="low_confidence": LLaDA's even split of the block's
    masks over its steps (`get_num_transfer_tokens`), filled by the most confident
    proposals first. Deviation: the quota is per row (the reference is batch 1)."""

    name: ClassVar[str] = "low_confidence"
    joint: ClassVar[Optional[str]] = "quota"
    compiled: ClassVar[bool] = True
    # blocks with the same mask counts reuse their schedule (at block length 1, every
    # block), which keeps transfer_schedule's host check off the per-token path
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def quotas(self, masked: np.ndarray, steps: int) -> mx.array:
        return transfer_schedule(mx.array(masked, dtype=mx.int32), steps)

    def start_block(self, masked: np.ndarray, steps: int) -> Quota:
        key = (tuple(masked.tolist()), steps)
        if key not in self._memo:
            self._memo.clear()
            self._memo[key] = Quota.of(self.quotas(masked, steps))
        return self._memo[key]

    def known_commits(self, state: Quota, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        return np.minimum(state.host[:, step], masked)  # top-k of the candidates

    def scores(self, s: StepInputs) -> mx.array:
        return s.prob

    def select(self, s: StepInputs, state: Quota) -> mx.array:
        return topk_transfer(self.scores(s), s.candidates, state.step_quota(s.step))


@dataclass
class RandomRemasking(LowConfidence):
    """LLaDA `generate`, remasking="random": the same quota, positions in random order."""

    name: ClassVar[str] = "random"

    def scores(self, s: StepInputs) -> mx.array:
        return mx.random.uniform(shape=s.prob.shape)


@dataclass
class Threshold(CommitRule):
    """Fast-dLLM `get_transfer_index` with a threshold: commit every proposal with
    probability >= threshold, and the most confident one when none passes."""

    threshold: float = THRESHOLD
    name: ClassVar[str] = "threshold"
    selected_by: ClassVar[Optional[str]] = "threshold"
    joint: ClassVar[Optional[str]] = "stateless"
    compiled: ClassVar[bool] = True
    takes: ClassVar[dict[str, str]] = {"threshold": "threshold"}
    fixed_steps: ClassVar[bool] = False

    def select(self, s: StepInputs, state: Any) -> mx.array:
        return threshold_transfer(s.prob, s.candidates, self.threshold)


@dataclass
class BlockLengthQuota(LowConfidence):
    """SDAR's and LLaDA2.x's `get_num_transfer_tokens(block_length, steps)`: with
    `block_length`, the whole block length split evenly over the steps, whatever the
    block holds (a first block that also holds the prompt's tail, a last block cut at
    max_tokens), where LLaDA splits the masks left."""

    joint: ClassVar[Optional[str]] = "quota"
    compiled: ClassVar[bool] = True
    block_length: Optional[int] = None

    def quotas(self, masked: np.ndarray, steps: int) -> mx.array:
        if self.block_length is None:
            return super().quotas(masked, steps)
        return transfer_schedule(mx.full((masked.shape[0],), self.block_length, mx.int32), steps)


@dataclass
class LowConfidenceDynamic(BlockLengthQuota):
    """SDAR `low_confidence_dynamic` and LLaDA2.x `generate`: commit every proposal whose
    probability exceeds the threshold (strictly, as both references compare with >);
    when fewer pass than the step's even-split quota, commit the quota's top-k instead
    (at most the masks left, as LLaDA2.x caps it; SDAR's uncapped top-k would overwrite
    committed or prompt positions). The quota splits the block length over the steps,
    as both references do. mlx-arsenal has no threshold-else-quota primitive; this
    composes its threshold_transfer (force_one=False) and topk_transfer."""

    threshold: float = THRESHOLD
    strict: bool = True
    name: ClassVar[str] = "low_confidence_dynamic"
    joint: ClassVar[Optional[str]] = "quota"
    compiled: ClassVar[bool] = True
    takes: ClassVar[dict[str, str]] = {"threshold": "threshold", "block_length": "block_length"}

    def known_commits(self, state: Quota, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        # a quota covering every mask commits them all, whatever passes the threshold
        return masked if (state.host[:, step] >= masked).all() else None

    def select(self, s: StepInputs, state: Quota) -> mx.array:
        quota = state.step_quota(s.step)
        passing = threshold_transfer(s.prob, s.candidates, self.threshold, force_one=False, strict=self.strict)
        enough = mx.sum(passing, axis=1) >= quota
        return mx.where(enough[:, None], passing, topk_transfer(s.prob, s.candidates, quota))


@dataclass
class LowConfidenceStatic(BlockLengthQuota):
    """SDAR `low_confidence_static`: the step's even-split quota of the block length,
    filled by the most confident masked proposals. Deviation: the count is capped at
    the masks left (the reference's top-k then picks non-mask positions and overwrites
    committed or prompt tokens)."""

    name: ClassVar[str] = "low_confidence_static"
    joint: ClassVar[Optional[str]] = "quota"
    compiled: ClassVar[bool] = True
    takes: ClassVar[dict[str, str]] = {"block_length": "block_length"}


@dataclass
class EntropyBounded(CommitRule):
    """SDAR `entropy_bounded`: sort the masked positions by entropy (ascending) and
    commit the longest prefix whose running entropy sum, its own term included, stays
    strictly below `bound` (the reference's `searchsorted(cumsum, eb_threshold)`), at
    least one. Unlike EB-Sampler (`entropy_bound`) the last term counts, which
    mlx-arsenal's entropy_bound_transfer would need as an option to absorb this rule.
    Deviation, the evident intent: the reference sums -p log p of the chosen token's
    probability over the block (one number for every position) and never creates
    `transfer_index`; here each position's entropy is that of its predictive
    distribution."""

    bound: float = ENTROPY_BOUND
    name: ClassVar[str] = "entropy_bounded"
    # (not compiled: its per-row count goes to topk_transfer as an array, checked on the host)
    joint: ClassVar[Optional[str]] = "stateless"
    takes: ClassVar[dict[str, str]] = {"entropy_bound": "bound"}
    fixed_steps: ClassVar[bool] = False

    def select(self, s: StepInputs, state: Any) -> mx.array:
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
    selected_by: ClassVar[Optional[str]] = "factor"
    joint: ClassVar[Optional[str]] = "stateless"
    compiled: ClassVar[bool] = True
    takes: ClassVar[dict[str, str]] = {"factor": "factor"}
    fixed_steps: ClassVar[bool] = False

    def select(self, s: StepInputs, state: Any) -> mx.array:
        return factor_transfer(s.prob, s.candidates, self.factor)


@dataclass
class EntropyBound(CommitRule):
    """EB-Sampler: the longest entropy-sorted prefix whose entropy, less its last
    term, stays within `bound`; at least one per step."""

    bound: float = ENTROPY_BOUND
    name: ClassVar[str] = "entropy_bound"
    selected_by: ClassVar[Optional[str]] = "entropy_bound"
    joint: ClassVar[Optional[str]] = "stateless"
    compiled: ClassVar[bool] = True
    takes: ClassVar[dict[str, str]] = {"entropy_bound": "bound"}
    fixed_steps: ClassVar[bool] = False

    def select(self, s: StepInputs, state: Any) -> mx.array:
        return entropy_bound_transfer(s.entropy, s.candidates, self.bound)


def dream_timesteps(steps: int, eps: float = 1e-3) -> np.ndarray:
    """Dream's `torch.linspace(1, eps, steps + 1)`, in float32 as the reference."""
    return np.linspace(1.0, eps, steps + 1, dtype=np.float64).astype(np.float32)


@dataclass
class DreamConfidence(CommitRule):
    """Dream `diffusion_generate` with alg="maskgit_plus" (the subclasses: topk_margin,
    entropy): at step i of N, commit int(M * (1 - s / t)) of the M masks (all of them at
    the last step), t, s = linspace(1, eps, N + 1)[i : i + 2], ranked by the algorithm's
    confidence; alg_temp > 0 draws the positions from softmax(confidence / alg_temp)
    without replacement (Gumbel top-k). Deviations: counts are per row (the reference
    averages them over the batch); with sampling, confidence is taken from the
    temperature-1 softmax rather than the tempered one. The block state is the
    timesteps."""

    alg_temp: float = 0.0
    eps: float = 1e-3
    name: ClassVar[str] = "maskgit_plus"
    takes: ClassVar[dict[str, str]] = {"alg_temp": "alg_temp"}

    def start_block(self, masked: np.ndarray, steps: int) -> np.ndarray:
        return dream_timesteps(steps, self.eps)

    def confidence(self, s: StepInputs) -> mx.array:
        return s.prob

    def known_commits(self, state: np.ndarray, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        if step >= steps - 1:
            return masked
        t, u = state[step], state[step + 1]
        fraction = np.float32(1.0) - u / t  # float32 like the reference
        # int() of a float32 product, per row
        return np.floor(masked.astype(np.float32) * fraction).astype(np.int64)

    def count(self, s: StepInputs, state: np.ndarray):
        """The step's count: a plain int when every row has the same (no host sync)."""
        masked = s.masked if s.masked is not None else np.array(mx.sum(s.candidates, axis=1))
        k = self.known_commits(state, s.step, s.steps, masked)
        return int(k[0]) if (k == k[0]).all() else mx.array(k, dtype=mx.int32)

    def select(self, s: StepInputs, state: np.ndarray) -> mx.array:
        conf = self.confidence(s)
        if self.alg_temp > 0:
            gumbel = -mx.log(-mx.log(mx.random.uniform(shape=conf.shape)))
            conf = conf / self.alg_temp + gumbel
        return topk_transfer(conf, s.candidates, self.count(s, state))


@dataclass
class DreamTopkMargin(DreamConfidence):
    """Dream alg="topk_margin": confidence is the gap between the two most probable tokens."""

    name: ClassVar[str] = "topk_margin"

    def confidence(self, s: StepInputs) -> mx.array:
        top2 = mx.topk(s.logprobs, 2, axis=-1)  # unordered pair of the two largest
        p = mx.exp(top2.astype(mx.float32))
        return s.per_position(mx.abs(p[..., 0] - p[..., 1]))


@dataclass
class DreamEntropy(DreamConfidence):
    """Dream alg="entropy": positions ranked by negative entropy."""

    name: ClassVar[str] = "entropy"

    def confidence(self, s: StepInputs) -> mx.array:
        return -s.entropy


@dataclass
class DreamOrigin(DreamConfidence):
    """Dream `diffusion_generate` with alg="origin": each mask is revealed independently
    with probability 1 - s / t (1 at the last step)."""

    name: ClassVar[str] = "origin"
    takes: ClassVar[dict[str, str]] = {}

    def known_commits(self, state: np.ndarray, step: int, steps: int, masked: np.ndarray) -> Optional[np.ndarray]:
        return masked if step >= steps - 1 else None  # independent coin flips before

    def select(self, s: StepInputs, state: np.ndarray) -> mx.array:
        if s.step >= s.steps - 1:
            return s.candidates
        t, u = state[s.step], state[s.step + 1]
        p = float(np.float32(1.0) - u / t)
        return mx.logical_and(s.candidates, mx.random.uniform(shape=s.candidates.shape) < p)


# name -> rule class, in the order users see them listed
RULES: dict[str, type[CommitRule]] = {
    rule.name: rule
    for rule in (
        LowConfidence,
        LowConfidenceDynamic,
        LowConfidenceStatic,
        RandomRemasking,
        Threshold,
        Factor,
        EntropyBound,
        EntropyBounded,
        DreamConfidence,
        DreamTopkMargin,
        DreamEntropy,
        DreamOrigin,
    )
}

# The settings the rules read (beside block_length), in the order users see them, and
# the rule each setting selects when given alone: from the rules' own declarations
RULE_SETTINGS: tuple[str, ...] = tuple(
    dict.fromkeys(name for rule in RULES.values() for name in rule.takes if name != "block_length")
)
IMPLIED_RULES: dict[str, str] = {rule.selected_by: name for name, rule in RULES.items() if rule.selected_by}

# rules that read `threshold`
THRESHOLD_RULES: tuple[str, ...] = tuple(name for name, rule in RULES.items() if "threshold" in rule.takes)


def make_rule(name: str, **settings: Any) -> CommitRule:
    """Build a commit rule by name (see `RULES`) from the options it takes; settings that
    are None, or that the rule does not read, are left out (its own defaults apply)."""
    if name not in RULES:
        raise ValueError(f"Unknown strategy {name!r}; choose one of: {', '.join(RULES)}")
    rule = RULES[name]
    return rule(**{attr: settings[option] for option, attr in rule.takes.items() if settings.get(option) is not None})


def commits_next_only(rule: Any, width: int, steps: int, vocab_size: int) -> bool:
    """Whether `rule` fills a block of `width` masks strictly left to right, one position
    per step, when only the first mask has a prediction: a rule run over a block whose
    first open position is certain (probability 1, entropy 0, the case that lets most
    rules commit more) and every later one uniform, as the ar adapter's logits are."""
    if width == 1:
        return True
    if isinstance(rule, RandomRemasking):  # (its positions are drawn at random)
        return False
    rule = copy.deepcopy(rule)  # (a rule may record its steps: the protocol's does)
    uniform_prob, uniform_entropy = 1.0 / vocab_size, float(np.log(vocab_size))
    first = 0
    state = rule.start_block(np.array([width]), steps)
    for step in range(rule.step_bound(steps, width)):
        is_first = np.arange(width) == first
        candidates = mx.array((np.arange(width) >= first)[None])
        logprobs = np.where(is_first[:, None], [0.0, -np.inf], [np.log(0.5)] * 2)[None]  # (two ids stand for V)
        inputs = StepInputs(
            x0=mx.zeros((1, width), dtype=mx.int32),
            prob=mx.array(np.where(is_first, 1.0, uniform_prob)[None], dtype=mx.float32),
            entropy=mx.array(np.where(is_first, 0.0, uniform_entropy)[None], dtype=mx.float32),
            logprobs=mx.array(logprobs, dtype=mx.float32),
            candidates=candidates,
            step=step,
            steps=steps,
            masked=np.array([width - first]),
        )
        committed = np.flatnonzero(np.array(rule.select(inputs, state))[0] & np.array(candidates)[0])
        if committed.size > 1 or (committed.size == 1 and committed[0] != first):
            return False
        first += committed.size
        if first == width:
            return True
    return True
