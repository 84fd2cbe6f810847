"""Per-request decoding options for calls made by code that cannot pass them itself.

mlx_lm.server calls `stream_generate` with mlx-lm's keywords only; the diffusion
server sets a request's decoding fields (and its draft callback) around that call, and
`compat.stream_generate` reads them back. Explicit keywords win over these.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator, Optional

_REQUEST_OPTIONS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar(
    "mlx_lm_diffusion_request_options", default=None
)


@contextmanager
def request_options(**options) -> Iterator[None]:
    """Decoding options (the named options, draft_callback) for `stream_generate` calls
    made inside the block."""
    token = _REQUEST_OPTIONS.set(dict(options))
    try:
        yield
    finally:
        _REQUEST_OPTIONS.reset(token)


def hand_decode(decode) -> None:
    """Hand the request's Decode, built on its path (the diffusion server's `_tokenize`), to
    the `stream_generate` call inside the same `request_options` block, which decodes it
    instead of building it again. Outside such a block: nothing."""
    options = _REQUEST_OPTIONS.get()
    if options is not None:
        options["decode"] = decode


def current_request_options() -> dict:
    return _REQUEST_OPTIONS.get() or {}  # (a fresh dict: the caller may not change another's)


__all__ = ["request_options", "current_request_options", "hand_decode"]
