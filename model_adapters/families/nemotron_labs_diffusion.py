"""Nemotron-Labs Diffusion: Ministral-3 layers with a diffusion head.

The Hugging Face checkpoints name the backbone `encoder.*` (Ministral-3 names below it)
and the output projection `diffusion_head`; mlx-vlm's conversions name them
`language_model.model.*` and `language_model.diffusion_head`. `sanitize` accepts both.

Decoding (NVIDIA's `generate`, `causal_context=True`): the prompt is encoded causally into
a KV cache and its last position proposes the first token of the next block; each block
[that token, masks...] is denoised with bidirectional attention on top of the cached
prefix, without storing it; once final, the block is run causally to store its cache
and to propose the next block's first token. With `causal_context=False` the prompt and
the finished blocks are encoded bidirectionally and every block starts fully masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import ministral3
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from model_adapters.base import NO_SETUP, DecodeSetup, DiffusionArgs, DiffusionModel, FamilyDefaults
from model_adapters.base import Adapter as _BaseAdapter
from model_adapters.option import Option
from model_adapters.runtime import batched
from model_adapters.runtime.prefix_kv import CAUSAL, PrefixKV, keep_first, usable


@dataclass
class ModelArgs(DiffusionArgs):
    text_module = ministral3
    text_defaults = {
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 262144,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    }
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    dlm_paradigm: str = "bidirectional"
    block_size: int = 32
    mask_token_id: int = 100

    def __post_init__(self):
        if self.attention_bias or self.mlp_bias or self.hidden_act != "silu":
            raise ValueError("Nemotron-Labs Diffusion checkpoints with biases or a non-SiLU MLP are not supported")
        if self.dlm_paradigm not in ("bidirectional", "autoregressive"):
            raise ValueError(
                f"dlm_paradigm {self.dlm_paradigm!r} is not supported; supported: 'bidirectional', 'autoregressive'"
            )

    def text_config(self, params: dict) -> dict:
        config = super().text_config(params)
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.setdefault("rope_theta", config["rope_theta"])
        # Ministral-3's query scaling; without it in the config the scale is 1 everywhere
        rope.setdefault("llama_4_scaling_beta", 0.0)
        rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
        config["rope_parameters"] = rope
        return config


class Encoder(nn.Module):
    """Embeddings, Ministral-3 blocks and the final norm; the attention mask is the caller's
    (None: bidirectional; "causal" or an array)."""

    def __init__(self, args: ministral3.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [ministral3.TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, None, mask, c)  # attn_scale None: each layer scales by its position
        return self.norm(h)


class Model(DiffusionModel):
    """Bidirectional attention (the diffusion mode) unless a mask is given."""

    backbone_name = "encoder"
    head_name = "diffusion_head"

    def __init__(self, args: ModelArgs):
        super().__init__(args, Encoder(args.text))
        # YaRN RoPE keeps its frequencies as a lazy array outside the parameters: evaluate it
        # here, on the loading thread; a server decoding on another thread cannot evaluate a
        # lazy array built on this one ("There is no Stream(cpu, 0) in current thread").
        mx.eval([layer.self_attn.rope for layer in self.layers])

    def make_kv_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def rename(self, key: str) -> Optional[str]:
        if key.endswith((".k_scale", ".v_scale")):
            return None
        if key.startswith("language_model.model."):  # mlx-vlm's layout
            return "encoder." + key[len("language_model.model.") :]
        if key.startswith("language_model."):
            return key[len("language_model.") :]
        return key


@dataclass
class _State:
    cache: list
    seed: Optional[mx.array] = None  # (B, V) logits proposing the next block's first token
    pending: Optional[tuple] = None  # a final block not yet encoded into the cache
    causal: bool = True  # the decode's causal_context: the prefix encoded causally

    @property
    def offset(self) -> int:
        return self.cache[0].offset


class Adapter(_BaseAdapter):
    """Causal-context block decoding over a prefix KV cache (NVIDIA's `generate`)."""

    family = "Nemotron-Labs Diffusion"
    # NVIDIA's model card: blocks of 32, confidence threshold 0.9 (>=, the most confident
    # always commits); causal context on.
    defaults = FamilyDefaults(block_length=32, strategy="threshold", threshold=0.9)
    suffix_refusal = "a block attends to its causal prefix and to itself, never to text after it"
    likelihood_layout = "prefix"
    options = (
        Option(
            "causal_context",
            bool,
            "Nemotron-Labs Diffusion: encode the prefix causally and seed "
            "each block's first token from it (default on)",
            default=True,
        ),
        Option(
            "self_spec",
            bool,
            "Nemotron-Labs Diffusion: self-speculative greedy decoding (a bidirectional "
            "draft and a causal verify pass per window, block_length the longest window): the tokens of "
            "autoregressive greedy decoding (mlx_lm_diffusion.decoding.decoders.speculative)",
            default=False,
        ),
    )

    def decoder_for(self, family: Any) -> str:
        """Self-speculation (`self_spec`) has its own decoder; otherwise the masked blocks."""
        return "speculative" if family.get("self_spec") else self.decoder

    def check_options(self, family: dict, values: dict) -> None:
        if family.get("self_spec") and not family.get("causal_context", True):
            raise ValueError(
                "self_spec verifies with the causal pass over a causally encoded prefix: "
                "drop causal_context=False or self_spec"
            )

    def _encode(self, state: _State, tokens: mx.array) -> None:
        """Store `tokens` in the cache: causally (causal context) or bidirectionally."""
        cache = state.cache
        mask = create_attention_mask(tokens, cache[0]) if state.causal else None
        hidden = self.model.backbone(tokens, mask, cache)
        state.seed = self.model.head(hidden[:, -1]) if state.causal else None

    def _flush(self, state: _State, canvas: mx.array) -> None:
        if state.pending is not None:
            start, end = state.pending
            if state.offset != start:
                raise RuntimeError(f"cache holds {state.offset} positions, expected {start}")
            state.pending = None
            self._encode(state, canvas[:, start:end])

    def start(self, prompt: mx.array, reuse: Optional[PrefixKV] = None, setup: DecodeSetup = NO_SETUP) -> _State:
        caches = reuse.caches() if reuse is not None else self.model.make_kv_cache()
        state = _State(caches, causal=bool(self.family_option(setup, "causal_context")))
        self._encode(state, prompt[:, state.offset :])  # (at least the last prompt token)
        return state

    def reuse_length(self, prefix: Optional[PrefixKV], prompt: mx.array, setup: DecodeSetup = NO_SETUP) -> int:
        """With causal context the prefix is encoded causally: the same leading tokens have
        the same KV in any prompt. The last prompt token is always encoded again (its causal
        pass seeds the first block). Without causal context the prompt is encoded
        bidirectionally, as a whole: nothing is reusable."""
        if not self.family_option(setup, "causal_context"):
            return 0
        return usable(prefix, CAUSAL, prompt.shape[0], prompt.shape[1] - 1)

    def export_prefix(self, state: _State, length: int) -> Optional[PrefixKV]:
        """The cache: the prompt and the finished blocks, each encoded causally once final
        (the bidirectional passes over a block are trimmed away)."""
        if state is None or not state.causal:
            return None
        return PrefixKV.of(state.cache, min(length, state.offset), CAUSAL)

    def block_seed(self, state: _State, canvas: mx.array, start: int) -> Optional[mx.array]:
        """(B, V) logits for the block's first position, from the causal pass over everything
        before it (causal context), or None (the block starts fully masked)."""
        self._flush(state, canvas)
        return state.seed

    def predict(self, state: _State, canvas: mx.array, start: int, end: int) -> mx.array:
        return self.model.head(self.block_hidden(state, canvas, start, end))

    def block_hidden(self, state: _State, canvas: mx.array, start: int, end: int) -> mx.array:
        self._flush(state, canvas)
        if state.offset != start:
            raise RuntimeError(f"cache holds {state.offset} positions, block starts at {start}")
        hidden = self.model.backbone(canvas[:, start:end], None, state.cache)
        for c in state.cache:  # attend to the prefix without storing the block
            c.trim(end - start)
        return hidden

    def predict_batch(self, requests: list) -> list:
        """Many rows' block passes in one call per block width (model_adapters.runtime.batched.
        causal_prefix_batch), their self-speculation verify passes in one more
        (causal_verify_batch); each row's pending causal encode (a finished block) runs
        first, on its own."""
        if len(requests) == 1:
            return super().predict_batch(requests)

        for r in requests:
            self._flush(r.state, r.canvas)
            if not r.verify and r.state.offset != r.start:
                raise RuntimeError(f"cache holds {r.state.offset} positions, block starts at {r.start}")

        def answer(rows: list) -> list:
            if rows[0].verify:
                return batched.causal_verify_batch(self, rows)
            return batched.causal_prefix_batch(self, rows, [r.state.cache for r in rows])

        kinds = [[i for i, r in enumerate(requests) if r.verify == verify] for verify in (False, True)]
        return batched.answered(requests, kinds, answer)

    def verify(self, state: _State, window: mx.array, clean: Optional[int] = None) -> mx.array:
        """Causal logits (B, L, V) of `window`, the L positions after the cache's, whose keys
        and values are stored (self-speculation's verify pass): row i proposes the token
        after window position i (every row causal: `clean` changes nothing). `keep` then trims
        what was not accepted."""
        self._flush(state, window)  # (nothing pending: self-speculation finishes no block early)
        mask = create_attention_mask(window, state.cache[0])
        return self.model.head(self.model.backbone(window, mask, state.cache))

    def keep(self, state: _State, length: int) -> None:
        """Trim the cache to its first `length` positions (a rejected draft's keys and values)."""
        keep_first(state.cache, length)

    def finish_block(self, state: _State, canvas: mx.array, start: int, end: int) -> None:
        # Encoded lazily, when the next block needs it: no pass after the last block.
        state.pending = (start, end)
