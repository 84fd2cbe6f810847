"""The options schema: every decoding option as an `Option` (model_adapters.option), the
generic ones below and each family's own (`Adapter.options`), by name.

The Python keywords (`DecodeOptions`), the CLI flags (`add_arguments`) and the server's
JSON fields (`check_fields`) are all built from `schema()`, and every value is checked
by its Option's `check`, so a bad value gets the same message through every door. The
schema sits below the rest of decoding/ (options, generation_defaults) so that both
read it without importing each other.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Mapping

import mlx.core as mx

from mlx_lm_diffusion.decoding.commit_rules import RULES, THRESHOLD_RULES
from mlx_lm_diffusion.decoding.schedules import GAMMAS
from model_adapters import FAMILIES, family_options
from model_adapters.option import Option

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

_PROBABILITY = dict(kind=float, low=0.0, high=1.0)
_COUNT_LIMIT = 1 << 20  # block and step counts past this are input errors, not decodes
# The server's bound on `temperature` too: far past it every draw is uniform noise, and a
# temperature of 1e308 overflowed the scaled logits (the protocol answered all zeros).
MAX_TEMPERATURE = 100.0

GENERIC_OPTIONS: tuple[Option, ...] = (
    Option("max_tokens", int, "Tokens to generate", default=256, low=1, named=False, hint="ask for at least one token"),
    Option("block_length", int, "Tokens per block", low=1, high=_COUNT_LIMIT, hint="use a positive block size"),
    Option(
        "steps",
        int,
        "Denoising steps per block",
        low=1,
        high=_COUNT_LIMIT,
        hint="use at least one denoising step per block",
    ),
    Option("strategy", str, f"Commit rule: {', '.join(RULES)}", choices=tuple(RULES)),
    Option(
        "threshold",
        help=f"Confidence threshold (selects the 'threshold' strategy unless the "
        f"family's rule takes one: {', '.join(THRESHOLD_RULES)})",
        **_PROBABILITY,
    ),
    Option("factor", float, "Factor of the 'factor' strategy (selects it unless given one)", low=0.0, low_open=True),
    Option(
        "entropy_bound",
        float,
        "Entropy budget of the 'entropy_bound' / 'entropy_bounded' strategies "
        "(selects 'entropy_bound' unless the family's rule takes one)",
        low=0.0,
    ),
    Option(
        "alg_temp",
        float,
        "Temperature of the maskgit_plus / topk_margin / entropy rules' ranking (0: the most confident first)",
        low=0.0,
    ),
    Option("editing_threshold", help="Revise committed tokens whose replacement is this confident", **_PROBABILITY),
    Option("max_post_steps", int, "Editing passes once a block is full", low=0, high=_COUNT_LIMIT),
    Option("preset", str, "A family's named settings (see its presets)"),
    Option(
        "schedule",
        str,
        f"Mask schedule as the per-step quota, instead of --strategy: {', '.join(GAMMAS)}",
        choices=tuple(GAMMAS),
    ),
    Option(
        "temperature_schedule",
        tuple,
        "One temperature per step (0: greedy)",
        item=float,
        low=0.0,
        high=MAX_TEMPERATURE,
        named=False,
    ),
    Option(
        "top_p",
        float,
        "Nucleus sampling with temperature_schedule",
        default=1.0,
        low=0.0,
        high=1.0,
        low_open=True,
        named=False,
    ),
    Option("sampler", callable, "mlx-lm sampler over log-probs; greedy if None", named=False),
    Option(
        "logits_processors",
        tuple,
        "mlx-lm logits processors, fed the committed tokens left to right "
        "(mlx_lm_diffusion.decoding.decoders.constraints)",
        default=(),
        named=False,
        item=callable,
    ),
    Option("allowed_tokens", tuple, "Only these token ids may be generated (EOS always may)", item=int, low=0),
    Option("seed", int, "PRNG seed", low=0, high=2**64 - 1, named=False),  # (mx.random.seed's range)
    Option(
        "ignore_eos",
        bool,
        "Decode to max_tokens past the model's EOS (vLLM's name; the step-schedule protocol fills its target length)",
        default=False,
        named=False,
    ),
)


GENERIC_NAMES = frozenset(o.name for o in GENERIC_OPTIONS)
_schemas: dict = {}  # the schema per set of registered families (a family can join later)


def schema() -> dict[str, Option]:
    """Every option by name: the generic ones, then each family's own (a name two
    families declare is one option; the first declaration gives its type and help)."""
    key = tuple(FAMILIES.items())
    if key not in _schemas:
        options = {o.name: o for o in GENERIC_OPTIONS}
        for option in family_options():
            options.setdefault(option.name, option)
        _schemas.clear()
        _schemas[key] = options
    return _schemas[key]


def named_options() -> tuple[str, ...]:
    """The options a caller may set by name: the CLI flags and the server's JSON fields."""
    return tuple(name for name, o in schema().items() if o.named)


def check_fields(fields: Mapping[str, Any]) -> dict:
    """Check options given by name (JSON fields, CLI flags) by their Option; None values
    are dropped (they mean "the family default"). Raises ValueError."""
    named = named_options()
    out = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name not in named:
            raise ValueError(f"unknown decoding option {name!r}; known: {', '.join(named)}")
        out[name] = schema()[name].check(value)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every named option as a command-line flag (generate, chat, server)."""
    group = parser.add_argument_group("diffusion decoding (defaults: the model family's)")
    for name in named_options():
        schema()[name].add_argument(group)
    return parser
