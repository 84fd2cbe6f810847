"""Whether the clients of many requests closed their connections, in one system call.

A running batch checks every row's client before each step (a client that left frees
its row at the next step). One `poll` per row and step is a system call and a poll
object each; `closed` asks about all the rows' sockets at once.

The end of a client's stream (its FIN) is not its leaving: a client may send its request
and shut down its sending side only (a half-close), and still read the answer; decoding
stopped for it, it got no bytes, or a stream without [DONE]. Such a socket is HALF; a
client that closed entirely is known once something is written to it (its system answers
with a reset): `generator._canceller` writes it an interim `100 Continue` to find out.
"""

from __future__ import annotations

import select
import socket
from typing import Any, List, Optional, Sequence

_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL  # (a reset, or closed here)
HALF = "half"  # the client's stream ended (FIN): closed, or only half-closed


def closed(sockets: Sequence[Any]) -> List[Any]:
    """Per socket: True when the connection is gone (reset, or closed here), HALF when the
    peer's stream ended (the requests were read in full, so a readable socket with nothing
    to read is that), False while it is open, None where there is no socket. Never blocks."""
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
        state = True if flags & _HANGUP else _at_end(sockets[where[fd][0]])
        for i in where[fd]:
            out[i] = state
    return out


def _at_end(sock: Any) -> Any:
    try:
        return HALF if sock.recv(1, socket.MSG_PEEK) == b"" else False
    except BlockingIOError:
        return False
    except OSError:
        return True
