"""The server's infill and output-format fields: `suffix` and `response_format`.

OpenAI's completions API names the text after an insertion `suffix`; its
`response_format` asks for JSON ({"type": "json_object"}) or JSON valid against a
schema ({"type": "json_schema", "json_schema": {"schema": ...}}). Both ride with a
request's decoding options into its Decode (mlx_lm_diffusion.api.decode.build_decode),
which turns `response_format` into a fresh grammar processor for the decode (a
processor holds one decode's state) and refuses a bad one while it is built, so the
server answers a 400 before anything streams.
"""

from __future__ import annotations

REQUEST_FIELDS = ("suffix", "response_format")


def parse_fields(body: dict) -> dict:
    """The request's `suffix` (a string) and `response_format` (an object), type-checked."""
    out = {}
    suffix = body.get("suffix")
    if suffix is not None:
        if not isinstance(suffix, str):
            raise ValueError("suffix must be a string")
        out["suffix"] = suffix
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise ValueError("response_format must be an object")
        out["response_format"] = response_format
    return out


def refuse_unserved(options: dict) -> None:
    """A model served by mlx-lm's own decode (not a diffusion model) would ignore these
    fields: refuse them rather than answer without the suffix or the format."""
    for name in REQUEST_FIELDS:
        if options.get(name) is not None:
            raise ValueError(
                f"{name} is served for diffusion models only; this server's model decodes "
                "with mlx-lm's own loop, which would ignore it"
            )


__all__ = ["REQUEST_FIELDS", "parse_fields", "refuse_unserved"]
