"""The decoders' lock, taken in turns.

One model serves every request, so one decode runs a forward at a time: the batch's step
(the scheduler) or a request decoded on its own (images, an infill's suffix, a
response_format: generator._serve_single). A plain lock let such a request hold the model
for its whole decode (33.9 s in which no batched request advanced); this one is handed
out in arrival order, and its holder hands it on between forwards (`pass_turn`), so the
batch and a lone decode take turns forward by forward.
"""

from __future__ import annotations

import threading
from collections import deque


class TurnLock:
    """A lock granted in FIFO order, whose holder can step to the back of the line."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._held = False
        self._line: deque = deque()  # the waiters' tickets, first come first

    def acquire(self) -> bool:
        with self._cond:
            ticket = object()
            self._line.append(ticket)
            while self._held or self._line[0] is not ticket:
                self._cond.wait()
            self._line.popleft()
            self._held = True
            return True

    def release(self) -> None:
        with self._cond:
            if not self._held:
                raise RuntimeError("release of an unheld TurnLock")
            self._held = False
            self._cond.notify_all()

    def locked(self) -> bool:
        return self._held

    def pass_turn(self) -> None:
        """Let whoever is waiting run first (one turn each, in order), then hold it again;
        no-op when nobody waits."""
        with self._cond:
            if not self._line:
                return
        self.release()
        self.acquire()

    def __enter__(self) -> "TurnLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
