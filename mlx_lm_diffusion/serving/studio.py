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

from mlx_lm_diffusion.decoding import GENERIC_NAMES, MAX_TEMPERATURE, DecodeOptions, default_max_tokens, resolve, schema
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
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
)
STATIC_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# Example prompts the page offers: the demo's own problems on the demo, else prompts any chat
# model can take
DEMO_EXAMPLES = ("357+468=", "1234+4321=", "9999+1=", "80+7=")
GENERIC_EXAMPLES = (
    "Explain diffusion language models in two sentences.",
    "Write a haiku about the sea.",
    "What is 17 x 23? Think step by step.",
    "List three uses of a paperclip.",
)
# Python-only options of the schema that the OpenAI bodies carry as their own fields
OPENAI_FIELDS = ("max_tokens", "seed", "top_p")
ROOT_PAGE = (
    b'<!doctype html><meta charset="utf-8"><title>mlx-lm-diffusion</title>'
    b'<p>This is an OpenAI-compatible server. <a href="/studio">Open the studio</a>.</p>'
)


@lru_cache(maxsize=None)
def static_file(path: str) -> Optional[tuple[bytes, str]]:
    """(body, content type) of a studio route, or None."""
    if path not in FILES:
        return None
    name, content_type = FILES[path]
    return resources.files(__package__).joinpath("studio_page", name).read_bytes(), content_type


def effective_defaults(adapter: Any, server_defaults: dict, max_tokens: Optional[int]) -> dict:
    """What a request that leaves an option out decodes with on this server: the server's
    flags, then the checkpoint's generation_config.json, then the family's defaults (the
    demo: max_tokens 32 and block_length 8, not the schema's 256 and 32)."""
    values = {k: v for k, v in server_defaults.items() if v is not None}
    values["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens(adapter.model)
    try:
        resolved = resolve(DecodeOptions(**values), adapter, prompt_len=1)
    except (TypeError, ValueError):  # (a family that needs more than an empty prompt to resolve)
        return {"max_tokens": values["max_tokens"]}
    out = {
        "max_tokens": resolved.max_tokens,
        "block_length": resolved.block_length,
        "steps": resolved.steps,
        "strategy": resolved.rule.name,
        **resolved.family,
    }
    for name in ("threshold", "factor", "entropy_bound", "alg_temp"):  # (the rule's own setting)
        if getattr(resolved.rule, name, None) is not None:
            out[name] = getattr(resolved.rule, name)
    if resolved.editing_threshold is not None:
        out["editing_threshold"] = resolved.editing_threshold
    out["max_post_steps"] = resolved.max_post_steps
    return out


def options_listing(
    model: Any,
    tokenizer: Any,
    server_defaults: Optional[dict] = None,
    max_tokens: Optional[int] = None,
    demo: bool = False,
) -> dict:
    """The named decoding options that a request to the served model may set: the
    generic ones, then its family's own (with the family's presets as the choices of
    `preset`). Each: name, type (integer, number, boolean, string, array), help, default
    (what this server decodes with when a request leaves it out: `effective_defaults`,
    from its flags, `max_tokens` its --max-tokens, and the checkpoint), minimum / maximum
    (exclusive_minimum when the low end is open), enum, and family. `examples`: prompts
    the page offers (the demo's problems when `demo`)."""
    adapter = None
    if model is not None and tokenizer is not None:
        try:
            adapter = adapter_for(model, tokenizer)
        except ValueError:  # (a plain autoregressive model: the generic options only)
            adapter = None
    own = {o.name for o in getattr(adapter, "options", ())}
    effective = {} if adapter is None else effective_defaults(adapter, server_defaults or {}, max_tokens)
    kinds = {int: "integer", float: "number", bool: "boolean", str: "string", tuple: "array"}
    listing = [
        {
            "name": "temperature",
            "type": "number",
            "help": "Sampling temperature (0: greedy)",
            "family": None,
            "minimum": 0.0,
            "maximum": MAX_TEMPERATURE,
        }
    ]
    for name, option in schema().items():
        if not (option.named or name in OPENAI_FIELDS) or (name not in GENERIC_NAMES and name not in own):
            continue
        entry = {
            "name": name,
            "type": kinds.get(option.kind, "string"),
            "help": option.help,
            "family": None if name in GENERIC_NAMES else adapter.family,
        }
        default = effective.get(name, option.default)
        if default is not None:
            entry["default"] = list(default) if isinstance(default, tuple) else default
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
    return {
        "object": "list",
        "family": None if adapter is None else adapter.family,
        "decoder": None if adapter is None else adapter.decoder,
        "vision": bool(getattr(model, "has_vision", False)),
        "examples": list(DEMO_EXAMPLES if demo else GENERIC_EXAMPLES),
        "data": listing,
    }
