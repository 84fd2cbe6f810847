"""One request, resolved once: `Decode`, built by `build_decode`.

Every door builds its requests here: the Python API's `stream_generate` / `generate`,
mlx-lm's calling convention (`compat.stream_generate`: the CLI, `mlx_lm.chat`, mlx-lm's
server), the diffusion server, which builds it on the request's own path before the
decode (its serial decode is handed the same object, its running batch takes the
object's parts), the batch doors (`generate_batch`, evaluation's `generate_until`: one
Decode per row, over the batch's one adapter) and the step-schedule protocol
(`protocol.ProtocolDecode` holds one). Building it does every check a decode
would fail on (the options and their fit in the context, the forward bound, the
prompt's ids, the suffix, the response format, images), so bad input fails here,
before a lock or a stream, and nothing below checks or resolves it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from mlx_lm_diffusion.api.prompts import check_prompt, encode_prompt
from mlx_lm_diffusion.decoding import DecodeOptions, ResolvedOptions, check_forward_budget, forward_bound, resolve
from mlx_lm_diffusion.media import images
from mlx_lm_diffusion.output.grammar import response_format_processor
from mlx_lm_diffusion.output.infill import encode_suffix, suffix_seed
from model_adapters import Adapter, adapter_for


@dataclass
class Decode:
    """A request ready to decode: what the engine (or a running batch's row) is given."""

    adapter: Adapter  # the family adapter it decodes with (one per decode, or a batch's)
    tokenizer: Any  # mlx-lm's TokenizerWrapper (a processor's text tokenizer)
    ids: list  # the whole prompt's token ids
    options: ResolvedOptions
    suffix: list  # an infill's suffix ids ([] for none)
    seed: Optional[np.ndarray]  # (1, W) the canvas's pinned tokens (the suffix; the protocol's seed_canvas), or None
    vision: Any  # the images' vision inputs (DiffusionGemma), or None
    forwards: int  # the most forwards the decode can take

    @property
    def max_tokens(self) -> int:
        return self.options.max_tokens


def fitted_max_tokens(adapter: Adapter, prompt_len: int, max_tokens: Optional[int]) -> int:
    """mlx-lm's max_tokens for a canvas: -1 (mlx-lm's "no limit") and values past the
    model's context become what the context has room for after the prompt."""
    if max_tokens is None:
        max_tokens = -1
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or (max_tokens < 1 and max_tokens != -1):
        raise ValueError(f"max_tokens must be >= 1 (or -1: as many as the context holds), got {max_tokens!r}")
    limit = adapter.max_length
    if limit is None:
        if max_tokens == -1:
            raise ValueError("max_tokens=-1 needs a model with a known context length")
        return max_tokens
    room = limit - prompt_len
    if room < 1:
        raise ValueError(
            f"the prompt ({prompt_len} tokens) fills the model's context of {limit} tokens; "
            "shorten it (or reset the conversation)"
        )
    return room if max_tokens == -1 else min(max_tokens, room)


def build_decode(
    model: Any,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], Any],
    max_tokens: Optional[int] = None,
    *,
    adapter: Optional[Adapter] = None,
    fit_context: bool = False,
    max_forwards: Optional[int] = None,
    suffix: Optional[Union[str, Sequence[int]]] = None,
    response_format: Optional[dict] = None,
    **fields: Any,
) -> Decode:
    """The request's Decode. `prompt`: text, token ids or chat messages (images: pass the
    processor as `tokenizer` and `image=` / `video=`, as `stream_generate`). `fields`:
    the decoding options (DecodeOptions' names: sampler, logits_processors, block_length,
    ...). `adapter`: the one to decode with (a running batch's); else one is built.
    `fit_context`: mlx-lm's max_tokens (-1 and values past the context fitted to it).
    `max_forwards`: refuse a decode that could take more forwards. `response_format`
    (OpenAI's): a grammar processor, fresh for this decode, after the other processors.
    Raises ValueError (TypeError for unknown option names)."""
    tokenizer, prompt, vision = images.request_inputs(model, tokenizer, prompt, fields)
    adapter = adapter if adapter is not None else adapter_for(model, tokenizer)
    ids = encode_prompt(tokenizer, prompt)
    if fit_context:
        max_tokens = fitted_max_tokens(adapter, len(ids), max_tokens)
    processor = response_format_processor(tokenizer, adapter.vocab_size, response_format)
    if processor is not None:  # (a decoder that cannot feed processors in order refuses it)
        fields["logits_processors"] = [*(fields.get("logits_processors") or ()), processor]
        allowed = fields.get("allowed_tokens")
        if allowed is not None and not processor.can_begin_with([*allowed, *adapter.eos_ids]):
            raise ValueError(
                "response_format and allowed_tokens leave no token the answer can begin with; "
                "allow the tokens the format starts with (e.g. '{' for JSON)"
            )
    suffix_ids = encode_suffix(tokenizer, suffix) or []
    options = resolve(DecodeOptions(max_tokens=max_tokens, **fields), adapter, len(ids), len(suffix_ids))
    check_forward_budget(options, adapter, len(ids), max_forwards)
    check_prompt(ids, adapter.mask_id, adapter.vocab_size)
    seed = suffix_seed(adapter, options, suffix_ids, 1) if suffix_ids else None
    return Decode(adapter, tokenizer, ids, options, suffix_ids, seed, vision, forward_bound(options, adapter, len(ids)))


__all__ = ["Decode", "build_decode", "fitted_max_tokens"]
