"""A checkpoint's own decoding defaults, read from its generation_config.json.

As in transformers and mlx-lm, a checkpoint may say how it wants to be decoded: the
keys read here are the decoding options' own names (block_length, steps per block,
strategy, threshold, ...) and transformers' `max_new_tokens` (the length when none is
asked). `load()` reads them and keeps them on the model (`GENERATION_DEFAULTS_ATTR`),
and `options.resolve` fills what the caller left unset from them, before the family's
reference defaults:

    explicit options (keywords, flags, request fields, a preset) > generation_config.json > family defaults

Options belong together in two groups, and a group the caller touched is not mixed with
the checkpoint's: a commit rule given in any form (strategy, threshold, schedule, ...)
replaces the checkpoint's whole rule (its "low_confidence" would refuse a threshold),
and a block_length given replaces the checkpoint's steps per block too (its steps were
meant for its own block length). A decoder that has no use for a key (Nemotron's
`self_spec` has no commit rule or steps) leaves the checkpoint's value unread
(`Decoder.unread_defaults`) rather than refusing it as it refuses the caller's.

The released checkpoints' own files use some of these names with other meanings:
Dream's generation_config.json says "steps": 512 for the whole canvas and carries no
block_length. So "steps" is read only from a file that also names block_length, and
keys this package does not define (alg, temperature, top_p, ...) are never read: the
families keep their reference defaults.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

from mlx_lm_diffusion.decoding.commit_rules import RULE_SETTINGS
from mlx_lm_diffusion.decoding.option_schema import schema

GENERATION_DEFAULTS_ATTR = "generation_defaults"  # where load() keeps them on the model
# generation_config.json keys read, and the decoding option each sets
KEYS = {
    "max_new_tokens": "max_tokens",
    "block_length": "block_length",
    "steps": "steps",
    "strategy": "strategy",
    "threshold": "threshold",
    "factor": "factor",
    "entropy_bound": "entropy_bound",
    "alg_temp": "alg_temp",
    "schedule": "schedule",
    "editing_threshold": "editing_threshold",
    "max_post_steps": "max_post_steps",
}
RULE_OPTIONS = frozenset({"strategy", "schedule", *RULE_SETTINGS})  # (the rules declare their settings)


def read(model_path: Any) -> Mapping[str, Any]:
    """The decoding defaults in `model_path`/generation_config.json (option names), each
    checked as the option checks it; {} when there is no file. A value that is not a
    valid option value is a ValueError naming the file and the key."""
    file = Path(model_path) / "generation_config.json"
    if not file.is_file():
        return MappingProxyType({})
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object")
    out = {}
    for key, name in KEYS.items():
        value = config.get(key)
        if value is None or (key == "steps" and "block_length" not in config):
            continue  # (a "steps" without block_length counts the whole canvas: Dream's)
        try:
            out[name] = schema()[name].check(value)
        except ValueError as e:
            raise ValueError(f"{file}: {key} = {value!r}: {e}") from None
    return MappingProxyType(out)


def attach(model: Any, model_path: Any) -> None:
    """Read the checkpoint's defaults and keep them on `model` (a read-only mapping: not a
    dict, so that mlx's Module does not take it for a parameter tree)."""
    setattr(model, GENERATION_DEFAULTS_ATTR, read(model_path))


def fill(values: dict, model: Any) -> dict:
    """`values` (the options set, a preset already applied) with the unset ones taken from
    `model`'s checkpoint defaults, group by group (module docstring)."""
    defaults: Optional[Mapping[str, Any]] = getattr(model, GENERATION_DEFAULTS_ATTR, None)
    if not defaults:
        return values
    skip = set(values)
    if skip & RULE_OPTIONS:
        skip |= RULE_OPTIONS
    if "block_length" in values:
        skip.add("steps")
    return {**{k: v for k, v in defaults.items() if k not in skip}, **values}
