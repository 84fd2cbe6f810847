"""I-DLM (Introspective Diffusion Language Models): Qwen3, strictly causal, the AR shift.

The checkpoints (thuEcstasy/I-DLM, BSD-3; training/model/Qwen3-8B-b3-allmasked/config.json)
are Qwen3 with its weight names and say `model_type "sdar"`; model_adapters.evidence tells
them from SDAR by I-DLM's `use_regular_causal` switch and loads them under this module's
model type, "idlm". For inference the model is Qwen3 verbatim: causal attention everywhere
(the block-diffusion mask of its modeling_sdar.py is reachable only in training), and row i
of the logits predicts the token at position i + 1, masks included.

Decoding is Introspective Strided Decoding (mlx_lm_diffusion.decoding.decoders.introspective):
one causal forward per round over [the pending token, the drafts, N - 1 masks], which verifies
the drafts and drafts the next ones from the mask rows; the cache keeps the keys and values of
the accepted tokens only. N (the most tokens a round commits) is `block_length`: the
checkpoint's `block_size` + 1 (the masks it was trained with, plus the pending token); the
released serving configuration is N = 4 with block_size 3 (inference/configs/idlm_blockN4_config.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from model_adapters import idlm_lora
from model_adapters.base import NO_SETUP, DecodeSetup, DiffusionArgs, DiffusionModel, FamilyDefaults, LayerStack
from model_adapters.base import Adapter as _BaseAdapter
from model_adapters.runtime import batched
from model_adapters.runtime.prefix_kv import CAUSAL, PrefixKV, keep_first, usable


@dataclass
class ModelArgs(DiffusionArgs):
    text_module = qwen3
    text_defaults = {"max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False}
    attention_bias: bool = False
    block_size: int = 3  # the masks per block it was trained with (N - 1)
    use_regular_causal: bool = True

    def __post_init__(self):
        if self.attention_bias:
            raise ValueError("I-DLM checkpoints with attention biases are not supported")
        if not self.use_regular_causal:
            raise ValueError(
                "an I-DLM checkpoint with use_regular_causal false (a block-causal prompt) is not "
                "supported: introspective strided decoding reads a strictly causal model"
            )
        if self.block_size < 1:
            raise ValueError(f"I-DLM's block_size (the masks per round) must be at least 1, got {self.block_size}")


class Model(DiffusionModel):
    """Qwen3 (mlx-lm's layers) with causal attention: what I-DLM is at inference."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, LayerStack(args.text, qwen3.TransformerBlock))

    def attention_mask(self, inputs: mx.array, cache: Optional[list]) -> Any:
        return create_attention_mask(inputs, cache[0] if cache else None)

    # -- the LoRA flavour (model_adapters.idlm_lora): the adapter acts on the mask rows only

    def attach_mask_row_lora(self, path: Any, tokenizer: Any = None) -> None:
        """Wrap the adapter's target layers; a stock Qwen3's config names no mask token, so the
        tokenizer's (or I-DLM's 151669) is the one whose rows take the adapter."""
        if self.args.mask_token_id is None:
            self.args.mask_token_id = _tokenizer_mask(tokenizer)
        self._lora_rows = idlm_lora.attach(self, path)

    def backbone(self, inputs: mx.array, mask: Any = None, cache: Optional[list] = None) -> mx.array:
        rows = getattr(self, "_lora_rows", None)
        if rows is None:
            return super().backbone(inputs, mask, cache)
        rows.gate = (inputs == self.args.mask_token_id)[..., None].astype(mx.float32)
        try:  # (the graph holds the gate; the layers see it only during this call)
            return super().backbone(inputs, mask, cache)
        finally:
            rows.gate = None

    def make_kv_cache(self) -> list:
        return [KVCache() for _ in self.layers]


IDLM_MASK = 151669  # I-DLM's mask id (thuEcstasy/I-DLM training/model/*/config.json)


def _tokenizer_mask(tokenizer: Any) -> int:
    token = getattr(tokenizer, "mask_token", None)
    mask = tokenizer.convert_tokens_to_ids(token) if token is not None else None
    return int(mask) if isinstance(mask, int) and mask >= 0 else IDLM_MASK


@dataclass
class _State:
    cache: list  # positions [0, offset): the prompt, then the tokens accepted so far
    seed: Optional[mx.array] = None  # (B, V) the prompt's last logits: the first token

    @property
    def offset(self) -> int:
        return self.cache[0].offset


class Adapter(_BaseAdapter):
    """A causal KV cache that keeps what each round accepts (the reference's `crop`)."""

    family = "I-DLM"
    decoder = "introspective"
    # The released serving setting: N = 4 tokens per round at most (2N - 1 = 7 positions per forward).
    defaults = FamilyDefaults(block_length=4, strategy="low_confidence")
    suffix_refusal = "its attention is causal: a token never sees text after it"
    likelihood_layout = "prefix"

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        super().__init__(model, tokenizer)
        self.defaults = FamilyDefaults(block_length=model.args.block_size + 1, strategy="low_confidence")

    def start(self, prompt: mx.array, reuse: Optional[PrefixKV] = None, setup: DecodeSetup = NO_SETUP) -> _State:
        state = _State(reuse.caches() if reuse is not None else self.model.make_kv_cache())
        state.seed = self.verify(state, prompt[:, state.offset :])[:, -1]  # (the last prompt token at least)
        return state

    def reuse_length(self, prefix: Optional[PrefixKV], prompt: mx.array, setup: DecodeSetup = NO_SETUP) -> int:
        """Causal: the same leading tokens have the same keys and values in any prompt; the
        last prompt token is encoded again (its logits give the first token)."""
        return usable(prefix, CAUSAL, prompt.shape[0], prompt.shape[1] - 1)

    def export_prefix(self, state: _State, length: int) -> Optional[PrefixKV]:
        """The cache: the prompt and the accepted tokens (rejected drafts and masks trimmed)."""
        return None if state is None else PrefixKV.of(state.cache, min(length, state.offset), CAUSAL)

    def block_seed(self, state: _State, canvas: mx.array, start: int) -> Optional[mx.array]:
        return state.seed

    def predict(self, state: _State, canvas: mx.array, start: int, end: int) -> mx.array:
        raise RuntimeError("I-DLM decodes by introspective strided decoding, whose forwards are verify passes")

    def verify(self, state: _State, window: mx.array, clean: Optional[int] = None) -> mx.array:
        """Causal logits (B, L, V) of `window`, the L positions after the cache's, whose keys
        and values are stored: row i proposes the token after window position i. Every row is
        causal (`clean`, the drafts' end, changes nothing here)."""
        return self.model(window, cache=state.cache)

    def keep(self, state: _State, length: int) -> None:
        """Trim the cache to its first `length` positions (the round's rejected drafts and masks)."""
        keep_first(state.cache, length)

    def predict_batch(self, requests: list) -> list:
        """Many rows' rounds in one causal call (model_adapters.runtime.batched.causal_verify_batch)."""
        if len(requests) == 1 or not all(getattr(r, "verify", False) for r in requests):
            return super().predict_batch(requests)
        return batched.causal_verify_batch(self, requests)
