"""DiffusionGemma: a Gemma 4 MoE encoder (causal, fills the KV cache) and a decoder that
shares its weights (bidirectional over the cached prefix and the canvas, reads the cache
without storing) with a self-conditioning block; images through mlx-vlm's Gemma 4 vision
tower and projector when the checkpoint has them (model_adapters.gemma_vision).

Weights follow transformers' `DiffusionGemmaForBlockDiffusion` checkpoints: the decoder
holds every shared weight (`model.decoder.*`), the encoder only its own layer scalars
(`model.encoder.language_model.layers.N.layer_scalar`); `lm_head` is tied to the decoder's
embeddings; the vision tower and projector (`model.encoder.vision_tower.*`,
`model.encoder.embed_vision.*`) load when the config has a `vision_config`. Layers are
mlx-lm's gemma4_text parts, the vision modules mlx-vlm's.

Decoding (Hugging Face's generation_diffusion_gemma.py) is the engine's uniform-noise
path: there is no mask token; the adapter feeds the previous step's temperature-scaled
logits back as self-conditioning and encodes each finished canvas causally.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx_lm.models import gemma4_text
from mlx_lm.models.base import BaseModelArgs, create_attention_mask
from mlx_lm.models.cache import KVCache

from model_adapters import gemma_vision, gemma_weights
from model_adapters.base import NO_SETUP, DecodeSetup, DiffusionModel, FamilyDefaults, _stop_ids
from model_adapters.base import Adapter as _BaseAdapter
from model_adapters.option import Option
from model_adapters.runtime.batched import answered, by_width, stacked_head, stacked_prefix_views, token_matrix
from model_adapters.runtime.embeddings import weighted_rows
from model_adapters.runtime.prefix_kv import CAUSAL, PrefixKV, usable
from model_adapters.runtime.sharding import SummedOverRanks, VocabShardedEmbedding, shard_in_place, shard_mlp
from model_adapters.runtime.vocab_top_k import top_k_ids

_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    text_config: dict
    canvas_length: int = 256
    eos_token_id: Optional[Union[int, list]] = None
    vision_config: Optional[dict] = None
    image_token_id: Optional[int] = None
    video_token_id: Optional[int] = None

    def __post_init__(self):
        self.vision = gemma_vision.vision_config(self.vision_config)
        t = self.text_config
        if t.get("use_bidirectional_attention") == "all":
            raise ValueError("DiffusionGemma with use_bidirectional_attention='all' is not supported")
        n = t.get("num_hidden_layers", 30)
        layer_types = t.get("layer_types") or [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)
        ]
        layer_types[-1] = "full_attention"  # as transformers forces
        # transformers writes the full-attention layers' head size and KV heads into
        # per_layer_config (keyed by layer index); the released configs have them top-level
        full = [
            dict((t.get("per_layer_config") or {}).get(str(i), {}))
            for i, k in enumerate(layer_types)
            if k == "full_attention"
        ]
        if any(f != full[0] for f in full):
            raise ValueError("DiffusionGemma full-attention layers with different shapes are not supported")
        global_head_dim = t.get("global_head_dim") or full[0].get("head_dim") or 512
        global_kv_heads = t.get("num_global_key_value_heads") or full[0].get("num_key_value_heads")
        self.text = gemma4_text.ModelArgs(
            model_type="gemma4_text",
            hidden_size=t["hidden_size"],
            num_hidden_layers=n,
            intermediate_size=t["intermediate_size"],
            num_attention_heads=t["num_attention_heads"],
            head_dim=t.get("head_dim", 256),
            global_head_dim=global_head_dim,
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            vocab_size=t["vocab_size"],
            vocab_size_per_layer_input=t["vocab_size"],
            num_key_value_heads=t.get("num_key_value_heads", 4),
            num_global_key_value_heads=global_kv_heads,
            num_kv_shared_layers=0,
            hidden_size_per_layer_input=0,
            rope_parameters=t.get("rope_parameters") or _DEFAULT_ROPE,
            sliding_window=t.get("sliding_window", 512),
            max_position_embeddings=t.get("max_position_embeddings", 131072),
            attention_k_eq_v=True,  # full-attention layers have no v_proj
            final_logit_softcapping=t.get("final_logit_softcapping", 30.0),
            use_double_wide_mlp=False,
            enable_moe_block=True,
            num_experts=t["num_experts"],
            top_k_experts=t["top_k_experts"],
            moe_intermediate_size=t["moe_intermediate_size"],
            layer_types=layer_types,
        )


class Layer(nn.Module):
    """Gemma 4's MoE layer (mlx-lm's gemma4_text parts) with its scalar passed in: the
    encoder and the decoder share every weight but the layer scalars."""

    def __init__(self, args: gemma4_text.ModelArgs, idx: int):
        super().__init__()
        self.layer_type = args.layer_types[idx]
        self.self_attn = gemma4_text.Attention(args, idx)
        self.mlp = gemma4_text.MLP(args, idx)
        self.router = gemma4_text.Router(args)
        self.experts = gemma4_text.Experts(args)
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
        ):
            setattr(self, name, nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps))
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, mask, cache, scalar: mx.array) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), mask, cache)[0])
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        indices, weights = self.router(h)
        sparse = self.experts(self.pre_feedforward_layernorm_2(h), indices, weights)
        out = h + self.post_feedforward_layernorm(dense + self.post_feedforward_layernorm_2(sparse))
        return out * scalar


class SelfConditioning(nn.Module):
    """Adds the previous step's soft embeddings (through a gated MLP) to the canvas's."""

    def __init__(self, args: gemma4_text.ModelArgs):
        super().__init__()
        self.pre_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_norm = gemma4_text.RMSNormNoScale(args.hidden_size, eps=args.rms_norm_eps)
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def __call__(self, embeddings: mx.array, soft: mx.array) -> mx.array:
        x = self.pre_norm(soft)
        signal = self.down_proj(gemma4_text.geglu(self.gate_proj(x), self.up_proj(x)))
        return self.post_norm(embeddings + signal)


class Decoder(nn.Module):
    def __init__(self, args: gemma4_text.ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [Layer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.self_conditioning = SelfConditioning(args)


class _Scalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_scalar = mx.ones((1,))


class _EncoderLanguageModel(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = [_Scalar() for _ in range(n)]


class _Encoder(nn.Module):
    def __init__(self, n: int, vision: Any = None, hidden_size: int = 0):
        super().__init__()
        self.language_model = _EncoderLanguageModel(n)
        if vision is not None:  # mlx-vlm's modules, under the checkpoint's names
            self.vision_tower, self.embed_vision = gemma_vision.vision_modules(vision, hidden_size)


class Backbone(nn.Module):
    def __init__(self, args: gemma4_text.ModelArgs, vision: Any = None):
        super().__init__()
        self.decoder = Decoder(args)
        # its layer scalars (all else is shared with the decoder) and the vision modules
        self.encoder = _Encoder(args.num_hidden_layers, vision, args.hidden_size)


class _PrefixView:
    """The decoder's read-only view of an encoder cache layer: the cached prefix (its last
    `window - 1` positions on sliding layers, as transformers keeps them) followed by the
    canvas's keys and values, which are not stored."""

    def __init__(self, cache: KVCache, window: Optional[int]):
        self.cache, self.window = cache, window

    @property
    def offset(self) -> int:
        return self.cache.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        n = self.cache.offset
        if n == 0:
            return keys, values
        lo = max(0, n - self.window + 1) if self.window else 0
        k, v = self.cache.keys[..., lo:n, :], self.cache.values[..., lo:n, :]
        return mx.concatenate([k, keys], axis=2), mx.concatenate([v, values], axis=2)


class Model(DiffusionModel):
    """No `backbone`: the uniform-noise adapter calls `encode` and `decode`; the head is
    always tied to the decoder's embeddings."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, Backbone(args.text, args.vision))
        self.embed_scale = args.text.hidden_size**0.5
        self.softcap = args.text.final_logit_softcapping
        _materialize_buffers(self)

    @property
    def layers(self):
        return self.model.decoder.layers

    def make_kv_cache(self) -> list:
        return [KVCache() for _ in self.layers]

    def head(self, hidden: mx.array) -> mx.array:
        logits = self.model.decoder.embed_tokens.as_linear(hidden).astype(mx.float32)
        return mx.tanh(logits / self.softcap) * self.softcap

    @property
    def has_vision(self) -> bool:
        return hasattr(self.model.encoder, "vision_tower")

    def encode(self, inputs: mx.array, cache: list, vision: Optional[gemma_vision.VisionInputs] = None) -> mx.array:
        """Causal pass of the encoder over `inputs`, stored in `cache`; the final hidden
        states. With `vision`, the image tokens of `inputs` carry the images' features."""
        d, window = self.model.decoder, self.args.text.sliding_window
        h = d.embed_tokens(inputs) * self.embed_scale
        masks = {
            "full_attention": create_attention_mask(h, cache[0]),
            "sliding_attention": create_attention_mask(h, cache[0], window_size=window),
        }
        if vision is not None:
            h, masks = self._with_images(inputs, h, cache[0].offset, vision, masks)
        for layer, c, s in zip(d.layers, cache, self.model.encoder.language_model.layers):
            h = layer(h, masks[layer.layer_type], c, s.layer_scalar)
        return d.norm(h)

    def _with_images(
        self, inputs: mx.array, h: mx.array, offset: int, vision: gemma_vision.VisionInputs, masks: dict
    ) -> tuple:
        if not self.has_vision:
            raise ValueError("this DiffusionGemma checkpoint has no vision tower; it takes text only")
        a, enc = self.args, self.model.encoder
        where = gemma_vision.vision_token_mask(inputs, (a.image_token_id, a.video_token_id), vision.mm_token_type_ids)
        features = enc.embed_vision(enc.vision_tower(vision.pixel_values, vision.position_ids))
        h = gemma_vision.scatter_features(h, where, features)
        if a.text_config.get("use_bidirectional_attention") == "vision":
            masks = gemma_vision.encoder_masks(where, offset, a.text.sliding_window)
        return h, masks

    def _soft_embeddings(self, logits: mx.array, top_k: int = 0) -> mx.array:
        """softmax(logits) @ embeddings, scaled like the embeddings (self-conditioning input).
        With `top_k`, from the k largest logits only (renormalised over them) and the k
        embedding rows they name (Fast-dLLM-mlx's cheaper step; not the reference's)."""
        if 0 < top_k < logits.shape[-1]:
            return _top_k_soft_embeddings(self.model.decoder.embed_tokens, logits, top_k) * self.embed_scale
        table = self.model.decoder.embed_tokens
        probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
        if isinstance(table, VocabShardedEmbedding):
            soft = table.weighted_rows(probs, weighted_rows)
        else:
            soft = weighted_rows(table, probs)
        return soft * self.embed_scale

    # -- tensor parallelism (model_adapters.runtime.sharding)

    def shard_sizes(self) -> list:
        t = self.args.text
        return [
            ("num_attention_heads", t.num_attention_heads),
            ("num_key_value_heads", t.num_key_value_heads),
            ("num_global_key_value_heads", t.num_global_key_value_heads),
            ("intermediate_size", t.intermediate_size),
            ("moe_intermediate_size", t.moe_intermediate_size),
        ]

    def shard_layers(self, group: mx.distributed.Group) -> None:
        """Attention split by heads, the dense MLP and the self-conditioning MLP by hidden
        units, the experts by every expert's hidden units (one all_sum for the block's
        sparse output, before its norm); the router stays replicated. The encoder shares
        these layers, so it is sharded with them."""
        N = group.size()
        d = self.model.decoder
        for layer in d.layers:
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):
                if name in attn:
                    setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
            attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
            attn.n_heads //= N
            attn.n_kv_heads //= N
            shard_mlp(layer.mlp, group)
            shard_in_place(layer.experts.switch_glu, group)
            layer.experts = SummedOverRanks(layer.experts, group)
        shard_mlp(d.self_conditioning, group)

    def shard_vocabulary(self, group: mx.distributed.Group) -> None:
        """The decoder's embeddings (the tied head) split by vocabulary rows."""
        d = self.model.decoder
        d.embed_tokens = VocabShardedEmbedding(d.embed_tokens, group)

    def decode(
        self, canvas: mx.array, cache: list, self_conditioning: Optional[mx.array] = None, top_k: int = 0
    ) -> mx.array:
        """Softcapped logits (B, C, V) of the decoder over `canvas`, on top of the cached
        prefix (`top_k`: the cheaper self-conditioning, see `_soft_embeddings`)."""
        return self.head(
            self.decoder_hidden(canvas, self.prefix_views(cache), self.soft_input(self_conditioning, top_k))
        )

    def decode_top_k(self, canvas: mx.array, cache: list, self_conditioning: Optional[tuple], k: int) -> tuple:
        """The cheaper step's forward: the k largest logits of every position, softcapped
        (tanh is increasing: the top k of the softcapped logits are those of the raw
        ones, so the softcap runs on k values, not the vocabulary), as (values (B, C, k)
        float32, token ids (B, C, k)). `self_conditioning`: the previous step's
        (scaled values, ids), whose k embedding rows make the soft embeddings."""
        return self.top_k_head(
            self.decoder_hidden(canvas, self.prefix_views(cache), self.soft_input(self_conditioning)), k
        )

    def top_k_head(self, hidden: mx.array, k: int) -> tuple:
        """`decode_top_k`'s (values, ids) of the decoder's hidden states."""
        raw = self.model.decoder.embed_tokens.as_linear(hidden)
        V = raw.shape[-1]
        if k >= V:  # the whole vocabulary in order: the exact step, through this path
            ids = mx.broadcast_to(mx.arange(V, dtype=mx.uint32), raw.shape)
        else:
            ids = top_k_ids(raw, k)  # (two small partitions, not one over the vocabulary)
        values = mx.take_along_axis(raw, ids, axis=-1).astype(mx.float32)
        return mx.tanh(values / self.softcap) * self.softcap, ids

    def prefix_views(self, cache: list) -> list:
        """The decoder's per-layer views of one row's encoder cache (sliding layers: the
        last `sliding_window - 1` positions)."""
        return [_PrefixView(c, window) for c, window in zip(cache, self.layer_windows())]

    def layer_windows(self) -> list:
        """Per layer, the sliding window its decoder pass reads the cache through (None: all)."""
        window = self.args.text.sliding_window
        return [window if layer.layer_type == "sliding_attention" else None for layer in self.layers]

    def soft_input(self, self_conditioning: Any, top_k: int = 0) -> Optional[mx.array]:
        """The self-conditioning input (B, C, H) of the previous step's scaled logits, or of
        the cheaper step's (values, ids); None before a canvas's first step."""
        if self_conditioning is None:
            return None
        if isinstance(self_conditioning, tuple):  # (values, ids) of the cheaper step
            return _soft_from_top_k(self.model.decoder.embed_tokens, *self_conditioning) * self.embed_scale
        return self._soft_embeddings(self_conditioning, top_k)

    def decoder_hidden(
        self, canvas: mx.array, views: list, soft: Optional[mx.array], masks: Optional[list] = None
    ) -> mx.array:
        """The decoder's final hidden states over `canvas` (B, C), each layer attending to
        its view's cached prefix and the canvas (`masks`: per layer, None: every key)."""
        d = self.model.decoder
        h = d.embed_tokens(canvas) * self.embed_scale
        h = d.self_conditioning(h, (mx.zeros_like(h) if soft is None else soft).astype(h.dtype))
        for layer, view, mask in zip(d.layers, views, masks or [None] * len(views)):
            h = layer(h, mask, view, layer.layer_scalar)
        return d.norm(h)

    def __call__(
        self,
        inputs: mx.array,
        cache=None,
        canvas: Optional[mx.array] = None,
        self_conditioning: Optional[mx.array] = None,
        vision: Optional[gemma_vision.VisionInputs] = None,
    ) -> mx.array:
        """Encode `inputs` (with its images' features when `vision` is given) causally into
        `cache` (a fresh one if None); return the decoder's logits over `canvas` when
        given, else the encoder's own (causal) logits."""
        cache = self.make_kv_cache() if cache is None else cache
        hidden = self.encode(inputs, cache, vision)
        if canvas is None:
            return self.head(hidden)
        return self.decode(canvas, cache, self_conditioning)

    @property
    def quant_predicate(self):
        """Quantize the text model; the vision tower and projector stay as they are, as
        mlx-vlm's convert leaves every multimodal module."""
        from mlx_vlm.utils import skip_multimodal_module

        return lambda path, module: not skip_multimodal_module(path)

    def sanitize(self, weights: dict) -> dict:
        return gemma_weights.sanitize(weights, self.has_vision, self.args.vision)


def _top_k_soft_embeddings(table: nn.Module, logits: mx.array, k: int) -> mx.array:
    """sum_j softmax(top-k logits)_j * E[index_j]: only k embedding rows per position are
    read (dequantized by the table itself when it is quantized)."""
    indices = top_k_ids(logits, k)
    return _soft_from_top_k(table, mx.take_along_axis(logits, indices, axis=-1), indices)


def _soft_from_top_k(table: nn.Module, values: mx.array, indices: mx.array) -> mx.array:
    """softmax(values) @ E[indices] per position: (B, C, k) logits and their ids."""
    probs = mx.softmax(values.astype(mx.float32), axis=-1, precise=True)
    rows = table(indices)  # (B, C, k, D)
    return (probs[..., None, :].astype(rows.dtype) @ rows)[..., 0, :]


def _materialize_buffers(model: nn.Module) -> None:
    """Evaluate the modules' private arrays (mlx-lm's ProportionalRoPE keeps its
    frequencies as `_freqs`), which loading never evaluates: left lazy, they stay tied to
    the loading thread's stream, and the first forward on another thread (the server's
    protocol route runs on its handler thread) fails with "There is no Stream(cpu, 0)"."""
    buffers = [
        v for _, m in model.named_modules() for k, v in m.items() if k.startswith("_") and isinstance(v, mx.array)
    ]
    mx.eval(buffers)


@dataclass
class _State:
    cache: list
    self_conditioning: Optional[mx.array] = None  # the previous step's scaled logits
    canvas: Optional[int] = None  # start of the canvas being denoised
    pending: Optional[tuple] = None  # a finished canvas not yet encoded
    vision: bool = False  # the prompt carried images: its KV is not kept for another prompt
    top_k: int = 0  # k of the top-k self-conditioning (fast_self_conditioning, fast_step); 0: exact
    top_k_step: int = 0  # k of the top-k step (fast_step): predict returns (values, ids); 0: exact


class Adapter(_BaseAdapter):
    """A uniform-noise canvas over the encoder's causal cache."""

    family = "DiffusionGemma"
    # generation_diffusion_gemma.py's defaults: canvases of 256 (the config's canvas_length),
    # at most 48 steps, entropy-bound acceptance (0.1), temperature 0.8 -> 0.4, stop when
    # stable (1) and confident (0.005).
    defaults = FamilyDefaults(block_length=256, strategy="entropy_bound", steps=48, entropy_bound=0.1)
    decoder = "uniform_canvas"
    likelihood_layout = None  # (uniform noise: no masked bound)
    options = (
        Option(
            "t_min", float, "DiffusionGemma: temperature at a canvas's last step", default=0.4, low=0.0, low_open=True
        ),
        Option(
            "t_max", float, "DiffusionGemma: temperature at a canvas's first step", default=0.8, low=0.0, low_open=True
        ),
        Option(
            "stability_threshold",
            int,
            "DiffusionGemma: stop a row once its argmax canvas repeats this many times (and is confident)",
            default=1,
            low=1,
        ),
        Option(
            "confidence_threshold",
            float,
            "DiffusionGemma: ... and its mean entropy is below this",
            default=0.005,
            low=0.0,
        ),
        Option(
            "fast_self_conditioning",
            bool,
            "DiffusionGemma: self-condition from the top-k scaled logits "
            "only (renormalised; k embedding rows per position) instead of the whole vocabulary: a "
            "cheaper step, not the reference's (off: exact)",
            default=False,
        ),
        Option("self_conditioning_k", int, "DiffusionGemma: k of --fast-self-conditioning", default=256, low=1),
        Option(
            "fast_step",
            bool,
            "DiffusionGemma: the whole step on the top-k logits (k: self_conditioning_k): "
            "softcap, temperature, sampling (top-k sampling), entropy and self-conditioning over the k "
            "largest only; a cheaper step, not the reference's (off: exact)",
            default=False,
        ),
    )

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        self.model = model
        self.mask_id = None  # no mask token: canvases start as uniform noise
        self.vocab_size = model.vocab_size
        self.max_length = model.max_length
        self.eos_ids = frozenset(_eos_ids(model.args, tokenizer))
        self.defaults = replace(type(self).defaults, block_length=model.args.canvas_length)

    def check_options(self, family: dict, values: dict) -> None:
        if family.get("fast_step"):
            for name in ("allowed_tokens", "sampler"):
                if values.get(name) is not None:
                    raise ValueError(
                        f"{name} does not combine with fast_step (its step sees only the top-k logits); drop one"
                    )

    def start(self, prompt: mx.array, reuse: Optional[PrefixKV] = None, setup: DecodeSetup = NO_SETUP) -> _State:
        vision = setup.vision  # (gemma_vision.VisionInputs: the prompt's images)
        if vision is not None:  # image tokens' KV depend on the pixels, not on the ids
            reuse = None
        option = lambda name: self.family_option(setup, name)  # noqa: E731
        fast = option("fast_self_conditioning") or option("fast_step")
        top_k = min(option("self_conditioning_k"), self.vocab_size) if fast else 0
        state = _State(
            reuse.caches() if reuse is not None else self.model.make_kv_cache(),
            vision=vision is not None,
            top_k=top_k,
            top_k_step=top_k if option("fast_step") else 0,
        )
        rest = prompt[:, state.cache[0].offset :]
        if vision is None:
            self.model.encode(rest, state.cache)
        else:
            self.model.encode(rest, state.cache, vision)
        return state

    def reuse_length(self, prefix: Optional[PrefixKV], prompt: mx.array, setup: DecodeSetup = NO_SETUP) -> int:
        """The encoder is causal (its sliding layers keep every position; the mask windows
        them): the same leading tokens have the same KV in any prompt. At least the last
        prompt token is encoded again, so every decode runs the encoder."""
        if setup.vision is not None:
            return 0
        return usable(prefix, CAUSAL, prompt.shape[0], prompt.shape[1] - 1)

    def export_prefix(self, state: _State, length: int) -> Optional[PrefixKV]:
        """The encoder's cache: the prompt and each finished canvas, encoded causally once
        final (the decoder reads the cache without storing)."""
        if state is None or state.vision:  # (another prompt with the same ids has other images)
            return None
        return PrefixKV.of(state.cache, min(length, state.cache[0].offset), CAUSAL)

    def predict(self, state: _State, canvas: mx.array, start: int, end: int) -> mx.array:
        self._ready(state, canvas, start)
        if state.top_k_step:  # the cheaper step: top-k (values, ids), see decode_top_k
            return self.model.decode_top_k(canvas[:, start:end], state.cache, state.self_conditioning, state.top_k_step)
        if state.top_k:  # top-k self-conditioning only (opt-in); the exact one calls decode as before
            return self.model.decode(canvas[:, start:end], state.cache, state.self_conditioning, state.top_k)
        return self.model.decode(canvas[:, start:end], state.cache, state.self_conditioning)

    def _ready(self, state: _State, canvas: mx.array, start: int) -> None:
        """Before a decoder step at `start`: the previous canvas encoded, a new canvas's
        self-conditioning cleared."""
        if state.pending is not None:  # encode the previous canvas first (the reference's order)
            pstart, pend = state.pending
            state.pending = None
            self.model.encode(canvas[:, pstart:pend], state.cache)
        if state.cache[0].offset != start:
            raise RuntimeError(f"cache holds {state.cache[0].offset} positions, canvas starts at {start}")
        if state.canvas != start:  # a new canvas starts without self-conditioning
            state.canvas, state.self_conditioning = start, None

    def predict_batch(self, requests: list) -> list:
        """Rows with canvases of one width and one step kind (exact, or top-k with one k)
        share a decoder forward (model_adapters.runtime.batched's stacked prefix views: each
        row's encoder cache, left-padded and masked, RoPE from its own offset, each sliding
        layer's last window - 1 positions), each row with its own self-conditioning. A
        finished canvas is still encoded per row (once a canvas)."""
        if len(requests) == 1:
            return super().predict_batch(requests)
        for r in requests:
            self._ready(r.state, r.canvas, r.start)
        steps = by_width(requests, also=lambda r: (r.state.top_k, r.state.top_k_step))
        return answered(requests, steps, self._decode_rows)

    def _decode_rows(self, requests: list) -> list:
        model, width, first = self.model, requests[0].end - requests[0].start, requests[0].state
        views, masks = stacked_prefix_views([r.state.cache for r in requests], model.layer_windows(), width)
        canvas = token_matrix([(r, r.start, r.end, 0, 0) for r in requests])
        hidden = model.decoder_hidden(
            canvas, views, self._stacked_soft([r.state.self_conditioning for r in requests], first.top_k), masks
        )
        if first.top_k_step:
            values, ids = model.top_k_head(hidden, first.top_k_step)
            return [(values[i : i + 1], ids[i : i + 1]) for i in range(len(requests))]
        return stacked_head(self, hidden, [(0, width)] * len(requests))

    def _stacked_soft(self, conditioning: list, top_k: int) -> Optional[mx.array]:
        """The rows' self-conditioning inputs (B, C, H): from their stacked previous logits
        (or top-k (values, ids)) at once, over their `top_k` (0: exact); zeros for a row at
        its canvas's first step."""
        if all(c is None for c in conditioning):
            return None
        if all(c is not None for c in conditioning):
            if isinstance(conditioning[0], tuple):
                stacked = tuple(mx.concatenate(parts, axis=0) for parts in zip(*conditioning))
            else:
                stacked = mx.concatenate(conditioning, axis=0)
            return self.model.soft_input(stacked, top_k)
        rows = [self.model.soft_input(c, top_k) for c in conditioning]
        like = next(r for r in rows if r is not None)
        return mx.concatenate([mx.zeros_like(like) if r is None else r for r in rows], axis=0)

    def condition(self, state: _State, logits: mx.array) -> None:
        """The logits the engine decided from (temperature-scaled): next step's self-conditioning."""
        state.self_conditioning = logits

    def finish_block(self, state: _State, canvas: mx.array, start: int, end: int) -> None:
        state.pending = (start, end)  # encoded when the next canvas needs it


def _eos_ids(args: ModelArgs, tokenizer: Any) -> set:
    """The stop ids of the config, of its text_config and of the tokenizer."""
    ids = _stop_ids(args, tokenizer)
    value = args.text_config.get("eos_token_id")
    ids.update([value] if isinstance(value, int) else (int(v) for v in value or ()))
    return ids
