"""Whether the clients of many requests closed their connections, in one system call.

A running batch checks every row's client before each step (a client that left frees
its row at the next step). One `poll` per row and step is a system call and a poll
object each; `closed` asks about all the rows' sockets at once.
"""

from __future__ import annotations

import select
import socket
from typing import Any, List, Optional, Sequence

_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


def closed(sockets: Sequence[Any]) -> List[Optional[bool]]:
    """Per socket, whether its peer closed its end (None where there is no socket). The
    requests were read in full, so a readable socket with nothing to read means the end
    of the stream. Never blocks."""
    out: List[Optional[bool]] = [None if s is None else False for s in sockets]
    poller, where = select.poll(), {}
    for i, sock in enumerate(sockets):
        if sock is None:
            continue
        try:
            fd = sock.fileno()
        except (OSError, ValueError):
            fd = -1
        if fd < 0:  # (closed here already)
            out[i] = True
            continue
        where.setdefault(fd, []).append(i)
        poller.register(fd, select.POLLIN | getattr(select, "POLLRDHUP", 0))
    if not where:
        return out
    try:
        events = poller.poll(0)
    except OSError:
        return [None if s is None else True for s in sockets]
    for fd, flags in events:
        gone = bool(flags & _HANGUP) or _at_end(sockets[where[fd][0]])
        for i in where[fd]:
            out[i] = gone
    return out


def _at_end(sock: Any) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
