"""LFM2.5-350M-Diffusion (Liquid AI): LFM2's layers inside adaLN-single conditioning on a noise level.

The model (Liquid4All/sglang-diffusion-lfm python/sglang/srt/models/lfm2_diffusion.py, whose
docstring states the training reference's math; config python/sglang/srt/configs/lfm2_diffusion.py):
mlx-lm's `lfm2` decoder layers unchanged, wrapped per layer in adaLN-single conditioning on a
per-token noise level sigma:

    temb  = MLP(sinusoid(sigma))              (256 frequencies, cos first; Linear, SiLU, Linear)
    base  = Linear(SiLU(temb)) + table[layer]   -> scale, shift, gate (thirds)
    h_mod = h * (1 + scale) + shift
    h     = h + (1 + gate) * (layer(h_mod) - h_mod)

sigma is 0 on the prompt and the committed blocks (clean text) and -log(alpha_t) on the block
being denoised. Self-conditioning adds FFN(RMSNorm(sc)) to the active block's input embeddings,
sc = softmax(the previous step's scaled log-probs) @ E (the real rows), and nothing to the
committed context (not even the FFN's bias) nor to a block's first step. The logits are read
over the first `real_vocab_size` rows (64,400 of 65,536).

Attention: the committed context is token-causal and is cached (keys and values; a
convolution layer keeps its last L - 1 inputs); a block being denoised sees all of it and
itself in both directions, and never enters the cache: the finished block is encoded once, at
sigma 0, causally, before the next block (SGLang's "commit forward"; the reference sampler,
Liquid4All/lfm-diffusion lfm_diffusion/sampler.py, recomputes the context at every step
instead, which gives the same logits). Decoding: mlx_lm_diffusion.decoding.decoders.duo_block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import lfm2
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.cache import ArraysCache, KVCache

from model_adapters.base import NO_SETUP, DecodeSetup, FamilyDefaults, _check_numbers
from model_adapters.base import Adapter as _BaseAdapter
from model_adapters.option import Option
from model_adapters.runtime.embeddings import weighted_rows
from model_adapters.runtime.prompt_cache import TokenCache

FREQUENCIES_MAX_PERIOD = 10000


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    real_vocab_size: Optional[int] = None  # None: every row is a real token
    sigma_cond_dim: Optional[int] = None
    sigma_freq_embedding_size: int = 256
    selfcond_ffn_bias: bool = True
    self_conditioning: bool = True
    adaln_conditioning: bool = True
    diffusion_block_size: int = 32
    eos_token_id: Optional[Any] = None
    pad_token_id: Optional[int] = None
    mask_token_id: Optional[int] = None  # (uniform-state: no mask token)
    text: Any = field(default=None)  # mlx-lm's lfm2.ModelArgs

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        args = super().from_dict(params)
        args.text = lfm2.ModelArgs.from_dict({**params, "model_type": "lfm2"})
        _check_numbers(args.text)
        if args.sigma_cond_dim is None:
            args.sigma_cond_dim = 256  # (the training default; exported configs set it)
        if not args.adaln_conditioning:
            raise ValueError("an LFM2 diffusion checkpoint without adaLN conditioning is not supported")
        if args.real_vocab_size is not None and not 0 < args.real_vocab_size <= args.text.vocab_size:
            raise ValueError(
                f"config.json's real_vocab_size must be in [1, {args.text.vocab_size}], got {args.real_vocab_size}"
            )
        return args


class SigmaEmbedding(nn.Module):
    """DiT's timestep embedding: sinusoids of sigma (cos first), then Linear, SiLU, Linear."""

    def __init__(self, dim: int, frequencies: int):
        super().__init__()
        self.frequencies = frequencies
        self.fc1 = nn.Linear(frequencies, dim, bias=True)
        self.fc2 = nn.Linear(dim, dim, bias=True)

    def __call__(self, sigma: mx.array) -> mx.array:
        half = self.frequencies // 2
        freqs = mx.exp(-math.log(FREQUENCIES_MAX_PERIOD) * mx.arange(half, dtype=mx.float32) / half)
        angles = sigma.astype(mx.float32)[..., None] * freqs
        waves = mx.concatenate([mx.cos(angles), mx.sin(angles)], axis=-1)
        if self.frequencies % 2:
            waves = mx.concatenate([waves, mx.zeros_like(waves[..., :1])], axis=-1)
        return self.fc2(nn.silu(self.fc1(waves.astype(self.fc1.weight.dtype))))


class SelfConditioning(nn.Module):
    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, dim, bias=bias)
        self.fc2 = nn.Linear(dim, dim, bias=False)

    def __call__(self, soft: mx.array) -> mx.array:
        return self.fc2(nn.silu(self.fc1(self.norm(soft))))


class Lfm2DiffusionModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        text = args.text
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        self.layers = [lfm2.Lfm2DecoderLayer(text, layer_idx=i) for i in range(text.num_hidden_layers)]
        self.embedding_norm = nn.RMSNorm(text.hidden_size, eps=text.norm_eps)
        self.sigma_embed = SigmaEmbedding(args.sigma_cond_dim, args.sigma_freq_embedding_size)
        self.adaln_proj = nn.Linear(args.sigma_cond_dim, 3 * text.hidden_size, bias=True)
        self.adaln_block_emb = mx.zeros((text.num_hidden_layers, 3 * text.hidden_size))
        if args.self_conditioning:
            self.selfcond = SelfConditioning(text.hidden_size, text.norm_eps, args.selfcond_ffn_bias)


class Model(nn.Module):
    """LFM2 block diffusion: `forward(tokens, sigma, caches, mask, soft)` is the conditioned
    stack; `__call__` the clean (sigma 0) causal forward."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Lfm2DiffusionModel(args)

    @property
    def layers(self):
        return self.model.layers

    @property
    def vocab_size(self) -> int:
        return self.args.text.vocab_size  # (the embedding table's rows)

    @property
    def real_vocab_size(self) -> int:
        return self.args.real_vocab_size or self.args.text.vocab_size

    @property
    def max_length(self) -> Optional[int]:
        return self.args.text.max_position_embeddings

    def make_cache(self) -> list:
        """mlx-lm's prompt cache for a diffusion model: the tokens a conversation holds."""
        return [TokenCache()]

    def make_state(self) -> list:
        return [KVCache() if layer.is_attention_layer else ArraysCache(size=1) for layer in self.layers]

    def forward(
        self, tokens: mx.array, sigma: mx.array, caches: Optional[list], mask: Any, soft: Optional[mx.array] = None
    ) -> mx.array:
        """Final hidden states (B, L, H) of `tokens` at noise levels `sigma` ((B, L) or
        broadcastable), over `caches` (stored into), with `soft` (B, S, H) the self-conditioning
        input of the last S positions (the block; the context before it gets nothing)."""
        m = self.model
        h = m.embed_tokens(tokens)
        if soft is not None:
            S = soft.shape[1]
            conditioned = h[:, -S:] + m.selfcond(soft.astype(h.dtype))
            h = conditioned if S == h.shape[1] else mx.concatenate([h[:, :-S], conditioned], axis=1)
        base = m.adaln_proj(nn.silu(m.sigma_embed(sigma)))
        caches = caches or [None] * len(m.layers)
        for i, (layer, cache) in enumerate(zip(m.layers, caches)):
            scale, shift, gate = mx.split((base + m.adaln_block_emb[i]).astype(h.dtype), 3, axis=-1)
            h_mod = h * (1 + scale) + shift
            h = h + (1 + gate) * (layer(h_mod, mask if layer.is_attention_layer else None, cache) - h_mod)
        return m.embedding_norm(h)

    def head(self, hidden: mx.array) -> mx.array:
        """Logits over the real tokens (the table's padding rows are never proposed)."""
        logits = self.model.embed_tokens.as_linear(hidden)
        return logits[..., : self.real_vocab_size] if self.real_vocab_size < logits.shape[-1] else logits

    def __call__(self, inputs: mx.array, cache: Optional[list] = None, mask: Any = "causal") -> mx.array:
        sigma = mx.zeros(inputs.shape, mx.float32)
        return self.head(self.forward(inputs, sigma, cache, mask if inputs.shape[1] > 1 else None))

    def soft_embedding(self, logprobs: mx.array) -> mx.array:
        """Self-conditioning's input: the expected embedding under softmax(logprobs) (real rows)."""
        probs = mx.softmax(logprobs.astype(mx.float32), axis=-1)
        padding = self.vocab_size - probs.shape[-1]  # (the table's rows past the real tokens weigh 0)
        if padding:
            probs = mx.concatenate([probs, mx.zeros((*probs.shape[:-1], padding), probs.dtype)], axis=-1)
        return weighted_rows(self.model.embed_tokens, probs)

    def sanitize(self, weights: dict) -> dict:
        """HF names (nn.Sequential indices) to this model's, the convolutions to MLX's layout."""
        renames = (
            ("sigma_embed.mlp.0.", "sigma_embed.fc1."),
            ("sigma_embed.mlp.2.", "sigma_embed.fc2."),
            ("adaln_proj.1.", "adaln_proj."),
            ("selfcond_norm.", "selfcond.norm."),
            ("selfcond_ffn.0.", "selfcond.fc1."),
            ("selfcond_ffn.2.", "selfcond.fc2."),
        )
        out = {}
        for key, value in weights.items():
            if key.startswith("lm_head."):
                continue  # (tied: the head is the embedding)
            for old, new in renames:
                key = key.replace(old, new)
            if "conv.conv.weight" in key and value.shape[-1] > value.shape[1]:
                value = value.transpose(0, 2, 1)
            out[key] = value
        return out


class Adapter(_BaseAdapter):
    """Uniform-state blocks of 32 anchored at the prompt's end, over a causal context cache."""

    family = "LFM2.5-Diffusion"
    decoder = "duo_block"
    # the reference's recommended preset, nfe8: 8 denoising steps per 32-token block (and a readout)
    defaults = FamilyDefaults(block_length=32, strategy="low_confidence", steps=8)
    presets = {
        "nfe4": {"steps": 4, "duo_rho": 0.2, "duo_temperature_end": 0.5},
        "nfe8": {"steps": 8, "duo_rho": 0.3, "duo_temperature_end": 0.4},
        "nfe32": {"steps": 32, "duo_rho": 0.3, "duo_temperature_end": 0.4},
    }
    options = (
        Option(
            "duo_rho",
            float,
            "LFM2.5: the time grid's warp t = u**rho (< 1 spends more steps at low noise)",
            default=0.3,
            low=0.0,
            low_open=True,
            high=10.0,
        ),
        Option(
            "duo_temperature_start",
            float,
            "LFM2.5: the temperature at a block's first step (annealed linearly to duo_temperature_end)",
            default=0.8,
            low=0.0,
            low_open=True,
            high=100.0,
        ),
        Option(
            "duo_temperature_end",
            float,
            "LFM2.5: the temperature at a block's last step and its readout",
            default=0.4,
            low=0.0,
            low_open=True,
            high=100.0,
        ),
        Option(
            "duo_float64",
            bool,
            "LFM2.5: the posterior and its draws in float64 on the CPU, as the "
            "reference (false: float32 on the default device)",
            default=True,
        ),
    )
    suffix_refusal = "its blocks read only the text before them"
    likelihood_layout = None

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        super().__init__(model, tokenizer)
        self.vocab_size = model.real_vocab_size  # (the logits' last axis: the real tokens)
        if model.args.diffusion_block_size != self.defaults.block_length:
            self.defaults = FamilyDefaults(
                block_length=model.args.diffusion_block_size, strategy="low_confidence", steps=8
            )
        self.fill_id = min(self.eos_ids) if self.eos_ids else 0

    def start(self, prompt: mx.array, reuse: Any = None, setup: DecodeSetup = NO_SETUP) -> "_State":
        state = _State(self.model.make_state())
        self.model(prompt, state.cache)  # the prompt, clean and causal, into the context cache
        state.length = prompt.shape[1]
        return state

    def noise(self, state: "_State", sigma: float) -> None:
        """The noise level of the block's next forward."""
        state.sigma = sigma

    def condition(self, state: "_State", logprobs: mx.array) -> None:
        """This step's scaled log-probs: the next step's self-conditioning."""
        state.soft = self.model.soft_embedding(logprobs) if self.model.args.self_conditioning else None

    def predict(self, state: "_State", canvas: mx.array, start: int, end: int) -> mx.array:
        """Logits (B, end - start, real vocab) of the block at the state's noise level, over the
        committed context; the block is not cached."""
        self._ready(state, canvas, start)
        block = canvas[:, start:end]
        sigma = mx.full(block.shape, state.sigma, mx.float32)
        views = [_Attending(c) if isinstance(c, KVCache) else _Convolving(c) for c in state.cache]
        return self.model.head(self.model.forward(block, sigma, views, None, state.soft))

    def _ready(self, state: "_State", canvas: mx.array, start: int) -> None:
        if state.pending is not None:  # the finished block, encoded clean and causal (the commit)
            pstart, pend = state.pending
            state.pending = None
            self.model(canvas[:, pstart:pend], state.cache)
            state.length = pend
        if state.length != start:
            raise RuntimeError(f"the context holds {state.length} positions, the block starts at {start}")
        if state.block != start:  # a new block starts without self-conditioning
            state.block, state.soft = start, None

    def finish_block(self, state: "_State", canvas: mx.array, start: int, end: int) -> None:
        state.pending = (start, end)  # encoded when the next block needs it


@dataclass
class _State:
    cache: list  # per layer: KVCache (attention) or ArraysCache (the convolution's last inputs)
    length: int = 0  # positions the cache holds
    sigma: float = 0.0  # the next forward's noise level
    soft: Optional[mx.array] = None  # the next forward's self-conditioning input
    block: Optional[int] = None  # start of the block being denoised
    pending: Optional[tuple] = None  # a finished block not yet encoded


class _Attending:
    """A KVCache seen by a block forward: its keys and values read, the block's not stored."""

    def __init__(self, cache: KVCache):
        self.cache, self.offset = cache, cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        if self.cache.keys is None:
            return keys, values
        return (
            mx.concatenate([self.cache.keys[..., : self.offset, :], keys], axis=2),
            mx.concatenate([self.cache.values[..., : self.offset, :], values], axis=2),
        )


class _Convolving(ArraysCache):
    """A convolution layer's last context inputs, read by a block forward and left as they were."""

    def __init__(self, cache: ArraysCache):
        super().__init__(size=1)
        self[0] = cache[0]
