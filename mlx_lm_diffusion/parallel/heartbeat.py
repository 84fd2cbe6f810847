"""Every rank learns within moments that another one died.

A collective whose peer died does not always fail: with ranks started directly (not under
mlx.launch, which ends the others), the survivor waited in it for the 300 s watchdog in 7
runs of 8. Beside the collectives, each rank other than 0 keeps one TCP connection to rank 0
(a star): a process that dies, however it dies, has its connections closed by the system,
so the other end reads the end of the stream at once and ends its own process with one
line (exit 1); rank 0's end reaches every other rank in turn. A rank that ends normally
says so first ("bye", at exit), and its peers stop watching it.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import select
import socket
import threading
import time
from typing import Any, Callable, List, Optional

CONNECT_SECONDS = 60.0  # for the ranks to find each other at the start
BYE = b"B"


def leader_address() -> str:
    """Rank 0's IP as mlx.launch's ring hostfile names it (MLX_HOSTFILE: a JSON list per
    rank of "ip:port"), or the loopback address."""
    hostfile = os.environ.get("MLX_HOSTFILE", "")
    try:
        text = open(hostfile).read() if hostfile and os.path.exists(hostfile) else hostfile
        return str(json.loads(text)[0][0]).rsplit(":", 1)[0]
    except (ValueError, IndexError, KeyError, TypeError, OSError):
        return "127.0.0.1"


class Heartbeat:
    """The star of connections between rank 0 and the others, watched by daemon threads.
    `on_death(reason)` ends the process (distributed.fail)."""

    def __init__(self, rank: int, size: int, share: Callable[[Any], Any], on_death: Callable[[str], None]):
        self.rank, self.size, self.on_death = rank, size, on_death
        self.links: List[socket.socket] = []
        self.names: dict = {}  # link -> the rank it watches ("rank 1")
        self.ending = False
        if rank == 0:
            listener = socket.create_server((leader_address(), 0))
            key = secrets.token_bytes(16)  # (only the group's ranks know it: a stray connection is dropped)
            share((*listener.getsockname()[:2], key))
            listener.settimeout(CONNECT_SECONDS)
            peers = set()
            while len(peers) < size - 1:
                link, _ = listener.accept()
                link.settimeout(5)
                hello = _read_exactly(link, len(key) + 4)
                peer = int.from_bytes(hello[len(key) :], "big") if hello[: len(key)] == key else None
                if peer is None or not 0 < peer < size or peer in peers:
                    link.close()
                    continue
                peers.add(peer)
                self._watch(link, f"rank {peer}")
            listener.close()
        else:
            host, port, key = share(None)
            self._watch(_connect((host, port), key + rank.to_bytes(4, "big")), "rank 0")
        atexit.register(self.bye)

    def _watch(self, link: socket.socket, name: str) -> None:
        link.settimeout(None)
        self.links.append(link)
        self.names[link] = name
        threading.Thread(target=self._read, args=(link, name), name=f"heartbeat-{name}", daemon=True).start()

    def _read(self, link: socket.socket, name: str) -> None:
        try:
            data = link.recv(1)
        except OSError:
            data = b""
        if data == BYE or self.ending:
            return  # (it ended normally, or this process is ending itself)
        self.on_death(f"{name} is gone: its connection closed (the process died or was killed)")

    def gone(self, wait: float) -> Optional[str]:
        """The rank whose connection has closed without a "bye" ("rank 1"), looking for up
        to `wait` seconds, or None: a collective that failed learns which peer died."""
        deadline = time.monotonic() + wait
        while True:
            readable, _, _ = select.select(self.links, [], [], max(0.0, deadline - time.monotonic()))
            for link in readable:
                try:
                    if link.recv(1, socket.MSG_PEEK) == b"":
                        return self.names[link]
                except OSError:
                    return self.names[link]
            if time.monotonic() >= deadline:
                return None

    def bye(self) -> None:
        """This rank ends normally: its peers stop watching it."""
        self.ending = True
        for link in self.links:
            try:
                link.sendall(BYE)
            except OSError:
                pass


def _read_exactly(link: socket.socket, size: int) -> bytes:
    data = b""
    try:
        while len(data) < size:
            chunk = link.recv(size - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


def _connect(address: tuple, hello: bytes) -> socket.socket:
    deadline = time.monotonic() + CONNECT_SECONDS
    while True:
        try:
            link = socket.create_connection(address, timeout=5)
            link.sendall(hello)
            return link
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


_started: Optional[Heartbeat] = None


def start(group: Any, share: Callable[[Any], Any], on_death: Callable[[str], None]) -> Heartbeat:
    """The process's heartbeat for `group` (started once)."""
    global _started
    if _started is None:
        _started = Heartbeat(group.rank(), group.size(), share, on_death)
    return _started


def peer_gone(wait: float = 1.0) -> Optional[str]:
    """Which peer of this process's group died ("rank 1"), if the heartbeat sees one within
    `wait` seconds; None without a heartbeat or when none did."""
    return None if _started is None or not _started.links else _started.gone(wait)


def say_bye() -> None:
    """This process ends normally (before an os._exit, which skips atexit)."""
    if _started is not None:
        _started.bye()
