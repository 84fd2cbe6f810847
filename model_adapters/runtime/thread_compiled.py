"""Tables of compiled functions that live and die on the thread that traced them.

MLX keeps a compiled function's traces in a per-thread cache keyed by the address of the
Python callable (plus the inputs' shapes and dtypes), and a compiled function released on
another thread than the one that traced it may leave its trace behind in the tracing
thread's cache. A later callable that gets the same address there is then handed the dead
function's trace: measured here, a fused commit of three outputs answered a call that
wanted four (an IndexError in a CI run), and in general another function's result. A
server traces on its scheduler, lone-decode and protocol threads while tables, adapters
and decodes are dropped on others, so every table of compiled functions here is kept per
thread (`ThreadTables.table()`), and a table whose owner is dropped on another thread while
its thread lives is handed back to that thread, which releases it the next time it asks
for a table.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_handed_back: dict[int, list] = {}  # thread ident -> tables to release on that thread


class ThreadTables:
    """One owner's tables (key -> whatever bounded_compile keeps), one per thread."""

    def __init__(self) -> None:
        self._tables: dict[int, dict] = {}

    def table(self) -> dict:
        """This thread's table (made on first use). Tables handed back to this thread are
        released first, here, on the thread that traced their functions."""
        ident = threading.get_ident()
        with _lock:
            released = _handed_back.pop(ident, None)
        del released
        table = self._tables.get(ident)
        if table is None:  # (a thread's first use: the tables of threads that ended go, their traces with them)
            live = {t.ident for t in threading.enumerate()}
            for owner in [t for t in self._tables if t not in live]:
                del self._tables[owner]
            table = self._tables[ident] = {}
        return table

    def __del__(self) -> None:
        ident = threading.get_ident()
        live = {t.ident for t in threading.enumerate()}
        with _lock:
            for owner, table in self._tables.items():
                if owner != ident and owner in live:  # (a thread that ended took its traces with it)
                    _handed_back.setdefault(owner, []).append(table)
            ended = [_handed_back.pop(owner) for owner in [t for t in _handed_back if t not in live]]
        self._tables.clear()  # (this thread's own, and those of threads that ended: released here,
        del ended  # outside the lock, whose holder a release's finalizers could otherwise wait on)


__all__ = ["ThreadTables"]
