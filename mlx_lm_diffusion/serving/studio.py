"""The studio page's server side: its static files (GET /studio, shipped inside the
package, no CDN) under a strict Content-Security-Policy, and GET /v1/options, the
decoding options of the served model as data, from which the page (or any client)
builds its controls.

The page is a client like any other: it calls the public routes only (/v1/models,
/v1/options, /v1/chat/completions with `"drafts": true`), from the server's own origin.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from typing import Any, Optional

from mlx_lm_diffusion.decoding.option_schema import GENERIC_NAMES, MAX_TEMPERATURE, schema
from model_adapters import adapter_for

STUDIO_PATH = "/studio"
OPTIONS_PATH = "/v1/options"
FILES = {  # route -> (file in studio_page/, content type)
    STUDIO_PATH: ("index.html", "text/html; charset=utf-8"),
    STUDIO_PATH + "/studio.js": ("studio.js", "text/javascript; charset=utf-8"),
    STUDIO_PATH + "/studio.css": ("studio.css", "text/css; charset=utf-8"),
}
# Scripts and styles from this server only, no inline code, no plugins, no framing; the
# page's fetches go to its own origin; pictures it draws are blob:/data: URLs it makes.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'")
STATIC_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# Python-only options of the schema that the OpenAI bodies carry as their own fields
OPENAI_FIELDS = ("max_tokens", "seed", "top_p")
ROOT_PAGE = (b'<!doctype html><meta charset="utf-8"><title>mlx-lm-diffusion</title>'
             b'<p>This is an OpenAI-compatible server. <a href="/studio">Open the studio</a>.</p>')


@lru_cache(maxsize=None)
def static_file(path: str) -> Optional[tuple[bytes, str]]:
    """(body, content type) of a studio route, or None."""
    if path not in FILES:
        return None
    name, content_type = FILES[path]
    return resources.files(__package__).joinpath("studio_page", name).read_bytes(), content_type


def options_listing(model: Any, tokenizer: Any) -> dict:
    """The named decoding options that a request to the served model may set: the
    generic ones, then its family's own (with the family's presets as the choices of
    `preset`). Each: name, type (integer, number, boolean, string, array), help, default,
    minimum / maximum (exclusive_minimum when the low end is open), enum, and family."""
    adapter = None
    if model is not None and tokenizer is not None:
        try:
            adapter = adapter_for(model, tokenizer)
        except ValueError:  # (a plain autoregressive model: the generic options only)
            adapter = None
    own = {o.name for o in getattr(adapter, "options", ())}
    kinds = {int: "integer", float: "number", bool: "boolean", str: "string", tuple: "array"}
    listing = [{"name": "temperature", "type": "number", "help": "Sampling temperature (0: greedy)",
                "family": None, "minimum": 0.0, "maximum": MAX_TEMPERATURE}]
    for name, option in schema().items():
        if not (option.named or name in OPENAI_FIELDS) or (name not in GENERIC_NAMES and name not in own):
            continue
        entry = {"name": name, "type": kinds.get(option.kind, "string"), "help": option.help,
                 "family": None if name in GENERIC_NAMES else adapter.family}
        if option.default is not None:
            entry["default"] = option.default
        if option.low is not None:
            entry["exclusive_minimum" if option.low_open else "minimum"] = option.low
        if option.high is not None:
            entry["maximum"] = option.high
        if option.kind is tuple and option.item is not None:
            entry["items"] = kinds.get(option.item, "string")
        choices = option.choices
        if name == "preset":
            choices = tuple(getattr(adapter, "presets", {}) or ())
            if not choices:
                continue  # (no presets: nothing to choose)
        if choices is not None:
            entry["enum"] = list(choices)
        listing.append(entry)
    return {"object": "list", "family": None if adapter is None else adapter.family,
            "decoder": None if adapter is None else adapter.decoder,
            "vision": bool(getattr(model, "has_vision", False)), "data": listing}
