"""How a server's start-up ends when it cannot finish: at a signal, or out of memory.

`python -m mlx_lm_diffusion.server` calls `take_signals()` as its first act, before it imports
mlx-lm, transformers and torch (seconds on a small machine): a SIGINT or SIGTERM from then
until the server is ready to serve ends the process at once, with one line on stderr and
exit 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the shells' convention.
Before, a Ctrl-C in those seconds printed a KeyboardInterrupt traceback from inside an
import, and with SIGINT ignored by the parent (a shell's background job) it was lost and the
server came up. Nothing is torn down: the model may be half loaded on another thread, and
MLX aborts an interpreter that finalizes beside one (decoding.interpreter_exit). Both
signals are taken whatever the parent left them as, as the running server always took them;
startup.main hands them to the graceful drain once the server serves.

A start-up that runs out of memory (an import, the model, a thread) or whose imports fail
ends with one line and exit 2, as the server's other start-up failures (`out_of_memory`,
`cannot_import`). Nothing heavy is imported here.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, List, NoReturn

from mlx_lm_diffusion.serving import memory

PROG = "mlx_lm_diffusion.server"
START_FAILURE_EXIT = 2
_FALLBACK = f"{PROG}: error: the start-up failed (out of memory)\n".encode()  # (when formatting fails too)
# address space set aside under an address-space limit, given back to say the one line:
# at 900 MB, formatting it after a failed import crashed the interpreter 1 of 6 starts
RESERVE_FOR_FAILURE = 16 << 20
_at_end: List[Callable[[], None]] = []
_reserve: List[bytearray] = []


def take_signals() -> None:
    """From now until the server serves, SIGINT and SIGTERM end the process (`end`); under an
    address-space limit, RESERVE_FOR_FAILURE bytes are held for a failure's line."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, end)
    if memory.address_space_limit() is not None and not _reserve:
        try:
            _reserve.append(bytearray(RESERVE_FOR_FAILURE))
        except MemoryError:
            pass


def started() -> None:
    """The server serves: the reserve goes back."""
    _reserve.clear()


def at_end(cleanup: Callable[[], None]) -> None:
    """Run `cleanup` (e.g. removing a private directory) before a start-up ends at a signal."""
    _at_end.append(cleanup)


def end(signum: int, frame=None) -> NoReturn:
    """A signal handler: the start-up ends now, one line, exit 128 + signum."""
    for cleanup in _at_end:
        try:
            cleanup()
        except Exception:  # noqa: BLE001 (leaving is what matters)
            pass
    _say(f"{PROG}: {signal.Signals(signum).name} during start-up; the server did not start")
    os._exit(128 + signum)


def out_of_memory(error: BaseException) -> NoReturn:
    """The start-up ran out of memory: one line naming the failure, exit 2. (os._exit: an
    interpreter this short of memory failed in its own exit handlers, tracebacks again.)"""
    _fail("out of memory while starting", error)


def cannot_import(error: BaseException) -> NoReturn:
    """The server's modules could not be imported: one line, exit 2. Short of memory an
    import fails anywhere, and not always as a MemoryError (transformers reports one as
    "Could not import module 'AutoTokenizer'"); a broken installation says which module."""
    if isinstance(error, MemoryError):
        out_of_memory(error)
    _fail("cannot import the server's modules" + (" (out of memory?)" if memory.is_out_of_memory(error) else ""), error)


def _fail(what: str, error: BaseException) -> NoReturn:
    _reserve.clear()
    try:
        lines = str(error).strip().splitlines()
        _say(f"{PROG}: error: {what}: {type(error).__name__}" + (f": {lines[-1]}" if lines else ""))
    except BaseException:  # noqa: BLE001 (MemoryError formatting the line)
        _write(_FALLBACK)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            pass
    os._exit(START_FAILURE_EXIT)


def _say(line: str) -> None:
    try:
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    _write((line + "\n").encode())


def _write(data: bytes) -> None:
    try:
        os.write(2, data)
    except OSError:
        pass


__all__ = ["at_end", "cannot_import", "end", "out_of_memory", "started", "take_signals", "START_FAILURE_EXIT"]
