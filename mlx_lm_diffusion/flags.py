"""What every command line of the package does alike: argparse's errors on one line
(exit 2), and mlx-lm's flags that cannot apply refused with the reason."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, NoReturn, Optional


def flag_of(parser: argparse.ArgumentParser, dest: str) -> str:
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return max(action.option_strings, key=len)
    return "--" + dest.replace("_", "-")


def one_line_errors(parser: argparse.ArgumentParser, prefix: str = "error: ") -> argparse.ArgumentParser:
    """Make argparse's own errors (an unknown flag, a bad value) one line on stderr, exit 2,
    like every other error of the CLIs: argparse prints the whole usage (40 lines of mlx-lm's
    flags) before its message."""

    def error(message: str) -> NoReturn:
        print(f"{prefix}{message} (see {parser.prog} --help)", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error
    return parser


def refuse_flags(parser: argparse.ArgumentParser, refused: dict) -> None:
    """Mark mlx-lm's flags that cannot apply: default None (so a given value shows),
    help saying why."""
    for action in parser._actions:
        if action.dest in refused:
            action.default = None
            action.help = f"refused: {refused[action.dest]}"


def refused_flag(parser: argparse.ArgumentParser, args: argparse.Namespace, refused: dict) -> Optional[str]:
    """The one-line reason for the first refused flag given, or None."""
    for dest, why in refused.items():
        value = getattr(args, dest, None)
        if not (value is None or value is False or value == ()):
            return f"{flag_of(parser, dest)} does not apply to a diffusion model: {why}"
    return None


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def exit_status(work: Callable[[], Any]) -> int:
    """Run a command-line tool's work: 0 when it returns; 2 and one line on stderr for bad
    input (a ValueError or OSError says what to change, or a chat template that does not
    render); 130 after Ctrl-C."""
    try:
        work()
    except (ValueError, OSError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except Exception as e:
        if not type(e).__module__.startswith("jinja2"):
            raise
        # a checkpoint's chat template that does not render (a syntax error, its own raise_exception)
        print(
            f"error: the chat template cannot render this conversation: {one_line(e)} (fix the "
            "checkpoint's template, or decode without it)",
            file=sys.stderr,
        )
        return 2
    return 0
