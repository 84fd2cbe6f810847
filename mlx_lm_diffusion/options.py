"""Decoding options: what a caller may set, validated and resolved against a family."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import mlx.core as mx

from model_adapters import Adapter

from .commit_rules import RULES, THRESHOLD_RULES, CommitRule, make_rule
from .schedules import ScheduleQuota, schedule_name

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class UniformNoise:
    """A uniform-noise canvas (DiffusionGemma): no mask token; each canvas starts as random
    tokens and every step re-decides all of it (see Engine._decode_canvas). An adapter sets
    `uniform_noise` to a dict of its reference values; `entropy_bound` may be overridden
    (and `steps`, the most steps per canvas)."""

    entropy_bound: float = 0.1  # the acceptance budget (nats), entropy_bound_transfer
    t_min: float = 0.4  # temperature at the last step (linear in the remaining steps)
    t_max: float = 0.8  # temperature at the first step
    stability_threshold: int = 1  # stop a row once its argmax canvas repeats this many times
    confidence_threshold: float = 0.005  # ... and its mean entropy is below this


@dataclass
class DecodeOptions:
    """Options of one decode. `None` means "the family's default"."""

    max_tokens: int = 256
    block_length: Optional[int] = None
    steps: Optional[int] = None  # denoising steps per block
    strategy: Optional[str] = None  # commit rule name, see commit_rules.RULES
    threshold: Optional[float] = None  # a threshold means the "threshold" rule by default
    factor: float = 1.0
    entropy_bound: Optional[float] = None  # None: 0.35, or a uniform-noise family's own bound
    alg_temp: float = 0.0
    editing_threshold: Optional[float] = None  # revise committed tokens (LLaDA2.1 editing)
    max_post_steps: Optional[int] = None  # editing passes once a block is full (default 16)
    preset: Optional[str] = None  # a family's named settings (LLaDA2.1: "speed", "quality")
    edit_ops: Optional[Sequence[str]] = None  # token edits: "substitute" (insert/delete: unsupported)
    schedule: Optional[str] = None  # mask schedule (linear, cosine, sigmoid) as the quota rule
    temperature_schedule: Optional[Sequence[float]] = None  # one temperature per step (0: greedy)
    top_p: float = 1.0  # nucleus sampling with temperature_schedule
    sampler: Optional[Sampler] = None  # mlx-lm sampler over log-probs; greedy if None
    logits_processors: Sequence[LogitsProcessor] = field(default_factory=tuple)
    seed: Optional[int] = None
    causal_context: Optional[bool] = None  # Nemotron-Labs Diffusion: causal prefix and block seeds


@dataclass(frozen=True)
class ResolvedOptions:
    """Options with every family default filled in and every value checked."""

    max_tokens: int
    block_length: int
    steps: int
    rule: CommitRule
    editing_threshold: Optional[float]
    max_post_steps: int
    temperature_schedule: Optional[tuple]
    top_p: float
    sampler: Optional[Sampler]
    logits_processors: tuple
    seed: Optional[int]
    causal_context: Optional[bool] = None  # read by the adapter (Adapter.configure)
    uniform: Optional[UniformNoise] = None  # set: a uniform-noise canvas (no mask token)


def _check_positive_int(name: str, value, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}; {hint}")


def _check_temperatures(o: DecodeOptions, steps: int) -> Optional[tuple]:
    if not (isinstance(o.top_p, (int, float)) and 0.0 < o.top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {o.top_p!r}")
    if o.temperature_schedule is None:
        return None
    temperatures = tuple(o.temperature_schedule)
    if len(temperatures) != steps:
        raise ValueError(
            f"temperature_schedule has {len(temperatures)} values but there are {steps} steps "
            "per block; give one temperature per step"
        )
    if any(not isinstance(t, (int, float)) or not t >= 0 for t in temperatures):
        raise ValueError("temperature_schedule values must be numbers >= 0 (0 means greedy)")
    if o.sampler is not None:
        raise ValueError("give either sampler or temperature_schedule, not both")
    return tuple(float(t) for t in temperatures)


def _with_preset(o: DecodeOptions, adapter: Adapter) -> DecodeOptions:
    """Fill the options left unset from the family's named preset, if one is asked for."""
    if o.preset is None:
        return o
    presets = adapter.presets
    if o.preset not in presets:
        known = ", ".join(repr(p) for p in presets) or "none"
        raise ValueError(f"Unknown preset {o.preset!r} for {adapter.family}; its presets: {known}")
    return replace(o, **{k: v for k, v in presets[o.preset].items() if getattr(o, k) is None})


EDIT_OPS = ("substitute", "insert", "delete")


def _check_edit_ops(o: DecodeOptions, defaults) -> None:
    """Substitution edits are LLaDA2.1/2.2's editing_threshold; LLaDA2.2's insert and
    delete edits change the canvas length, which the engine's fixed canvas cannot do."""
    ops = set(o.edit_ops or ())
    if ops - set(EDIT_OPS):
        raise ValueError(f"Unknown edit_ops {sorted(ops - set(EDIT_OPS))}; choose from {EDIT_OPS}")
    if ops & {"insert", "delete"}:
        raise ValueError(
            "insert and delete edits (LLaDA2.2) change the canvas length and are not supported; "
            "only substitution edits are: edit_ops=('substitute',) with editing_threshold"
        )
    if ops and o.editing_threshold is None and defaults.editing_threshold is None:
        raise ValueError("substitution edits need an editing_threshold (or a preset that sets one)")


def resolve(options: DecodeOptions, adapter: Adapter, prompt_len: int) -> ResolvedOptions:
    """Fill family defaults and validate; raises ValueError saying what to change."""
    o = _with_preset(options, adapter)
    _check_edit_ops(o, adapter.defaults)
    _check_positive_int("max_tokens", o.max_tokens, "ask for at least one token")
    if o.block_length is not None:
        _check_positive_int("block_length", o.block_length, "use a positive block size")
    if o.steps is not None:
        _check_positive_int("steps", o.steps, "use at least one denoising step per block")
    if not o.factor > 0:
        raise ValueError(f"factor must be > 0, got {o.factor!r}")
    if o.entropy_bound is not None and not o.entropy_bound >= 0:
        raise ValueError(f"entropy_bound must be >= 0, got {o.entropy_bound!r}")
    for name in ("threshold", "editing_threshold"):
        value = getattr(o, name)
        if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
            raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    if o.max_post_steps is not None and (not isinstance(o.max_post_steps, int) or o.max_post_steps < 0):
        raise ValueError(f"max_post_steps must be an integer >= 0, got {o.max_post_steps!r}")
    if not o.alg_temp >= 0:
        raise ValueError(f"alg_temp must be >= 0, got {o.alg_temp!r}")

    defaults = adapter.defaults
    strategy = o.strategy
    if isinstance(strategy, CommitRule):  # a ready-made rule (the protocol builds its own)
        pass
    elif o.schedule is not None:
        if strategy is not None:
            raise ValueError("give either schedule or strategy, not both")
        strategy = ScheduleQuota(schedule_name(o.schedule))
    elif strategy is None:
        # a threshold selects the "threshold" rule, unless the family's rule takes one
        takes_threshold = defaults.strategy in THRESHOLD_RULES
        strategy = "threshold" if o.threshold is not None and not takes_threshold else defaults.strategy
    if isinstance(strategy, str) and strategy not in RULES:
        raise ValueError(f"Unknown strategy {strategy!r}; choose one of: {', '.join(RULES)}")
    if o.threshold is not None and strategy not in THRESHOLD_RULES:
        raise ValueError(
            f"threshold applies to the {', '.join(THRESHOLD_RULES)} strategies, not {strategy!r}; "
            "drop threshold or choose one of those"
        )
    threshold = o.threshold if o.threshold is not None else defaults.threshold

    uniform = _check_uniform(o, adapter)
    block_length = o.block_length or defaults.block_length or o.max_tokens
    if not adapter.align_blocks and uniform is None:  # aligned blocks and canvases keep their size
        block_length = min(block_length, o.max_tokens)
    steps = o.steps or defaults.steps or block_length
    entropy_bound = o.entropy_bound if o.entropy_bound is not None else 0.35
    if uniform is not None:
        entropy_bound = o.entropy_bound if o.entropy_bound is not None else uniform.entropy_bound
        uniform = replace(uniform, entropy_bound=entropy_bound)
    # a uniform-noise canvas is decoded whole, even past max_tokens
    span = -(-o.max_tokens // block_length) * block_length if uniform is not None else o.max_tokens
    if adapter.max_length is not None and prompt_len + span > adapter.max_length:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({o.max_tokens}"
            + (f", decoded as whole canvases: {span}" if span != o.max_tokens else "")
            + f") exceeds the model's "
            f"context of {adapter.max_length} tokens; shorten the prompt or lower max_tokens"
        )
    temperatures = _check_temperatures(o, steps)
    rule = strategy if isinstance(strategy, CommitRule) else make_rule(
        strategy,
        threshold=threshold,
        factor=o.factor,
        entropy_bound=entropy_bound,
        alg_temp=o.alg_temp,
        block_length=block_length,
    )
    return ResolvedOptions(
        max_tokens=o.max_tokens,
        block_length=block_length,
        steps=steps,
        rule=rule,
        editing_threshold=(
            o.editing_threshold if o.editing_threshold is not None else defaults.editing_threshold
        ),
        max_post_steps=o.max_post_steps if o.max_post_steps is not None else defaults.max_post_steps,
        temperature_schedule=temperatures,
        top_p=float(o.top_p),
        sampler=o.sampler,
        logits_processors=tuple(o.logits_processors or ()),
        seed=o.seed,
        causal_context=_check_causal_context(o, adapter),
        uniform=uniform,
    )


def _check_uniform(o: DecodeOptions, adapter: Adapter) -> Optional[UniformNoise]:
    """The adapter's uniform-noise settings, or None for a masked canvas."""
    uniform = adapter.uniform_noise
    if uniform is None:
        return None
    for name in ("editing_threshold", "temperature_schedule", "schedule"):
        if getattr(o, name) is not None:
            raise ValueError(
                f"{name} does not apply to {adapter.family}, whose canvas is uniform noise "
                "(every step re-decides every position); drop it"
            )
    return UniformNoise(**uniform)


def _check_causal_context(o: DecodeOptions, adapter: Adapter) -> Optional[bool]:
    if o.causal_context is None:
        return None
    if not hasattr(adapter, "causal_context"):
        raise ValueError(f"causal_context does not apply to {adapter.family}; drop it")
    if not isinstance(o.causal_context, bool):
        raise ValueError(f"causal_context must be True or False, got {o.causal_context!r}")
    return o.causal_context


__all__ = ["DecodeOptions", "ResolvedOptions", "resolve", "replace"]
