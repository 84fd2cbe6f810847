"""mlx-lm's generation calling convention for diffusion models.

mlx-lm's server and chat call `stream_generate(model, tokenizer, prompt, max_tokens,
prompt_cache=..., sampler=..., prompt_progress_callback=..., kv_bits=..., ...)` with
`prompt` holding only the tokens the prompt cache does not cover, stop iterating
whenever they like (stop strings, disconnects) and keep the cache under
"prompt + tokens yielded". This module gives diffusion models that convention:

* `TokenCache`: LLaDA and Dream attend bidirectionally over the whole canvas, so no
  key/value state survives a decode. What a cache can honestly hold across calls is
  the token sequence it stands for; the next decode re-reads it as the start of its
  prompt. For the exact-KV families it also holds the KV of its leading tokens, which
  the next decode starts from (kv_reuse). It is trimmable (mlx-lm's LRU prompt cache trims to shared prefixes) and
  has no `merge`, so mlx-lm's server serves these models one request at a time
  instead of batching them as causal models.
* `stream_generate`: mlx-lm's signature around `mlx_lm_diffusion.stream_generate`;
  the cache is extended by each token *before* that token is yielded.
* `request_options`: per-request decoding options (the server's JSON fields) for
  calls made by code that does not pass them through (mlx-lm's server).
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_lm_diffusion.api.decode import Decode, build_decode, fitted_max_tokens
from mlx_lm_diffusion.api.generation import DiffusionResponse, decode_responses
from mlx_lm_diffusion.api.prompts import (  # noqa: F401 (mlx-lm's refused keywords, as before)
    NO_KV_QUANTIZATION,
    NO_KV_WINDOW,
    REFUSED_WHEN_SET,
    check_prompt,
    drop_cache_options,
    encode_prompt,
)
from mlx_lm_diffusion.api.request_options import current_request_options, hand_decode, request_options
from mlx_lm_diffusion.decoding import PromptReuse, Step, add_arguments, check_fields, named_options
from mlx_lm_diffusion.output import request_constraints
from model_adapters import TokenCache, adapter_for, is_diffusion_model

# The decoding options a caller may set by name (the server's JSON fields, the CLI
# flags) are the options schema's named options: see mlx_lm_diffusion.decoding.options.
check_decode_fields = check_fields
add_decode_arguments = add_arguments


def decode_defaults(args: argparse.Namespace) -> dict:
    """The decoding options set on the command line, checked (ValueError)."""
    return check_fields({name: getattr(args, name, None) for name in named_options()})


def __getattr__(name: str):
    if name == "DECODE_FIELDS":  # computed on use: a family registered later adds its options
        return named_options()
    raise AttributeError(name)


# ----------------------------------------------------------------------------- generation


def _token_caches(prompt_cache: Optional[List[Any]]) -> List[TokenCache]:
    if not prompt_cache:
        return []
    if not all(isinstance(c, TokenCache) for c in prompt_cache):
        kinds = sorted({type(c).__name__ for c in prompt_cache})
        raise ValueError(
            f"a diffusion model keeps a TokenCache, not {', '.join(kinds)}: make the cache "
            "with mlx-lm's make_prompt_cache(model) (it calls model.make_cache()) or "
            "mlx_lm_diffusion.api.compat.make_prompt_cache(model)"
        )
    if any(c.tokens != prompt_cache[0].tokens for c in prompt_cache):
        raise ValueError("the TokenCache entries of one prompt cache disagree")
    return list(prompt_cache)


def make_prompt_cache(model: nn.Module, max_kv_size: Optional[int] = None) -> List[Any]:
    """mlx-lm's `make_prompt_cache` for a diffusion model: one `TokenCache`
    (`max_kv_size` does not apply: there is no key/value cache to bound)."""
    if not is_diffusion_model(model):
        raise ValueError("make_prompt_cache here is for diffusion models; use mlx-lm's for others")
    return [TokenCache()]


def fit_max_tokens(model: nn.Module, tokenizer: Any, prompt_len: int, max_tokens: Optional[int]) -> int:
    """mlx-lm's max_tokens for a canvas: -1 (mlx-lm's "no limit") and values past the
    model's context become what the context has room for after the prompt."""
    return fitted_max_tokens(adapter_for(model, tokenizer), prompt_len, max_tokens)


def check_request(
    model: nn.Module,
    tokenizer: Any,
    prompt: Sequence[int],
    max_tokens: int,
    options: dict,
    max_forwards: Optional[int] = None,
    adapter: Any = None,
    **decoding: Any,
) -> Decode:
    """The Decode `stream_generate` would run for this request, built up front: everything
    it would reject is rejected here (the server answers it with a 400 before streaming),
    and a decode that could take more than `max_forwards` forwards. `options`: the
    request's named options and its suffix / response_format; `decoding`: what the
    caller adds (sampler, logits_processors, seed). `adapter`: the one to decode with."""
    fields = check_decode_fields({k: v for k, v in options.items() if k in named_options()})
    constraints = {k: options[k] for k in request_constraints.REQUEST_FIELDS if options.get(k) is not None}
    return build_decode(
        model,
        tokenizer,
        list(prompt),
        max_tokens,
        adapter=adapter,
        fit_context=True,
        max_forwards=max_forwards,
        **constraints,
        **fields,
        **decoding,
    )


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: int = 256,
    draft_model: Optional[nn.Module] = None,
    **kwargs,
) -> Iterator[DiffusionResponse]:
    """mlx-lm's `stream_generate` for a diffusion model.

    `prompt` continues what `prompt_cache` (a list of `TokenCache`) holds; once the
    decode starts the cache holds the whole prompt, and it is extended by every token
    before that token is yielded, so at each yield it equals prompt + tokens yielded. Accepted and ignored (no key/value cache, no prefill): stream,
    max_kv_size, prefill_step_size, kv_bits, kv_group_size, quantized_kv_start,
    num_draft_tokens. max_tokens -1 or past the context is fitted to the context.
    Other keywords are decoding options (sampler, logits_processors, block_length,
    steps, strategy, threshold, ..., draft_callback), over `request_options`.
    """
    if draft_model is not None:
        raise ValueError("speculative decoding (draft_model) does not apply to diffusion models")
    if kwargs.pop("input_embeddings", None) is not None:
        raise ValueError("input_embeddings are not supported for diffusion models")
    drop_cache_options(kwargs)
    caches = _token_caches(kwargs.pop("prompt_cache", None))
    progress = kwargs.pop("prompt_progress_callback", None)
    options = {**current_request_options(), **kwargs}
    handed = options.pop("decode", None)  # (built by the server on the request's path: hand_decode)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    new = encode_prompt(tokenizer, prompt)
    ids = (caches[0].tokens if caches else []) + new
    callbacks = {name: options.pop(name, None) for name in ("draft_callback", "cached_tokens_callback")}
    if handed is not None and handed.ids == ids:
        decode = handed
    else:
        decode = build_decode(model, tokenizer, ids, max_tokens, fit_context=True, **options)
    return _stream(decode, len(new), caches, progress, **callbacks)


def _stream(
    decode: Decode,
    new_tokens: int,
    caches: List[TokenCache],
    progress: Optional[Callable[[int, int], None]],
    draft_callback: Optional[Callable[[Step], None]] = None,
    cached_tokens_callback: Optional[Callable[[int], None]] = None,
) -> Iterator[DiffusionResponse]:
    # (cached_tokens_callback, the server's: told how many prompt positions came from the cache's KV)
    ids = decode.ids
    # The KV of the cache's leading tokens (exact-KV families), and the decode's, left in
    # the cache for the next call under "prompt + tokens yielded".
    reuse = PromptReuse(caches[0].kv if caches else None)

    def on_step(step: Step) -> None:
        if progress is not None and step.forwards == 1:
            progress(new_tokens, new_tokens)  # the prompt has been read once
        if draft_callback is not None:
            draft_callback(step)

    for cache in caches:  # the decode reads the whole prompt, as a prefill fills a KV cache
        cache.add(ids[cache.offset :])
        cache.hold_kv(reuse.export)
    if progress is not None:
        progress(0, new_tokens)
    first = True
    for response in decode_responses(decode, draft_callback=on_step, prompt_kv=reuse):
        if first and cached_tokens_callback is not None:
            cached_tokens_callback(reuse.reused)
        first = False
        for cache in caches:
            cache.add([response.token])
        yield response


__all__ = [
    "TokenCache",
    "make_prompt_cache",
    "stream_generate",
    "request_options",
    "hand_decode",
    "check_request",
    "check_decode_fields",
    "fit_max_tokens",
    "add_decode_arguments",
    "decode_defaults",
    "DECODE_FIELDS",  # noqa: F822 (computed on use by the module's __getattr__)
]
