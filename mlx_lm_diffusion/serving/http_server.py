"""The listening server: bounded connections, a read-timeout watchdog, graceful drain."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Dict, List, Optional, Tuple

from mlx_lm.server import ResponseGenerator

from mlx_lm_diffusion.serving.errors import _CLIENT_ERRORS, Cancelled, RequestError, error_body
from mlx_lm_diffusion.serving.routes import DiffusionAPIHandler

DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_MAX_CLIENT_CONNECTIONS = 64  # one address's share: the other 448 stay for everyone else
LISTEN_BACKLOG = 128


class DiffusionHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a listen backlog of 128, a cap on open connections
    (503 beyond it; with `max_client_connections`, per client address too), a
    watchdog that closes connections whose request line, headers
    or body take longer than `read_timeout`, and graceful shutdown (`drain`)."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True
    block_on_close = False

    def __init__(
        self,
        address,
        handler,
        read_timeout: Optional[float] = DEFAULT_READ_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_client_connections: Optional[int] = None,
    ):
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.max_client_connections = max_client_connections or None  # None (or 0): no per-client cap
        self.draining = False
        self._lock = threading.Lock()
        self._open = 0
        self._by_client: Dict[Any, int] = {}  # open connections per client address
        self._handlers: set = set()
        self._deadlines: Dict[Any, float] = {}
        self._closing: List[Tuple[Any, float]] = []
        self._stopped = threading.Event()
        super().__init__(address, handler)
        self._watchdog = threading.Thread(target=self._watch, name="http-watchdog", daemon=True)
        self._watchdog.start()

    # -- connections

    def process_request(self, request, client_address):
        client = client_address[0] if isinstance(client_address, tuple) else client_address
        with self._lock:
            held = self._by_client.get(client, 0)
            share = self.max_client_connections
            refuse = self.draining or self._open >= self.max_connections or share is not None and held >= share
            if not refuse:
                self._open += 1
                self._by_client[client] = held + 1
        if refuse:
            why = (
                "the server is shutting down"
                if self.draining
                else (
                    f"too many open connections (--max-connections {self.max_connections}); retry later"
                    if self._open >= self.max_connections
                    else f"this client holds too many open connections (--max-client-connections {share}); retry later"
                )
            )
            return self._refuse(request, why)
        try:
            super().process_request(request, client_address)
        except RuntimeError as e:  # "can't start new thread": the connection is answered, not dropped
            self._closed(client)
            logging.error(f"{client}: refused: cannot start a thread for the connection ({e})")
            self._refuse(request, f"the server cannot start a thread for this connection ({e}); retry later")
        except BaseException:
            self._closed(client)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed(client_address[0] if isinstance(client_address, tuple) else client_address)

    def _closed(self, client: Any) -> None:
        with self._lock:
            self._open -= 1
            left = self._by_client.get(client, 1) - 1
            if left > 0:
                self._by_client[client] = left
            else:
                self._by_client.pop(client, None)

    def handle_error(self, request, client_address):
        """A client that left is one line in the log, not a traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, _CLIENT_ERRORS + (BrokenPipeError,)):
            logging.info(f"{client_address[0]}: connection closed ({type(error).__name__})")
            return
        logging.exception(f"error while serving {client_address[0]}")

    def answer_all(self, reason: str) -> None:
        """The server cannot go on (a rank died): every request in flight gets an error,
        an SSE error event and [DONE] in a stream already begun, a 503 otherwise; at most
        a second per client."""
        with self._lock:
            handlers = list(self._handlers)
        error = RequestError(f"the server cannot answer: {reason}", status=503)
        for handler in handlers:
            if not getattr(handler, "busy", False):
                continue
            try:
                handler.connection.settimeout(1.0)
                handler._answer_failure(error)  # (an SSE error event and [DONE] once a stream began)
                handler.connection.shutdown(socket.SHUT_RDWR)
            except Exception:  # noqa: BLE001 (a client gone already, a write cut short)
                pass

    def open_connections(self) -> int:
        return self._open

    def _refuse(self, sock, message: str) -> None:
        body = json.dumps(error_body(message, 503)).encode()
        head = (
            f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            sock.setblocking(False)
            sock.send(head + body)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self._lock:  # closed by the watchdog once the client has read it
            if len(self._closing) < 256:
                self._closing.append((sock, time.monotonic() + 1.0))
                return
        self.close_request(sock)

    # -- handlers (DiffusionAPIHandler calls these)

    def register(self, handler) -> None:
        with self._lock:
            self._handlers.add(handler)

    def unregister(self, handler) -> None:
        with self._lock:
            self._handlers.discard(handler)
            self._deadlines.pop(handler, None)

    def arm(self, handler) -> None:
        if self.read_timeout:
            with self._lock:
                self._deadlines[handler] = time.monotonic() + self.read_timeout

    def disarm(self, handler) -> None:
        with self._lock:
            self._deadlines.pop(handler, None)

    def _watch(self) -> None:
        while not self._stopped.wait(0.1):
            now = time.monotonic()
            with self._lock:
                late = [h for h, t in self._deadlines.items() if t < now]
                for h in late:
                    del self._deadlines[h]
                closing, self._closing = self._closing, []
            for h in late:
                logging.info(
                    f"closing {h.client_address[0]}: no complete request within "
                    f"{self.read_timeout:g} s (--read-timeout)"
                )
                _shut(h.connection)
            keep = []
            for sock, deadline in closing:
                try:
                    if now < deadline and sock.recv(65536):
                        keep.append((sock, deadline))
                        continue
                except BlockingIOError:
                    if now < deadline:
                        keep.append((sock, deadline))
                        continue
                except OSError:
                    pass
                self.close_request(sock)
            if keep:
                with self._lock:
                    self._closing.extend(keep)

    def server_close(self):
        self._stopped.set()
        super().server_close()
        with self._lock:
            closing, self._closing = self._closing, []
        for sock, _ in closing:
            self.close_request(sock)

    # -- shutdown

    def drain(self, grace: float, cancel_wait: float = 5.0, hurry: Optional[threading.Event] = None) -> int:
        """Stop accepting; let requests in flight finish within `grace` seconds, then
        cancel the rest (their clients get an error). Call from a thread other than
        serve_forever's, which this stops; setting `hurry` ends the grace period early.
        Returns how many requests were cancelled."""
        self.draining = True
        try:  # refuse connections now, not at serve_forever's next poll
            self.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.shutdown()
        try:
            self.socket.close()
        except OSError:
            pass

        def busy():
            with self._lock:
                handlers = list(self._handlers)
            for h in handlers:
                if not getattr(h, "busy", True):
                    _shut(h.connection)  # idle: nothing to finish
            return [h for h in handlers if getattr(h, "busy", True)]

        deadline = time.monotonic() + max(0.0, grace)
        while busy() and time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
            time.sleep(0.05)
        remaining = busy()
        for h in remaining:
            cancel = getattr(h, "cancel_request", None)
            if cancel is not None:
                cancel(Cancelled("the server is shutting down; the request was cancelled"))
        if remaining:
            logging.warning(
                f"shutting down: cancelled {len(remaining)} request(s) still running "
                f"after {grace:g} s (--shutdown-grace)"
            )
        deadline = time.monotonic() + cancel_wait
        while busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        for h in busy():
            _shut(h.connection)
        return len(remaining)


def build_fingerprint() -> str:
    """OpenAI's `system_fingerprint`: which build answered (a hash of mlx-lm-diffusion's, mlx-lm's
    and MLX's versions), nothing of the host (mlx_lm.server's names the kernel and libc)."""

    def named(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "?"

    build = "/".join(named(p) for p in ("mlx-lm-diffusion", "mlx-lm", "mlx"))
    return "fp_" + hashlib.sha256(build.encode()).hexdigest()[:12]


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def make_http_server(
    host: str,
    port: int,
    response_generator: ResponseGenerator,
    handler_class=DiffusionAPIHandler,
    read_timeout: Optional[float] = None,
    max_connections: Optional[int] = None,
    max_client_connections: Optional[int] = None,
) -> DiffusionHTTPServer:
    """A DiffusionHTTPServer bound to (host, port) (port 0: any free port) whose
    handlers are `handler_class(response_generator, ...)`, as mlx_lm.server builds it.
    The limits default to the generator's flags (--read-timeout, --max-connections)."""
    cli = response_generator.cli_args
    if read_timeout is None:
        read_timeout = getattr(cli, "read_timeout", DEFAULT_READ_TIMEOUT)
    if max_connections is None:
        max_connections = getattr(cli, "max_connections", DEFAULT_MAX_CONNECTIONS)
    if max_client_connections is None:
        max_client_connections = getattr(cli, "max_client_connections", None)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    server_class = type("DiffusionHTTPServer", (DiffusionHTTPServer,), {"address_family": family})
    handler = functools.partial(handler_class, response_generator, system_fingerprint=build_fingerprint())
    return server_class(
        address,
        handler,
        read_timeout=read_timeout or None,
        max_connections=max_connections,
        max_client_connections=max_client_connections,
    )
