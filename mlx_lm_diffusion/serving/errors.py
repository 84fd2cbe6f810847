"""The server's errors: a request it cannot serve as asked, OpenAI's error body, a
safe quotation of client bytes for the log."""

from __future__ import annotations

import re
import socket
from typing import Optional, Sequence

LOG_EXCERPT = 200  # characters of a request body a log line may quote

# a client that went away, as writing to its socket or reading from it reports it
_CLIENT_ERRORS = (ConnectionError, TimeoutError, socket.timeout)


class RequestError(ValueError):
    """A request the server cannot serve as asked: answered with `status` and an
    OpenAI-shaped JSON body."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


class Cancelled(RequestError):
    """The server cancelled a request (it is shutting down)."""

    def __init__(self, message: str = "the server is shutting down; retry later"):
        super().__init__(message, status=503, code="shutting_down")


class ClientGone(Exception):
    """The client closed its connection: its decode stops, nobody is answered."""


class StartupError(Exception):
    """The server cannot start as asked (one line for stderr)."""


def error_body(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    if code is None:
        code = {
            404: "not_found",
            411: "length_required",
            413: "request_too_large",
            403: "forbidden",
            503: "unavailable",
        }.get(status)
    return {"error": {"message": str(message), "type": kind, "param": param, "code": code}}


_LEADING_NAME = re.compile(r"^([a-z_][a-z0-9_]*)\b")


def _param_of(message: str, known: Sequence[str]) -> Optional[str]:
    """The request field an error message starts with, if it names one."""
    m = _LEADING_NAME.match(message)
    return m.group(1) if m and m.group(1) in known else None


def excerpt(raw: bytes, limit: int = LOG_EXCERPT) -> str:
    """A bounded, escaped quotation of client bytes for a log line (no control
    characters, so a body cannot forge log lines)."""
    head = raw[:limit].decode("utf-8", "backslashreplace")
    text = head.encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    more = f"... ({len(raw)} bytes)" if len(raw) > limit else ""
    return f"'{text}'{more}"
