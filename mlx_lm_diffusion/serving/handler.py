"""The HTTP side of the handler: mlx_lm.server's APIHandler with bounded bodies, the Host
and Origin gates, cancellation and OpenAI-shaped errors everywhere. The answers are built
over it (serving/answers.py), the routes over those (serving/routes.py: DiffusionAPIHandler)."""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
from typing import Any, Optional

from mlx_lm.server import (
    APIHandler,
)

from mlx_lm_diffusion.serving.errors import _CLIENT_ERRORS, Cancelled, error_body, excerpt
from mlx_lm_diffusion.serving.openai_requests import (
    MAX_JSON_DEPTH,
    _depth_exceeds,
    _finite_float,
    _reject_constant,
)

DEFAULT_MAX_BODY_BYTES = 10 * 1000 * 1000
NO_BODY = object()  # _read_body's "no body to act on: the error was answered"


def _host_of(header: str) -> str:
    """The host part of a Host header (no port; IPv6 without brackets)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class _Discard:
    """A write side that drops what it is given (a HEAD answer's body)."""

    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass


class HTTPHandler(APIHandler):
    """mlx_lm.server's handler with bounded bodies, the served-model and browser checks,
    the server's cancellation and OpenAI-shaped errors everywhere."""

    # -- connection bookkeeping (the server's watchdog, shutdown and caps)

    def setup(self):
        self.timeout = getattr(self.server, "read_timeout", None)
        self.busy = False
        self.cancel = threading.Event()
        self.cancel_error: Optional[BaseException] = None
        self._request = None
        super().setup()
        register = getattr(self.server, "register", None)
        if register is not None:
            register(self)

    def finish(self):
        try:
            super().finish()
        finally:
            unregister = getattr(self.server, "unregister", None)
            if unregister is not None:
                unregister(self)

    def handle_one_request(self):
        arm = getattr(self.server, "arm", None)
        if arm is not None:
            arm(self)  # request line, headers and body within --read-timeout
        try:
            super().handle_one_request()
        finally:
            self._disarm()
            self.busy = False

    def parse_request(self):
        if not super().parse_request():
            return False
        self.busy = True
        if self.command != "POST":
            self._disarm()
        return True

    def _disarm(self):
        disarm = getattr(self.server, "disarm", None)
        if disarm is not None:
            disarm(self)

    def cancel_request(self, error: BaseException) -> None:
        """Cancel this connection's request (shutdown): its decode raises `error` at
        the next forward and the client gets it as an error."""
        self.cancel_error = error
        self.cancel.set()  # before reading _request: _diffusion_request checks it after setting that
        request = self._request
        if request is not None:
            request.cancel_error = error
            request.cancel.set()

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, headers too long, unsupported
        method) as OpenAI-shaped JSON, not HTML."""
        self.close_connection = True
        self.request_version = "HTTP/1.0"  # a status line and headers even for a garbled request line
        text = message or explain or self.responses.get(code, ("error",))[0]
        body = json.dumps(error_body(text, code)).encode()
        try:
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(body)
        except _CLIENT_ERRORS:
            pass

    def _no_such_method(self):
        self._request = None
        if self._gate():
            self.close_connection = True
            self._send_error(405, f"method {self.command} is not supported here")

    do_PUT = do_DELETE = do_PATCH = _no_such_method

    def do_HEAD(self):
        """HEAD where GET is answered (RFC 9110): GET's status and headers, no body."""
        real = self.wfile
        self._head = True
        try:
            self.do_GET()
        finally:
            self._head = False
            self.wfile = real

    def end_headers(self):
        super().end_headers()
        if getattr(self, "_head", False):  # (a HEAD answer ends with its headers)
            self.wfile = _Discard()

    def log_message(self, format, *args):
        logging.info("%s - %s", self.address_string(), excerpt((format % args).encode(), 300))

    # -- gates before any route

    def _gate(self) -> bool:
        """Shutdown, Host and Origin checks; answers and returns False to refuse."""
        server = self.server
        if getattr(server, "draining", False):
            self.close_connection = True
            self._send_error(503, Cancelled().args[0], code="shutting_down")
            return False
        host = self.headers.get("Host")
        if host is not None and not self._host_allowed(host):
            self.close_connection = True
            self._send_error(
                403,
                f"Host {host[:100]!r} is not this server's address; "
                "start it with --allowed-hosts to serve under this name",
            )
            return False
        origin = self.headers.get("Origin")
        if origin is not None and not self._origin_allowed(origin):
            self.close_connection = True
            self._send_error(
                403,
                f"Origin {origin[:100]!r} is not allowed; start the server "
                "with --allowed-origins to let this page call it",
            )
            return False
        return True

    def _host_allowed(self, header: str) -> bool:
        """IP literals and localhost are safe from DNS rebinding; any other name must be
        one the operator named (--allowed-hosts) or the address it serves on."""
        host = _host_of(header)
        cli = self.response_generator.cli_args
        allowed = {h.lower() for h in (getattr(cli, "allowed_hosts", None) or [])}
        if "*" in allowed or host in allowed or host == str(cli.host).lower():
            return True
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            pass
        # (localhost and *.localhost resolve to this machine only, RFC 6761; any other name,
        # dotless too, could be a rebinding name a search domain completes)
        return host == "localhost" or host.endswith(".localhost")

    def _origin_allowed(self, origin: str) -> bool:
        """An origin the operator allowed, or this server's own (its pages, the studio:
        the Host header already passed `_host_allowed`)."""
        allowed = self.response_generator.cli_args.allowed_origins or []
        host = self.headers.get("Host")
        own = host is not None and origin.lower() == f"http://{host}".lower()
        return own or "*" in allowed or origin in allowed

    def _set_cors_headers(self):
        allowed = self.response_generator.cli_args.allowed_origins or []
        headers = getattr(self, "headers", None)
        origin = headers.get("Origin") if headers is not None else None
        if "*" in allowed:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin is not None and origin in allowed:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        else:
            return  # CORS off: no browser page may read the answers
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")

    def do_OPTIONS(self):
        self._request = None
        if not self._gate():
            return
        self._set_completion_headers(204)
        self.end_headers()

    # -- bodies

    def _read_body(self) -> Any:
        """The request's JSON body (any JSON value, null included), or NO_BODY once an
        error has been answered."""
        self.close_connection = True
        limit = getattr(self.response_generator.cli_args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES
        if self.headers.get("Transfer-Encoding") is not None:
            self._send_error(411, "a Content-Length is required (chunked bodies are not accepted)")
            return NO_BODY
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            self._send_error(411, "a Content-Length header is required")
            return NO_BODY
        text = lengths[0].strip()
        if len(set(v.strip() for v in lengths)) > 1 or not (text.isascii() and text.isdigit()):
            self._send_error(400, f"invalid Content-Length header {excerpt(text.encode(), 40)}")
            return NO_BODY
        length = int(text)
        if length > limit:
            self._send_error(
                413, f"the body ({length} bytes) is over this server's limit of {limit} bytes (--max-body-bytes)"
            )
            self._drain_after_error()
            return NO_BODY
        raw = self.rfile.read(length)
        self._disarm()
        if len(raw) < length:  # the client left, or --read-timeout closed it, within its body
            logging.info(f"{self.address_string()}: closed within its body ({len(raw)} of {length} bytes)")
            return NO_BODY
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            logging.warning(f"body is not UTF-8: {excerpt(raw)}")
            self._send_error(400, f"the body is not UTF-8: {e}")
            return NO_BODY
        try:
            body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
        except RecursionError:
            body, problem = None, f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        except ValueError as e:  # JSONDecodeError included
            body, problem = None, f"invalid JSON in request body: {e}"
        else:
            problem = None
            if _depth_exceeds(body, MAX_JSON_DEPTH):
                problem = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        if problem is not None:
            logging.warning(f"{problem}; body: {excerpt(raw)}")
            self._send_error(400, problem)
            return NO_BODY
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            logging.debug(f"Incoming Request Body: {excerpt(json.dumps(body).encode(), 2000)}")
        return body

    def _drain_after_error(self) -> None:
        """Read a little of an unread body so the error reaches the client before
        the close (closing with unread bytes resets the connection)."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.2)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and self.connection.recv(65536):
                pass
        except OSError:
            pass

    def _send_draft(self, payload: dict) -> None:
        self.wfile.write(f": draft {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def _send_error(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        self._send_json(status, error_body(message, status, param, code))

    def _send_json(self, status: int, data: dict) -> None:
        self._send_bytes(status, json.dumps(data).encode())

    def _send_bytes(self, status: int, body: bytes) -> None:
        self._set_completion_headers(status)
        for name, value in (getattr(self, "_extra_headers", None) or {}).items():
            self.send_header(name, value)
        self._extra_headers = None
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
