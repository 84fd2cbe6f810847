"""One decoding option as data: its name, type, range, default and help.

The engine's generic options (mlx_lm_diffusion.decoding.options) and every family's own options
(an adapter's `options`) are declared with this one class, so that the Python keyword
checks, the CLI flags, the server's JSON fields and their error messages all come from
the same declaration.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class Option:
    """A decoding option. `default` None means "unset": the family's default applies.

    `kind` is int, float, bool, str, callable or tuple (a sequence of `item`s). Numbers must be
    finite and within [low, high] (`low_open`: strictly above low). `named` options are
    CLI flags and JSON fields too; the others are Python-only (callables, or options
    that mlx-lm's own flags and fields already carry)."""

    name: str
    kind: type
    help: str
    default: Any = None
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    choices: Optional[Sequence[str]] = None
    item: Optional[type] = None  # element type of a tuple option
    named: bool = True
    hint: str = ""  # what to do instead, appended to a range error

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> Any:
        """`value` normalized (tuples from any sequence, ints as floats where floats are
        asked for), or a ValueError that names the option and what it accepts."""
        if self.kind is tuple:
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise ValueError(f"{self.name} must be a list, got {value!r}")
            return tuple(self._check_item(v) for v in value)
        return self._check_item(value, self.kind)

    def _check_item(self, value: Any, kind: Optional[type] = None) -> Any:
        kind = kind or self.item
        if kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{self.name} must be True or False, got {value!r}")
            return value
        if kind is str:
            if not isinstance(value, str):
                raise ValueError(f"{self.name} must be a name, got {value!r}")
            if self.choices is not None and value not in self.choices:
                raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}; got {value!r}")
            return value
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int) or not self._in_range(value):
                raise ValueError(f"{self.name} must be an integer {self._span()}, got {value!r}{self._hint()}")
            return value
        if kind is float:
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or not self._in_range(value):
                raise ValueError(f"{self.name} must be a number {self._span()}, got {value!r}{self._hint()}")
            return float(value) if isinstance(value, int) else value
        if kind is callable and not callable(value):  # (mlx_lm.sample_utils builds them)
            raise ValueError(
                f"{self.name} must be a callable (mlx_lm.sample_utils' make_sampler and "
                f"make_logits_processors build them), got {value!r}"
            )
        return value  # other Python-only values are the engine's to use

    def _in_range(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def _span(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}]"
        if self.low is not None:
            return f"> {low}" if self.low_open else f">= {low}"
        return "(finite)"

    def _hint(self) -> str:
        return f"; {self.hint}" if self.hint else ""

    def json_schema(self) -> dict:
        """This option as a JSON-schema property (draft-07)."""
        types = {int: "integer", float: "number", bool: "boolean", str: "string"}
        if self.kind is tuple:
            return {
                "type": "array",
                "items": Option(
                    self.name, self.item, self.help, low=self.low, high=self.high, choices=self.choices
                ).json_schema(),
            }
        out: dict = {"type": types[self.kind], "description": self.help}
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["maximum"] = self.high
        if self.choices is not None:
            out["enum"] = list(self.choices)
        return out

    def add_argument(self, group: Any) -> None:
        """This option as a command-line flag (values are checked later by `check`, so a
        bad one gives one clear line rather than argparse's usage dump)."""
        if self.kind is bool:
            group.add_argument(self.flag, action=argparse.BooleanOptionalAction, default=None, help=self.help)
        elif self.kind is tuple:
            group.add_argument(self.flag, nargs="+", type=self.item, default=None, help=self.help)
        else:
            group.add_argument(self.flag, type=self.kind, default=None, help=self.help)


def _number(value: Optional[float]) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


__all__ = ["Option"]
