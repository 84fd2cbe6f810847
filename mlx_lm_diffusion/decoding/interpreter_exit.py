"""Decodes end before the interpreter does.

MLX aborts the process ("terminate called without an active exception", exit 134) when
the interpreter finalizes while another thread is evaluating, or with work still queued
on a stream: a program that returned while a daemon thread decoded died that way, 3 of 3
on a busy 2-core machine (issue 55.4). Every forward of a decode (`Engine.run`,
`RunningBatch.step`) runs inside `computing()`; at exit (atexit, which runs before the
finalization and while daemon threads still run) `_drain` marks the interpreter exiting,
waits for the forwards in flight to land (at most EXIT_WAIT_SECONDS), and for the device.
A decode that asks for another forward after that waits for the end of the process (a
thread of the program's own is joined before atexit runs: only daemon threads get there).
Waiting, not raising: a thread that unwinds calls into MLX on its way out, and a daemon
thread that re-takes the GIL during finalization is ended by the interpreter with
pthread_exit, which through MLX's C++ frames is the same abort.
"""

from __future__ import annotations

import atexit
import threading
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx

EXIT_WAIT_SECONDS = 30.0  # (a forward of a large model on a slow machine takes seconds)

_busy = 0
_exiting = False
_changed = threading.Condition()


@contextmanager
def computing() -> Iterator[None]:
    """A forward (building, evaluating or reading back MLX arrays) that exit waits for."""
    global _busy
    with _changed:
        while _exiting:  # (a daemon thread, at the interpreter's exit: it waits for the end)
            _changed.wait()
        _busy += 1
    try:
        yield
    finally:
        with _changed:
            _busy -= 1
            _changed.notify_all()


def _drain() -> None:
    global _exiting
    with _changed:
        _exiting = True
        _changed.wait_for(lambda: _busy == 0, timeout=EXIT_WAIT_SECONDS)
    mx.synchronize()  # (work queued with async_eval and never read back)


def release_thread_streams() -> None:
    """Destroy the MLX streams the calling thread made (mx.clear_streams): a thread of the
    package's that ran MLX calls it as its last act. MLX tears a finished thread's streams
    down at the process's exit otherwise, and that aborted ("terminate called") 5 of 12
    plain Python programs whose only other thread had evaluated one matmul loop, 0 of 16
    with this call (mlx 0.32.4; ml-explore/mlx#3126, the call from ml-explore/mlx#3395)."""
    mx.clear_streams()


@contextmanager
def thread_streams() -> Iterator[None]:
    """A thread's body: its MLX streams are released when it ends (release_thread_streams)."""
    try:
        yield
    finally:
        release_thread_streams()


atexit.register(_drain)

__all__ = ["computing", "EXIT_WAIT_SECONDS", "release_thread_streams", "thread_streams"]
