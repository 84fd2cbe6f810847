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
from typing import Any, Optional

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
        "max_position_embeddings": 32768,
        "num_shared_experts": 1,
        "first_k_dense_replace": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 600000.0,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "tie_word_embeddings": False,
    }
    norm_head: bool = False
    block_size: int = BLOCK_SIZE  # the attention block, and LLaDA2.2's routing window
    expert_capacity: int = 0  # > 0: LLaDA2.2's block routing (the group fields are then unused)
    delete_token_id: Optional[int] = None  # LLaDA2.2's structural edit tokens
    split_token_id: Optional[int] = None

    def __post_init__(self):
        if self.norm_head:
            raise ValueError("LLaDA2 checkpoints with norm_head are not supported")

    def text_config(self, params: dict) -> dict:
        config = super().text_config(params)
        if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
            raise ValueError(
                f"LLaDA2 with head_dim {config['head_dim']} != hidden_size / num_attention_heads is not supported"
            )
        top_k = config.get("num_experts_per_tok") or 1
        if self.expert_capacity > 0 and not top_k <= self.expert_capacity:
            raise ValueError(
                f"config.json's expert_capacity ({self.expert_capacity}) must be at least num_experts_per_tok ({top_k})"
            )
        if self.block_size < 1:
            raise ValueError(f"config.json's block_size must be positive, got {self.block_size}")
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


class BlockRouter(Router):
    """LLaDA2.2's block routing (the released `modeling_llada2_moe.py`,
    `LLaDA2MoeGate.block_routing`; FLX-OSS/FluxServe
    `dev-notes/llada2.2-model-support-development-guide.md` section 4): the tokens of each
    window of `block_size` absolute positions share `expert_capacity` experts, those with
    the highest max over the window of the biased scores; each token then takes its top-k
    of the biased scores among them, weighted by its bias-free scores (normalized, scaled).

    Windows are per row at absolute positions: the backbone sets `window_start`, the
    absolute position of the input's first column (an int, or a (B,) array for a batch
    whose rows start at different positions), before each forward. A window the input
    covers only in part (the prompt-only forward of a likelihood or a training step, a
    batch row's left padding, which lies wholly in windows before the row's first real
    window) is routed over the tokens the input has."""

    def __init__(self, args: bailing_moe.ModelArgs, window: int, capacity: int):
        super().__init__(args)
        self.window, self.capacity = window, capacity
        self.window_start: Any = 0

    def __call__(self, x: mx.array):
        logits = self.gate_proj(x).astype(mx.float32)
        scores = mx.sigmoid(logits) if self.score_function == "sigmoid" else mx.softmax(logits, axis=-1)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if self.capacity < choice.shape[-1]:
            allowed = window_experts(choice, self.window_start, self.window, self.capacity)
            choice = mx.where(mx.stop_gradient(allowed), choice, -mx.inf)
        inds = mx.stop_gradient(mx.argpartition(-choice, kth=self.top_k - 1, axis=-1)[..., : self.top_k])
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return inds, (weights * self.routed_scaling_factor).astype(x.dtype)


def window_experts(choice: mx.array, start: Any, window: int, capacity: int) -> mx.array:
    """(B, L, E) bool: the experts each token's routing window allows. `choice` (B, L, E)
    holds the biased scores of L consecutive positions whose first is `start` (an int or
    (B,) ints); windows are [k * window, (k + 1) * window) in absolute positions. The rows
    are laid on a grid of whole windows (the columns before `start`'s window and after the
    input are -inf), the max taken per window, its `capacity` best experts kept."""
    B, L, E = choice.shape
    lead = (mx.array(start) % window).reshape(-1, 1)  # columns of the first window before the input
    windows = -(-L // window) + 1
    column = mx.arange(windows * window)[None, :] - lead  # (B or 1, G): the input column of each grid slot
    inside = (column >= 0) & (column < L)
    index = mx.broadcast_to(mx.clip(column, 0, L - 1)[..., None], (B, windows * window, 1))
    grid = mx.where(inside[..., None], mx.take_along_axis(choice, index, axis=1), -mx.inf)
    best = grid.reshape(B, windows, window, E).max(axis=2)  # (B, windows, E)
    kept = mx.argpartition(-best, kth=capacity - 1, axis=-1)[..., :capacity]
    allowed = mx.put_along_axis(mx.zeros(best.shape, mx.bool_), kept, mx.array(True), axis=-1)
    token_window = mx.broadcast_to(((mx.arange(L)[None, :] + lead) // window)[..., None], (B, L, 1))
    return mx.take_along_axis(allowed, token_window, axis=1)


def routing_start(cache: Optional[list]) -> Any:
    """The absolute position of a forward's first input column: the cache's offset (a
    KVCache's int, a batched view's (B,) array), 0 without a cache."""
    first = cache[0] if cache else None
    return 0 if first is None else getattr(first, "offset", 0)


class Backbone(LayerStack):
    """Embeddings, Bailing MoE blocks with LLaDA2's router and the final norm; attention
    mask owned by the caller."""

    embedding_name = "word_embeddings"

    def __init__(self, args: bailing_moe.ModelArgs, block: type, window: int, capacity: int):
        self.window, self.capacity = window, capacity  # (plain ints: not parameters)
        super().__init__(args, block)

    def layer(self, block: type, args: bailing_moe.ModelArgs, index: int) -> nn.Module:
        layer = block(args, index)
        if isinstance(layer.mlp, bailing_moe.BailingMoeSparseMoeBlock):
            layer.mlp.gate = BlockRouter(args, self.window, self.capacity) if self.capacity > 0 else Router(args)
        return layer

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        start = routing_start(cache)  # block routing's windows sit on absolute positions
        for layer in self.layers:
            mlp = getattr(layer.mlp, "inner", layer.mlp)  # (tensor parallel: SummedOverRanks)
            if isinstance(getattr(mlp, "gate", None), BlockRouter):
                mlp.gate.window_start = start
        return super().__call__(inputs, mask, cache)


class Model(BlockCausalModel):
    """LLaDA2's training-time block-causal attention over the Bailing MoE backbone."""

    embedding_name = "word_embeddings"

    def __init__(self, args: ModelArgs):
        backbone = Backbone(args.text, bailing_moe.BailingMoeDecoderLayer, args.block_size, args.expert_capacity)
        super().__init__(args, backbone)

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
# LLaDA2.2's `generate` defaults (the released modeling_llada2_moe.py; FluxServe's guide, 3.4)
LLADA2_2_DEFAULTS = {"threshold": 0.5, "editing_threshold": 0.0, "max_post_steps": 16}
MAX_STEPS_PER_BLOCK = 1000  # the reference's hard cap on steps per block


def edit_ops(family: Any) -> set:
    """The edits a decode's `edit_ops` asks for ('none' and [] alike: none)."""
    return set(family.get("edit_ops") or ()) - {"none"}


class Adapter(BlockCausalAdapter):
    """LLaDA2.0/2.1 `generate`: 32-token blocks aligned on absolute positions (the
    first starts at floor(P / 32) * 32 and holds the prompt's tail), threshold 0.95
    strict with the even quota's top-k as fallback, early stop once a committed EOS
    has no mask before it. LLaDA2.1's token editing comes with `editing_threshold` /
    `max_post_steps`, or the model card's presets (`preset="speed"` or `"quality"`).

    LLaDA2.2 (a checkpoint with `delete_token_id` and `split_token_id`): its joint decoder
    with DELETE / SPLIT edits (mlx_lm_diffusion.decoding.decoders.block_edits) at the
    reference's defaults (threshold 0.5, editing_threshold 0.0, max_post_steps 16, steps =
    the block length, at most 1000 steps a block); `edit_ops` without insert and delete
    decodes with the masked-block decoder instead (any commit rule; substitution edits with
    an editing_threshold)."""

    family = "LLaDA2.x"
    defaults = FamilyDefaults(block_length=BLOCK_SIZE, strategy="low_confidence_dynamic", threshold=0.95)
    # LLaDA2.1 model card: speed mode (S) and quality mode (Q).
    presets = {
        "speed": {"threshold": 0.5, "editing_threshold": 0.0},
        "quality": {"threshold": 0.7, "editing_threshold": 0.5},
    }
    options = (
        Option(
            "edit_ops",
            tuple,
            f"Token edits: {', '.join(EDIT_OPS)} (insert and delete: LLaDA2.2's DELETE / "
            "SPLIT tokens, on by default on a LLaDA2.2 checkpoint; none (or []) turns every edit off)",
            item=str,
        ),
        Option(
            "max_steps_per_block",
            int,
            "LLaDA2.2's edit decoding: the most steps a block may take "
            f"(default {MAX_STEPS_PER_BLOCK}, the reference's cap)",
            low=1,
            high=100000,
        ),
    )

    def __init__(self, model: Any, tokenizer: Any = None, use_cache: bool = True):
        super().__init__(model, tokenizer, use_cache)
        self.attention_block = model.block_size
        args = model.args
        # (DELETE, SPLIT): LLaDA2.2's structural edit tokens, from config.json; None before 2.2
        ids = (args.delete_token_id, args.split_token_id)
        self.edit_ids: Optional[tuple] = ids if None not in ids else None
        self.routing_window: Optional[int] = model.block_size if args.expert_capacity > 0 else None
        if self.edit_ids is None:
            self.defaults = FamilyDefaults(
                block_length=model.block_size, strategy="low_confidence_dynamic", threshold=0.95
            )
        else:  # (editing_threshold stays unset: the edit decoder's own default is the reference's 0.0)
            self.defaults = FamilyDefaults(
                block_length=model.block_size,
                strategy="low_confidence_dynamic",
                threshold=LLADA2_2_DEFAULTS["threshold"],
                max_post_steps=LLADA2_2_DEFAULTS["max_post_steps"],
            )
            self.eos_ids = self.eos_ids - set(self.edit_ids)

    @property
    def suppress_ids(self) -> frozenset:
        """The mask token and, on LLaDA2.2, DELETE and SPLIT: a decoder that does not consume
        them (the masked-block decoder, the step-schedule protocol) never proposes them."""
        return super().suppress_ids | frozenset(self.edit_ids or ())

    def decoder_for(self, family: Any) -> str:
        """LLaDA2.2's joint decoder with structural edits where the checkpoint has them and
        `edit_ops` leaves insert or delete on (unset: on)."""
        ops = family.get("edit_ops")
        structural = ops is None or bool(edit_ops(family) & {"insert", "delete"})
        return "block_edits" if self.edit_ids is not None and structural else "masked_block"

    def check_options(self, family: dict, values: dict) -> None:
        """Substitution edits are LLaDA2.1/2.2's editing_threshold; insert and delete are
        LLaDA2.2's DELETE and SPLIT tokens, which come together (a SPLIT's mask is refilled,
        a DELETE's gap padded: the block keeps its length)."""
        given = set(family.get("edit_ops") or ())
        if given - {*EDIT_OPS, "none"}:
            raise ValueError(
                f"Unknown edit_ops {sorted(given - {*EDIT_OPS, 'none'})}; choose from {EDIT_OPS} (or none)"
            )
        if "none" in given and len(given) > 1:
            raise ValueError("edit_ops 'none' turns every edit off; give it alone")
        ops = edit_ops(family)
        structural = ops & {"insert", "delete"}
        if structural and self.edit_ids is None:
            raise ValueError(
                "insert and delete edits are LLaDA2.2's DELETE and SPLIT tokens, which this checkpoint lacks "
                "(config.json's delete_token_id and split_token_id); only substitution edits apply: "
                "edit_ops=('substitute',) with editing_threshold"
            )
        if structural and structural != {"insert", "delete"}:
            raise ValueError(
                "insert and delete edits come together (LLaDA2.2's decoder writes both); "
                "give edit_ops=['substitute', 'insert', 'delete'] or neither"
            )
        if structural and "substitute" not in ops:
            raise ValueError(
                "LLaDA2.2's insert and delete edits are written by its token edits; add 'substitute' to edit_ops"
            )
        if (
            ops == {"substitute"}
            and values.get("editing_threshold") is None
            and self.defaults.editing_threshold is None
        ):
            raise ValueError("substitution edits need an editing_threshold (or a preset that sets one)")

    def check_resolved(self, options: Any) -> None:
        """LLaDA2.2 routes experts per window of `block_size` positions: a decoding block
        covers whole windows (the step-schedule protocol's one block, which its schedule
        decides, is routed over the windows it has)."""
        window = self.routing_window
        scheduled = not getattr(options.rule, "seeds_blocks", True)
        if window and not scheduled and options.block_length % window:
            raise ValueError(
                f"block_length must be a multiple of this checkpoint's routing window ({window} tokens, "
                f"config.json's block_size: LLaDA2.2 routes experts per window); got {options.block_length}"
            )
        if options.family.get("max_steps_per_block") is not None and self.decoder_for(options.family) != "block_edits":
            raise ValueError(
                "max_steps_per_block bounds LLaDA2.2's edit decoding (a LLaDA2.2 checkpoint with "
                "insert and delete edits on); drop it"
            )
