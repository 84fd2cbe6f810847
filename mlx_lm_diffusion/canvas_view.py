"""A live terminal view of the canvas being unmasked (`--show-canvas`)."""

from __future__ import annotations

import sys
from typing import Any, Optional, TextIO

from .engine import Step

MASK_GLYPH = "\u2591"  # light shade: a position still masked


class CanvasView:
    """Draws row 0's generated region after each step; redraws in place on a terminal."""

    def __init__(self, tokenizer: Any, mask_id: Optional[int], out: Optional[TextIO] = None):
        self.tokenizer = tokenizer
        self.mask_id = mask_id
        self.out = out or sys.stderr  # looked up now: tests and callers may swap sys.stderr
        self.lines = 0

    def render(self, step: Step) -> str:
        gen = step.canvas[0, step.prompt_len :]
        pieces = [
            MASK_GLYPH if t == self.mask_id else self.tokenizer.decode([int(t)]) for t in gen
        ]
        return "".join(pieces)

    def __call__(self, step: Step) -> None:
        text = f"[forward {step.forwards}] " + self.render(step)
        if self.out.isatty():
            if self.lines:
                self.out.write(f"\x1b[{self.lines}F\x1b[J")  # back up over the last frame
            self.lines = text.count("\n") + 1
        self.out.write(text + "\n")
        self.out.flush()
