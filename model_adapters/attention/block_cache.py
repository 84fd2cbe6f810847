"""Block-causal attention and an exact prefix KV cache (SDAR / TraDo, LLaDA2.x).

Block-diffusion models are trained with a block-causal mask: positions are grouped
into blocks of the model's block size on absolute positions, attention is
bidirectional inside a block and causal across blocks. A position's keys and values
then depend only on its own block and the blocks before it, so once every token of a
block is final its keys and values never change: they can be computed once and
reused. That makes a prefix cache exact, not an approximation.

`BlockCausalAdapter.predict` returns, for positions [start, end), the logits the
model's block-causal forward over the whole canvas would give. It runs only the
window from the cached prefix to the end of `end`'s attention block, against the
cache, then trims the cache back to the last attention-block boundary whose tokens
are all final. Finished blocks are stored lazily by the next step's forward (their
tokens ride along in its window), so storing them costs no extra model call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
from mlx_arsenal.attention import block_causal_mask
from mlx_lm.models.cache import KVCache

from model_adapters.base import NO_SETUP, DecodeSetup, DiffusionModel
from model_adapters.base import Adapter as _BaseAdapter
from model_adapters.runtime.batched import block_causal_batch
from model_adapters.runtime.prefix_kv import PrefixKV, block_causal, usable


def window_mask(offset: int, stop: int, block: int) -> Optional[mx.array]:
    """Boolean block-causal mask (True: attend) for queries [offset, stop) against keys
    [0, stop), or None when every query sees every key (the window lies in one block
    that starts at `offset`). Boolean, so it suits any activation dtype."""
    if offset % block == 0 and (stop - 1) // block == offset // block:
        return None
    return block_causal_mask(stop - offset, block, offset=offset) == 0


class BlockCausalModel(DiffusionModel):
    """A model trained with block-causal attention over the config's `block_size`."""

    @property
    def block_size(self) -> int:
        return self.args.block_size

    def attention_mask(self, inputs: mx.array, cache: Optional[list]) -> Optional[mx.array]:
        # positions continue from the cache's offset when a cache is given
        offset = cache[0].offset if cache else 0
        return window_mask(offset, offset + inputs.shape[1], self.args.block_size)


def resolve_mask_id(args: Any, tokenizer: Any, family: str) -> int:
    """The mask token id: the config's `mask_token_id`, else the tokenizer's mask token."""
    value = getattr(args, "mask_token_id", None)
    if isinstance(value, int):
        return value
    for tok in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        mask_id = getattr(tok, "mask_token_id", None) if tok is not None else None
        if isinstance(mask_id, int):
            return mask_id
    raise ValueError(
        f"{family}: the checkpoint names no mask token (neither config.json's mask_token_id "
        "nor a tokenizer mask_token); load it with its tokenizer or add mask_token_id to config.json"
    )


@dataclass
class PrefixCache:
    """Per-decode cache state: one KVCache per layer holding the keys and values of
    positions [0, stored), all in whole attention blocks whose tokens are final."""

    layers: list = field(default_factory=list)
    final: int = 0  # positions [0, final) are final: the prompt, then finished blocks

    @property
    def stored(self) -> int:
        return self.layers[0].offset if self.layers else 0


class BlockCausalAdapter(_BaseAdapter):
    """Adapter for block-causal models: blocks aligned on absolute positions, an exact
    prefix KV cache (`use_cache`, on by default; off recomputes the whole window from
    position 0 at every step, as the references do). Subclasses set `family`,
    `defaults` and `attention_block` (the block size the model was trained with)."""

    align_blocks = True
    suffix_refusal = "its attention is block-causal: a block attends only to the blocks before it"
    likelihood_layout = "aligned"
    attention_block: int

    def __init__(self, model: Any, tokenizer: Any = None, use_cache: bool = True):
        super().__init__(model, tokenizer)
        self.mask_id = resolve_mask_id(model.args, tokenizer, self.family)
        self.eos_ids = self.eos_ids - {self.mask_id}
        self.use_cache = use_cache

    def start(self, prompt: mx.array, reuse: Optional[PrefixKV] = None, setup: DecodeSetup = NO_SETUP) -> PrefixCache:
        if not self.use_cache:
            return PrefixCache(layers=[], final=prompt.shape[1])
        # A reused prefix holds whole attention blocks of the prompt: the first forward's
        # window then begins after it, as it begins after the blocks stored by this decode.
        layers = reuse.caches() if reuse is not None else [KVCache() for _ in self.model.layers]
        return PrefixCache(layers=layers, final=prompt.shape[1])

    def reuse_length(self, prefix: Optional[PrefixKV], prompt: mx.array, setup: DecodeSetup = NO_SETUP) -> int:
        """Whole attention blocks of the prompt: a position's keys and values depend only on
        its block and the blocks before it, so a block of the same tokens at the same
        absolute place has the same KV in any prompt (the prompt's last partial block does
        not: it is decoded together with the first generated tokens)."""
        if not self.use_cache:
            return 0
        return usable(prefix, block_causal(self.attention_block), prompt.shape[0], prompt.shape[1])

    def export_prefix(self, state: Optional[PrefixCache], length: int) -> Optional[PrefixKV]:
        """The stored blocks: each was computed, with block-causal attention, over final
        tokens only (the prompt's full blocks, and each finished block once the next
        forward carried it), which is what a cold prefill of those tokens computes."""
        if state is None or not state.layers:
            return None
        block = self.attention_block
        return PrefixKV.of(state.layers, min(length, state.stored), block_causal(block), block)

    def predict(self, state: Optional[PrefixCache], canvas: mx.array, start: int, end: int) -> mx.array:
        return self.model.head(self.block_hidden(state, canvas, start, end))

    def block_hidden(self, state: Optional[PrefixCache], canvas: mx.array, start: int, end: int) -> mx.array:
        block = self.attention_block
        # Rows [start, end) see every position up to the end of end's attention block.
        stop = min(-(-end // block) * block, canvas.shape[1])
        cache = state.layers if state is not None and state.layers else None
        offset = state.stored if cache else 0
        window = canvas[:, offset:stop]
        mask = window_mask(offset, stop, block)
        hidden = self.model.backbone(window, mask, cache)
        if cache:  # keep only whole attention blocks of final tokens
            keep = max(offset, min(state.final // block * block, stop))
            for layer_cache in cache:
                layer_cache.trim(stop - keep)
        return hidden[:, start - offset : end - offset]

    def predict_batch(self, requests: list) -> list:
        if len(requests) == 1:
            return super().predict_batch(requests)
        return block_causal_batch(self, requests)

    def finish_block(self, state: Optional[PrefixCache], canvas: mx.array, start: int, end: int) -> None:
        # Stored by the next forward, whose window begins at the cached prefix.
        if state is not None:
            state.final = max(state.final, end)
