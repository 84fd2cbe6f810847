"""The server's infill and output-format fields: `suffix` and `response_format`.

OpenAI's completions API names the text after an insertion `suffix`; its
`response_format` asks for JSON ({"type": "json_object"}) or JSON valid against a
schema ({"type": "json_schema", "json_schema": {"schema": ...}}). Both ride with a
request's decoding options (mlx_lm_diffusion.api.request_options) to `compat.stream_generate`,
which calls `apply` to turn `response_format` into a fresh grammar processor for each
decode (a processor holds one decode's state); `check` refuses a bad request up front,
so the server answers a 400 before anything streams.
"""

from __future__ import annotations

from typing import Any, Optional

from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.output.grammar import response_format_processor
from mlx_lm_diffusion.output.infill import encode_suffix, suffix_seed
from model_adapters import adapter_for

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
            raise ValueError(f"{name} is served for diffusion models only; this server's model decodes "
                             "with mlx-lm's own loop, which would ignore it")


def check(adapter: Any, tokenizer: Any, prompt_len: int, max_tokens: int, options: dict, fields: dict) -> None:
    """Refuse what `apply` and the infill would refuse (ValueError): a suffix the family
    cannot attend to or fit, a response_format that does not compile or cannot be served."""
    extra = {}
    processor = response_format_processor(tokenizer, adapter.vocab_size, options.get("response_format"))
    if processor is not None:  # (a decoder that cannot feed processors in order refuses it)
        extra["logits_processors"] = (processor,)
        allowed = fields.get("allowed_tokens")
        if allowed is not None and not processor.can_begin_with([*allowed, *adapter.eos_ids]):
            raise ValueError("response_format and allowed_tokens leave no token the answer can begin with; "
                             "allow the tokens the format starts with (e.g. '{' for JSON)")
    suffix = encode_suffix(tokenizer, options.get("suffix")) or []
    resolved = resolve(DecodeOptions(max_tokens=max_tokens, **fields, **extra), adapter, prompt_len, len(suffix))
    if suffix:
        suffix_seed(adapter, resolved, suffix, 1)


def apply(options: dict, model: Any, tokenizer: Any) -> dict:
    """`options` with `response_format` replaced by its grammar processor, appended to
    the logits processors (mlx-lm's own, from the request's sampling fields, first)."""
    if "response_format" not in options:
        return options
    options = dict(options)
    vocab_size = adapter_for(model, tokenizer).vocab_size
    processor: Optional[Any] = response_format_processor(tokenizer, vocab_size, options.pop("response_format"))
    if processor is not None:
        options["logits_processors"] = [*(options.get("logits_processors") or ()), processor]
    return options


__all__ = ["REQUEST_FIELDS", "parse_fields", "refuse_unserved", "check", "apply"]
