"""Decoding options: one schema, validated in one place, resolved against a family.

Every option is an `Option` in one schema (mlx_lm_diffusion.decoding.option_schema):
the generic ones and the ones each family declares on its adapter. `DecodeOptions`
holds a call's options by keyword; `resolve` fills in the checkpoint's and the family's
defaults and checks what applies to the family and its decoder.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Optional

from mlx_lm.sample_utils import greedy_sampler

from mlx_lm_diffusion.decoding import generation_defaults
from mlx_lm_diffusion.decoding.commit_rules import (  # noqa: F401 (IMPLIED_RULES: the server's, as before)
    IMPLIED_RULES,
    RULE_SETTINGS,
    RULES,
    CommitRule,
    commits_next_only,
    make_rule,
)
from mlx_lm_diffusion.decoding.decoders import decoder_class
from mlx_lm_diffusion.decoding.decoders.base import allowed_bias
from mlx_lm_diffusion.decoding.option_schema import (  # noqa: F401 (the schema's names, as before)
    GENERIC_NAMES,
    GENERIC_OPTIONS,
    LogitsProcessor,
    Sampler,
    add_arguments,
    check_fields,
    named_options,
    schema,
)
from mlx_lm_diffusion.decoding.schedules import ScheduleQuota
from model_adapters import Adapter


class DecodeOptions:
    """Options of one decode, by keyword (any name of `schema()`); an option left out
    (or None) takes the checkpoint's default (its generation_config.json), else the
    family's (max_tokens: 256). Unknown names are a TypeError, as for any Python call."""

    def __init__(self, max_tokens: Optional[int] = None, **values: Any):
        known = schema()
        unknown = sorted(set(values) - set(known))
        if unknown:
            near = [m for name in unknown for m in difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)]
            hint = f"did you mean {' / '.join(repr(m) for m in near)}? " if near else ""
            raise TypeError(f"unexpected options {unknown}; {hint}known: {sorted(known)}")
        values = {"max_tokens": max_tokens, **values}
        self.values = {k: v for k, v in values.items() if v is not None}

    def get(self, name: str) -> Any:
        return self.values.get(name, schema()[name].default)

    def __getattr__(self, name: str) -> Any:
        if name == "values":  # (not set yet: called during unpickling)
            raise AttributeError(name)
        if name in schema():
            return self.get(name)
        raise AttributeError(name)

    def replace(self, **changes: Any) -> "DecodeOptions":
        return DecodeOptions(**{**self.values, **changes})

    def __repr__(self) -> str:
        return f"DecodeOptions({', '.join(f'{k}={v!r}' for k, v in self.values.items())})"


@dataclass(frozen=True)
class ResolvedOptions:
    """Options with every default filled in and every value checked. `family` holds the
    family's own options (declared by its adapter), with their defaults."""

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
    family: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    allowed_tokens: Optional[tuple] = None  # None: every id may be generated
    # the ids that end this decode: the adapter's EOS ids, none with ignore_eos (a request's
    # setting, kept here and not on the adapter, which every row of a batch shares)
    eos_ids: frozenset = frozenset()


def resolve(options: DecodeOptions, adapter: Adapter, prompt_len: int, suffix_len: int = 0) -> ResolvedOptions:
    """Fill the family's defaults and check every value; raises ValueError saying what
    to change. Order: the family's preset fills what is unset, each value is checked by
    its Option, the decoder and the family refuse what does not apply to them."""
    explicit = _with_preset(dict(options.values), adapter)
    values = generation_defaults.fill(explicit, getattr(adapter, "model", None))  # the checkpoint's own
    own = {o.name: o for o in adapter.options}
    for name, value in values.items():
        if name not in own and name not in GENERIC_NAMES:
            raise ValueError(f"{name} does not apply to {adapter.family}; drop it")
        if not (name == "strategy" and isinstance(value, CommitRule)):
            values[name] = (own.get(name) or schema()[name]).check(value)
    if values.get("sampler") is greedy_sampler:  # mlx-lm's make_sampler(0.0): the decoders' own argmax
        del values["sampler"]  # (which reads nothing back, and a greedy-only decoder takes)
    family = {name: values.get(name, o.default) for name, o in own.items()}
    decoder = decoder_class(adapter, family)
    values = {k: v for k, v in values.items() if k in explicit or k not in decoder.unread_defaults}
    decoder.check_options(values, adapter)
    allowed_bias(values.get("allowed_tokens"), adapter)  # (refuses ids outside the vocabulary, the mask id)
    adapter.check_options(family, values)
    get = lambda name: values.get(name, schema()[name].default)  # noqa: E731

    defaults = adapter.defaults
    block_length = get("block_length") or defaults.block_length or get("max_tokens")
    max_tokens = _fit_context(adapter, decoder, prompt_len, suffix_len, get("max_tokens"), block_length)
    if not (adapter.align_blocks or decoder.whole_canvases):  # aligned blocks and canvases keep their size
        block_length = min(block_length, max_tokens)
    steps = get("steps") or defaults.steps or block_length
    resolved = ResolvedOptions(
        max_tokens=max_tokens,
        block_length=block_length,
        steps=steps,
        rule=_rule(values, defaults, block_length),
        editing_threshold=_default(get("editing_threshold"), defaults.editing_threshold),
        max_post_steps=_default(get("max_post_steps"), defaults.max_post_steps),
        temperature_schedule=_temperatures(values, steps),
        top_p=float(get("top_p")),
        sampler=get("sampler"),
        logits_processors=tuple(get("logits_processors") or ()),
        seed=get("seed"),
        family=MappingProxyType(family),
        allowed_tokens=get("allowed_tokens"),
        eos_ids=frozenset() if get("ignore_eos") else frozenset(adapter.eos_ids),
    )
    adapter.check_resolved(resolved)
    if adapter.predicts_next_only and not commits_next_only(resolved.rule, block_length, steps, adapter.vocab_size):
        raise ValueError(adapter.next_only_refusal(resolved))
    return resolved


def default_max_tokens(model: Any) -> int:
    """The length of an answer nobody bounded: the checkpoint's generation_config.json
    `max_new_tokens`, else the schema's default (what `resolve` gives max_tokens=None)."""
    defaults = getattr(model, generation_defaults.GENERATION_DEFAULTS_ATTR, None) or {}
    return int(defaults.get("max_tokens") or schema()["max_tokens"].default)


def forward_bound(resolved: ResolvedOptions, adapter: Adapter, prompt_len: int) -> int:
    """The most model forwards this decode can take: each block's step bound (the rule's
    schedule, or one token per step, plus the editing passes), summed over the blocks."""
    return decoder_class(adapter, resolved.family)(adapter, resolved, keep_logprobs=False).forward_bound(prompt_len)


def check_forward_budget(
    resolved: ResolvedOptions, adapter: Adapter, prompt_len: int, max_forwards: Optional[int]
) -> int:
    """Refuse (ValueError) a decode that could take more than `max_forwards` forwards; a
    server checks this before anything runs. Returns the bound."""
    bound = forward_bound(resolved, adapter, prompt_len)
    if max_forwards is not None and bound > max_forwards:
        raise ValueError(
            f"this request could take up to {bound} model forwards (steps per block x blocks, "
            f"plus editing passes); this server allows {max_forwards} per request: lower steps, "
            "max_tokens or max_post_steps, or raise a block length"
        )
    return bound


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _with_preset(values: dict, adapter: Adapter) -> dict:
    """Fill the options left unset from the family's named preset, if one is asked for.
    A rule chosen explicitly (strategy or schedule) replaces the preset's whole rule: its
    threshold would not apply to the rule chosen."""
    preset = values.get("preset")
    if preset is None:
        return values
    presets = adapter.presets
    if preset not in presets:
        known = ", ".join(repr(p) for p in presets) or "none"
        raise ValueError(f"Unknown preset {preset!r} for {adapter.family}; its presets: {known}")
    filled = presets[preset]
    if values.get("strategy") is not None or values.get("schedule") is not None:
        filled = {k: v for k, v in filled.items() if k not in generation_defaults.RULE_OPTIONS}
    return {**filled, **values}


# a rule setting given without a strategy selects the rule that reads it, when the family's
# own rule does not (the rules declare it: CommitRule.selected_by; alg_temp selects none: the
# rules of the families offering it read it)


def _rule(values: dict, defaults: Any, block_length: int) -> CommitRule:
    """The commit rule: a ready-made one, a mask schedule's quota, or one by name (a
    setting such as threshold selects its rule unless the family's rule reads it). A
    setting the rule would not read is an error, never silently dropped."""
    strategy = values.get("strategy")
    if isinstance(strategy, CommitRule):  # (the protocol builds its own)
        return strategy
    given = [name for name in RULE_SETTINGS if values.get(name) is not None]
    if values.get("schedule") is not None:
        if strategy is not None:
            raise ValueError("give either schedule or strategy, not both")
        if given:
            raise ValueError(
                f"{given[0]} does not apply to a mask schedule (its quotas decide what each "
                f"step commits); drop {given[0]} or schedule"
            )
        return ScheduleQuota(values["schedule"])
    if strategy is None:
        strategy = defaults.strategy
        unread = [name for name in given if name not in RULES[strategy].takes]
        implying = [name for name in unread if name in IMPLIED_RULES]
        if len(implying) > 1:
            raise ValueError(f"{' and '.join(implying)} each select a rule of their own; give one (or name a strategy)")
        if implying:
            strategy = IMPLIED_RULES[implying[0]]
    if strategy not in RULES:
        raise ValueError(f"Unknown strategy {strategy!r}; choose one of: {', '.join(RULES)}")
    for name in given:
        if name not in RULES[strategy].takes:
            readers = [rule for rule, cls in RULES.items() if name in cls.takes]
            raise ValueError(
                f"{name} applies to the {', '.join(readers)} strategies, not {strategy!r}; "
                f"drop {name} or choose one of those"
            )
    settings = {name: values.get(name, getattr(defaults, name, None)) for name in RULE_SETTINGS}
    return make_rule(strategy, block_length=block_length, **settings)


def _fit_context(
    adapter: Adapter, decoder: Any, prompt_len: int, suffix_len: int, max_tokens: int, block_length: int
) -> int:
    """max_tokens capped to what the model's context holds after the prompt and an infill's
    suffix (the decode then ends with finish_reason "length"); a prompt that fills the
    context is an error."""
    if adapter.max_length is None:
        return max_tokens
    room = adapter.max_length - prompt_len - suffix_len
    fitted = decoder.fit_length(min(max_tokens, room), block_length, room) if room > 0 else 0
    if fitted < 1 and room > 0:  # a canvas of whole blocks (DiffusionGemma) that cannot fit
        raise ValueError(
            f"a block of {block_length} tokens does not fit the {room} tokens the model's context of "
            f"{adapter.max_length} leaves after the prompt; lower block_length"
        )
    if fitted < 1:
        given = (
            f"the prompt ({prompt_len} tokens) and suffix ({suffix_len} tokens) leave"
            if suffix_len
            else f"the prompt ({prompt_len} tokens) leaves"
        )
        raise ValueError(
            f"{given} no room in the model's context of {adapter.max_length} tokens; shorten "
            f"{'them' if suffix_len else 'it (or reset the conversation)'}"
        )
    return fitted


def _temperatures(values: dict, steps: int) -> Optional[tuple]:
    temperatures = values.get("temperature_schedule")
    if temperatures is None:
        return None
    if len(temperatures) != steps:
        raise ValueError(
            f"temperature_schedule has {len(temperatures)} values but there are {steps} steps "
            "per block; give one temperature per step"
        )
    if values.get("sampler") is not None:
        raise ValueError("give either sampler or temperature_schedule, not both")
    return tuple(float(t) for t in temperatures)


__all__ = [
    "DecodeOptions",
    "ResolvedOptions",
    "GENERIC_OPTIONS",
    "schema",
    "named_options",
    "check_fields",
    "add_arguments",
    "resolve",
    "forward_bound",
    "default_max_tokens",
    "check_forward_budget",
]
