"""Colour only on a terminal: mlx-lm's chat screen and training table (rich, its truecolor
theme) write ANSI codes into a pipe or a file too. The project's doors that show them write
plain text unless standard output is a terminal and NO_COLOR (no-color.org) is unset."""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Any, Iterator, TextIO

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def wants_color(stream: Any = None) -> bool:
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not os.environ.get("NO_COLOR") and bool(isatty and isatty())


class PlainStream:
    """A text stream that drops ANSI escape sequences from what it writes."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(ANSI.sub("", text))
        return len(text)

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def plain_unless_terminal() -> Iterator[bool]:
    """Within: sys.stdout drops ANSI codes unless colour is wanted; yields whether it is."""
    if wants_color():
        yield True
        return
    real = sys.stdout
    sys.stdout = PlainStream(real)
    try:
        yield False
    finally:
        sys.stdout = real
