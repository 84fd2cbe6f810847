"""What mlx-lm's callers hand a diffusion decode, checked: the prompt (text, ids or an
array) and mlx-lm's key/value-cache and scheduling keywords, refused or dropped."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import mlx.core as mx
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_lm_diffusion.output.infill import token_ids


def encode_prompt(tokenizer: TokenizerWrapper, prompt: Union[str, Sequence[int], mx.array]) -> List[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)  # as mlx-lm does
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    if isinstance(prompt, mx.array):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    return token_ids(prompt, "prompt")


def check_prompt(ids: List[int], mask_id: Optional[int], vocab_size: int) -> None:
    if not ids:
        raise ValueError("prompt is empty; give at least one token")
    if mask_id is not None and mask_id in ids:
        raise ValueError(
            f"prompt contains the mask token (id {mask_id}); remove it: the mask token "
            "marks positions still to be generated and cannot appear in a prompt"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {vocab_size})")


# Why mlx-lm's key/value-cache options cannot apply to a diffusion model (the CLIs'
# refusals of the same flags say it too).
NO_KV_WINDOW = (
    "a diffusion decode attends to its whole context: there is no rotating key/value window "
    "to bound (the canvas's size is max_tokens)"
)
NO_KV_QUANTIZATION = (
    "a diffusion model's key/value caches (the exact ones some families keep for the prompt "
    "and finished blocks) stay unquantized"
)
# mlx-lm's generate_step / batch_generate options refused when set to anything but their
# off value (None): they would silently change nothing
REFUSED_WHEN_SET = {"max_kv_size": NO_KV_WINDOW, "kv_bits": NO_KV_QUANTIZATION}
# ... and those that change nothing here at any value, which mlx-lm's own callers pass
# with their defaults (mlx_lm.server: prefill_step_size, num_draft_tokens, kv_group_size;
# kv_group_size and quantized_kv_start only mean something with kv_bits, num_draft_tokens
# with a draft_model, both refused): accepted and dropped
_IGNORED = (
    "stream",
    "prefill_step_size",
    "kv_group_size",
    "quantized_kv_start",
    "num_draft_tokens",
    "completion_batch_size",  # (batch_generate's: a running batch takes rows as they come)
    "prefill_batch_size",
)


def drop_cache_options(kwargs: dict) -> None:
    """Remove mlx-lm's key/value-cache and scheduling options from `kwargs`: ValueError
    for one set that a diffusion model cannot honour, the others dropped."""
    for name, why in REFUSED_WHEN_SET.items():
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"{name}: {why}")
    for name in _IGNORED:
        kwargs.pop(name, None)
