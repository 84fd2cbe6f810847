"""LLaDA2.0 / 2.1 (`llada2_moe`): BailingMoeV2 layers with block-causal attention.

mlx-lm's bailing_moe layers cover the architecture (fused query_key_value, q/k
RMSNorm, partial RoPE, first dense layer(s), routed experts plus a shared expert);
the checkpoint names match them after mlx-lm's own renames (`mlp.gate.weight` ->
`mlp.gate.gate_proj.weight`, per-expert weights stacked into `switch_mlp`). One
module differs: the router masks the experts of unselected groups with -inf, as
the Hugging Face reference does (mlx-lm's bailing router zeroes them, which can
pick a masked expert once the expert bias makes selected scores negative).

The mask token and EOS are read from the checkpoint (tokenizer and config), never
hard-coded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import bailing_moe
from mlx_lm.models.base import BaseModelArgs

from .base import FamilyDefaults
from .block_cache import BlockCausalAdapter, window_mask
from .option import Option

BLOCK_SIZE = 32  # LLaDA2.x is trained with block-causal attention over 32-token blocks


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    head_dim: Optional[int] = None
    max_position_embeddings: int = 32768
    num_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 600000.0
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    partial_rotary_factor: float = 0.5
    rotary_dim: Optional[int] = None
    use_qkv_bias: bool = False
    use_bias: bool = False
    use_qk_norm: bool = True
    norm_head: bool = False
    tie_word_embeddings: bool = False
    block_size: int = BLOCK_SIZE
    mask_token_id: Optional[int] = None  # else the tokenizer's mask token
    eos_token_id: Optional[Union[int, list]] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        if self.head_dim not in (None, self.hidden_size // self.num_attention_heads):
            raise ValueError(
                f"LLaDA2 with head_dim {self.head_dim} != hidden_size / num_attention_heads "
                "is not supported"
            )
        if self.norm_head:
            raise ValueError("LLaDA2 checkpoints with norm_head are not supported")

    def bailing_args(self) -> bailing_moe.ModelArgs:
        return bailing_moe.ModelArgs(
            model_type="bailing_moe",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            num_shared_experts=self.num_shared_experts,
            norm_topk_prob=self.norm_topk_prob,
            num_attention_heads=self.num_attention_heads,
            num_experts_per_tok=self.num_experts_per_tok,
            num_hidden_layers=self.num_hidden_layers,
            num_key_value_heads=self.num_key_value_heads,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            vocab_size=self.vocab_size,
            first_k_dense_replace=self.first_k_dense_replace,
            rope_scaling=self.rope_scaling,
            use_bias=self.use_bias,
            use_qkv_bias=self.use_qkv_bias,
            use_qk_norm=self.use_qk_norm,
            tie_word_embeddings=self.tie_word_embeddings,
            partial_rotary_factor=self.partial_rotary_factor,
            rotary_dim=self.rotary_dim,
            moe_router_enable_expert_bias=self.moe_router_enable_expert_bias,
            routed_scaling_factor=self.routed_scaling_factor,
            score_function=self.score_function,
            n_group=self.n_group,
            topk_group=self.topk_group,
        )


class Router(bailing_moe.BailingMoeGate):
    """LLaDA2's grouped router: sigmoid scores, plus the expert bias for the choice
    only; the `topk_group` groups with the best top-2 sums stay eligible, the others
    are masked with -inf; the chosen scores are normalized and scaled."""

    def __call__(self, x: mx.array):
        logits = self.gate_proj(x).astype(mx.float32)
        scores = mx.sigmoid(logits) if self.score_function == "sigmoid" else mx.softmax(logits, axis=-1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.n_group > 1:
            grouped = mx.unflatten(choice, -1, (self.n_group, -1))
            group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1)
            cutoff = mx.topk(group_scores, self.topk_group, axis=-1).min(axis=-1, keepdims=True)
            keep = (group_scores >= cutoff)[..., None]
            choice = mx.flatten(mx.where(keep, grouped, -mx.inf), -2, -1)
        inds = mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return mx.stop_gradient(inds), (weights * self.routed_scaling_factor).astype(x.dtype)


class Backbone(nn.Module):
    """Embeddings, Bailing MoE blocks and the final norm; attention mask owned by the caller."""

    def __init__(self, args: bailing_moe.ModelArgs):
        super().__init__()
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [bailing_moe.BailingMoeDecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        for layer in self.layers:
            if isinstance(layer.mlp, bailing_moe.BailingMoeSparseMoeBlock):
                layer.mlp.gate = Router(args)
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        h = self.word_embeddings(inputs)
        cache = cache or [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = Backbone(args.bailing_args())
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    @property
    def block_size(self) -> int:
        return self.args.block_size

    def backbone(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        return self.model(inputs, mask, cache)

    def head(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.word_embeddings.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs: mx.array, cache=None, mask=None) -> mx.array:
        """Raw logits (B, L, V) with LLaDA2's training-time block-causal attention
        (positions continue from the cache's offset when a cache is given)."""
        if mask is None:
            offset = cache[0].offset if cache else 0
            mask = window_mask(offset, offset + inputs.shape[1], self.args.block_size)
        return self.head(self.backbone(inputs, mask, cache))

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        args = self.args
        for i in range(args.first_k_dense_replace, args.num_hidden_layers):
            prefix = f"model.layers.{i}.mlp"
            for name in ("gate_proj", "up_proj", "down_proj"):
                for kind in ("weight", "scales", "biases"):
                    if f"{prefix}.experts.0.{name}.{kind}" in weights:
                        keys = [f"{prefix}.experts.{e}.{name}.{kind}" for e in range(args.num_experts)]
                        weights[f"{prefix}.switch_mlp.{name}.{kind}"] = mx.stack([weights.pop(k) for k in keys])
            if f"{prefix}.gate.weight" in weights:
                weights[f"{prefix}.gate.gate_proj.weight"] = weights.pop(f"{prefix}.gate.weight")
            if args.moe_router_enable_expert_bias and f"{prefix}.gate.expert_bias" not in weights:
                weights[f"{prefix}.gate.expert_bias"] = mx.zeros((args.num_experts,))
        if args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights

    @property
    def quant_predicate(self):
        def predicate(path, _):  # the router stays at 8 bits, as mlx-lm's bailing_moe
            if path.endswith("mlp.gate.gate_proj"):
                return {"group_size": 64, "bits": 8}
            return True

        return predicate

    @property
    def cast_predicate(self):
        return lambda key: "expert_bias" not in key


EDIT_OPS = ("substitute", "insert", "delete")


class Adapter(BlockCausalAdapter):
    """LLaDA2.0/2.1 `generate`: 32-token blocks aligned on absolute positions (the
    first starts at floor(P / 32) * 32 and holds the prompt's tail), threshold 0.95
    strict with the even quota's top-k as fallback, early stop once a committed EOS
    has no mask before it. LLaDA2.1's token editing comes with `editing_threshold` /
    `max_post_steps`, or the model card's presets (`preset="speed"` or `"quality"`)."""

    family = "LLaDA2.x"
    defaults = FamilyDefaults(block_length=BLOCK_SIZE, strategy="low_confidence_dynamic", threshold=0.95)
    # LLaDA2.1 model card: speed mode (S) and quality mode (Q).
    presets = {
        "speed": {"threshold": 0.5, "editing_threshold": 0.0},
        "quality": {"threshold": 0.7, "editing_threshold": 0.5},
    }
    options = (
        Option("edit_ops", tuple, f"Token edits: {', '.join(EDIT_OPS)} (insert and delete, LLaDA2.2's, "
               "are refused)", item=str),
    )

    def check_options(self, family: dict, values: dict) -> None:
        """Substitution edits are LLaDA2.1/2.2's editing_threshold; LLaDA2.2's insert and
        delete edits change the canvas length, which a fixed canvas cannot do."""
        ops = set(family.get("edit_ops") or ())
        if ops - set(EDIT_OPS):
            raise ValueError(f"Unknown edit_ops {sorted(ops - set(EDIT_OPS))}; choose from {EDIT_OPS}")
        if ops & {"insert", "delete"}:
            raise ValueError(
                "insert and delete edits (LLaDA2.2) change the canvas length and are not supported; "
                "only substitution edits are: edit_ops=('substitute',) with editing_threshold"
            )
        if ops and values.get("editing_threshold") is None and self.defaults.editing_threshold is None:
            raise ValueError("substitution edits need an editing_threshold (or a preset that sets one)")

    def __init__(self, model: Any, tokenizer: Any = None, use_cache: bool = True):
        super().__init__(model, tokenizer, use_cache)
        self.attention_block = model.block_size
        self.defaults = FamilyDefaults(
            block_length=model.block_size, strategy="low_confidence_dynamic", threshold=0.95
        )
