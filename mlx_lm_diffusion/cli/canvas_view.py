"""A live view of the canvas being unmasked (`--show-canvas`), on stderr.

The canvas and the answer never share a line. On a terminal the canvas is one line
redrawn in place (carriage return + clear line, cut to the terminal's width) and
`close()` ends it, so the caller prints the answer, once final, below it. When
stderr is not a terminal, each forward writes one line `[forward N] <canvas>`.
Newlines inside the canvas are drawn as `NEWLINE_GLYPH`, so a frame is one line, and a
token without text as `EMPTY_GLYPH`, so the canvas keeps its width.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any, Optional, TextIO

from mlx_lm_diffusion.decoding import Step
from mlx_lm_diffusion.output.frames import MASK_GLYPH

EMPTY_GLYPH = "\u00b7"  # middle dot: a committed token without text (the demo's <blank> padding)
NEWLINE_GLYPH = "\u21b5"  # a newline inside the canvas
CLEAR_LINE = "\r\x1b[2K"


class CanvasView:
    """Draws row 0's generated region after each forward (`draft_callback`)."""

    def __init__(self, tokenizer: Any, mask_id: Optional[int], out: Optional[TextIO] = None):
        self.tokenizer = tokenizer
        self.mask_id = mask_id
        self.out = out or sys.stderr  # looked up now: tests and callers may swap sys.stderr
        self.drawn = False  # a frame sits on the terminal's current line

    def render(self, step: Step) -> str:
        gen = step.canvas[0, step.prompt_len :]
        pieces = [MASK_GLYPH if t == self.mask_id else self.tokenizer.decode([int(t)]) or EMPTY_GLYPH for t in gen]
        return "".join(pieces).replace("\r", "").replace("\n", NEWLINE_GLYPH)

    def _isatty(self) -> bool:
        try:
            return self.out.isatty()
        except (AttributeError, ValueError):
            return False

    def __call__(self, step: Step) -> None:
        text = f"[forward {step.forwards}] " + self.render(step)
        if self._isatty():
            width = shutil.get_terminal_size(fallback=(80, 24)).columns
            if len(text) >= width:  # one terminal line, or \r cannot redraw it in place
                text = text[: max(width - 2, 1)] + "\u2026"
            self.out.write(CLEAR_LINE + text)
            self.drawn = True
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        """End the in-place line (the last frame stays visible); call before printing
        the answer. Idempotent; nothing to do off a terminal."""
        if self.drawn:
            self.out.write("\n")
            self.out.flush()
            self.drawn = False
