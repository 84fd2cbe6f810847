"""`--sweep threshold=0.7,0.8,0.9 cache=none,dual`: the settings one invocation evaluates.

Each axis names a decoding option of the options schema (the flags `generate` takes:
threshold, cache, block_length, steps, strategy, ...) or max_tokens, and lists its
values; the settings are the cartesian product of the axes, in the order given. A value
is parsed by the option's kind and checked by the option itself (the message a bad
`--threshold` gets); `none` (or `default`) leaves the option unset: the family's or the
checkpoint's default, e.g. no cache.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

from mlx_lm_diffusion.decoding import named_options, schema

UNSET = ("none", "default")
_TRUE, _FALSE = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def sweepable() -> tuple:
    """The names an axis may take: every named decoding option, and max_tokens."""
    return tuple(n for n in named_options() if schema()[n].kind is not tuple) + ("max_tokens",)


def parse_value(name: str, text: str) -> Any:
    """One value of axis `name`, checked (ValueError that names the axis)."""
    if text.strip().lower() in UNSET:
        return None
    option = schema()[name]
    kind = option.kind
    try:
        if kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError
            value: Any = text.lower() in _TRUE
        else:
            value = kind(text) if kind in (int, float) else text
    except ValueError:
        raise ValueError(
            f"--sweep {name}: {text!r} is not {'an integer' if kind is int else 'a number' if kind is float else 'true or false'}"
        ) from None
    try:
        return option.check(value)
    except ValueError as e:
        raise ValueError(f"--sweep: {e}") from None


def parse_axes(items: Optional[Sequence[str]]) -> list:
    """[(name, [values...])] from `name=v1,v2` items; ValueError on any bad item."""
    axes: list = []
    known = sweepable()
    for item in items or ():
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name or not values.strip():
            raise ValueError(f"--sweep takes name=value[,value...] items (e.g. threshold=0.7,0.9), got {item!r}")
        if name not in known:
            raise ValueError(f"--sweep: unknown decoding option {name!r}; sweepable: {', '.join(known)}")
        if name in (n for n, _ in axes):
            raise ValueError(f"--sweep names {name!r} twice; list its values once: {name}=a,b")
        parsed = [parse_value(name, v.strip()) for v in values.split(",")]
        if len(set(map(repr, parsed))) != len(parsed):
            raise ValueError(f"--sweep {name}: a value is listed twice in {values!r}")
        axes.append((name, parsed))
    return axes


def settings(axes: Sequence[tuple]) -> list:
    """Every combination of the axes' values, as {name: value} (None: unset); one empty
    setting without axes."""
    names = [name for name, _ in axes]
    return [dict(zip(names, combo)) for combo in itertools.product(*(values for _, values in axes))]


def label(setting: dict) -> str:
    """A setting's name in the table, the plot and the results' file names."""
    if not setting:
        return "defaults"
    return " ".join(f"{name}={'none' if value is None else value}" for name, value in setting.items())


def slug(setting: dict) -> str:
    """`label` as a file-name part."""
    return "".join(c if c.isalnum() or c in "._=-" else "_" for c in label(setting).replace(" ", "_"))
