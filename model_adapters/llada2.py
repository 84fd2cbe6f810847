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
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx_lm.models import bailing_moe

from model_adapters.attention.block_cache import BlockCausalAdapter, BlockCausalModel
from model_adapters.base import DiffusionArgs, FamilyDefaults, LayerStack
from model_adapters.option import Option
from model_adapters.runtime.sharding import SummedOverRanks, shard_in_place, shard_mlp

BLOCK_SIZE = 32  # LLaDA2.x is trained with block-causal attention over 32-token blocks


@dataclass
class ModelArgs(DiffusionArgs):
    text_module = bailing_moe
    # LLaDA2's configuration defaults where bailing_moe has none or others
    text_defaults = {
        "max_position_embeddings": 32768, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "topk_group": 1, "norm_topk_prob": True, "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "rms_norm_eps": 1e-6, "rope_theta": 600000.0,
        "partial_rotary_factor": 0.5, "use_qk_norm": True, "tie_word_embeddings": False,
    }
    norm_head: bool = False
    block_size: int = BLOCK_SIZE

    def __post_init__(self):
        if self.norm_head:
            raise ValueError("LLaDA2 checkpoints with norm_head are not supported")

    def text_config(self, params: dict) -> dict:
        config = super().text_config(params)
        if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
            raise ValueError(
                f"LLaDA2 with head_dim {config['head_dim']} != hidden_size / num_attention_heads "
                "is not supported"
            )
        return config


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
        # (the choice carries no gradient: mlx cannot differentiate through gathered indices)
        inds = mx.stop_gradient(mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., : self.top_k])
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return inds, (weights * self.routed_scaling_factor).astype(x.dtype)


class Backbone(LayerStack):
    """Embeddings, Bailing MoE blocks with LLaDA2's router and the final norm; attention
    mask owned by the caller."""

    embedding_name = "word_embeddings"

    def layer(self, block: type, args: bailing_moe.ModelArgs, index: int) -> nn.Module:
        layer = block(args, index)
        if isinstance(layer.mlp, bailing_moe.BailingMoeSparseMoeBlock):
            layer.mlp.gate = Router(args)
        return layer


class Model(BlockCausalModel):
    """LLaDA2's training-time block-causal attention over the Bailing MoE backbone."""

    embedding_name = "word_embeddings"

    def __init__(self, args: ModelArgs):
        super().__init__(args, Backbone(args.text, bailing_moe.BailingMoeDecoderLayer))

    def sanitize(self, weights: dict) -> dict:
        """Per-expert weights stacked into `switch_mlp`, the router's weight renamed, and a
        zero expert bias where the checkpoint has none (as mlx-lm's bailing_moe does)."""
        weights = super().sanitize(weights)
        args = self.args.text
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
        return weights

    def shard_sizes(self) -> list:
        args = self.args.text
        shared = (args.moe_shared_expert_intermediate_size or args.moe_intermediate_size) * args.num_shared_experts
        return [
            ("num_attention_heads", args.num_attention_heads),
            ("num_key_value_heads", args.num_key_value_heads),
            ("intermediate_size", args.intermediate_size),
            ("moe_intermediate_size", args.moe_intermediate_size),
            ("the shared experts' intermediate size", shared),
        ]

    def shard_layers(self, group: mx.distributed.Group) -> None:
        """Attention split by heads (the fused query_key_value by its q, k and v parts),
        dense MLPs by hidden units, MoE blocks by every expert's hidden units (routed and
        shared) with one all_sum per block; the router stays replicated."""
        if self.args.text.use_bias:
            # a sharded-to-all bias would be added once per rank
            raise ValueError("cannot shard LLaDA2 checkpoints with linear biases (use_bias)")
        N = group.size()
        for layer in self.model.layers:
            attn = layer.attention
            q = attn.num_attention_heads * attn.head_dim
            kv = attn.num_key_value_heads * attn.head_dim
            attn.query_key_value = shard_linear(
                attn.query_key_value, "all-to-sharded", segments=[q, q + kv], group=group
            )
            attn.dense = shard_linear(attn.dense, "sharded-to-all", group=group)
            attn.num_attention_heads //= N
            attn.num_key_value_heads //= N
            if isinstance(layer.mlp, bailing_moe.BailingMoeSparseMoeBlock):
                shard_in_place(layer.mlp.switch_mlp, group)
                if layer.mlp.shared_experts is not None:
                    shard_in_place(layer.mlp.shared_experts, group)
                layer.mlp = SummedOverRanks(layer.mlp, group)
            else:
                shard_mlp(layer.mlp, group)

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
