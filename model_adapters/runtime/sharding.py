"""Tensor parallelism over an `mx.distributed` group, on mlx.nn's sharding primitives.

Every rank keeps 1/N of each large weight and runs the same forward:

- attention: the query/key/value projections split by heads ("all-to-sharded"), the
  output projection by its input ("sharded-to-all": an all_sum); MLPs likewise, by
  their hidden units. The families on mlx-lm's plain layers reuse mlx-lm's own
  `Model.shard` of their backbone (llama, qwen2, qwen3, ministral3).
- MoE blocks (LLaDA2, DiffusionGemma): every expert's hidden units split across the
  ranks, as mlx-lm shards its MoE models (deepseek, qwen3_moe): each rank computes
  every routed token with its slice of the chosen experts, and one all_sum per block
  adds the slices. The router stays replicated, so every rank routes alike, and the
  work per rank does not depend on where the tokens go.
- embeddings and the output head: split by vocabulary rows, ceil(V / N) per rank (the
  last rank the rest: a vocabulary N does not divide shards too). A lookup embeds on the
  rank that holds the row (zeros elsewhere) and an all_sum adds them; the head's logit
  slices are gathered (`all_gather`, padded to one width and cut back), so every rank
  holds the same full logits.

Identical logits on every rank: an all_sum or all_gather result is the same array on
every rank, and every forward ends in one, so the hidden states after each block and
the logits are bit-identical across ranks; the engine's host decisions (commits, EOS,
finality) are functions of them, and random draws use a random state the ranks share
(mlx_lm_diffusion.parallel.distributed). They are not bit-identical to one process: a sum split
in N partial sums rounds differently (about 1e-6 relative in fp32).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten


def check_divisible(sizes: Iterable[tuple], group_size: int) -> None:
    """ValueError naming the first size that `group_size` does not divide."""
    for what, value in sizes:
        if value is not None and value % group_size:
            raise ValueError(f"cannot shard over {group_size} ranks: {what} ({value}) is not divisible by {group_size}")


def all_gather_last(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """Concatenate each rank's `x` along the last axis, in rank order."""
    moved = mx.moveaxis(x, -1, 0)
    return mx.moveaxis(mx.distributed.all_gather(moved, group=group), 0, -1)


def vocabulary_rows(vocab: int, group: mx.distributed.Group) -> tuple:
    """(first row, rows, rows per rank) of this rank's slice of a vocabulary of `vocab`
    rows: ceil(vocab / N) rows per rank, the last rank the rest, so a vocabulary that N
    does not divide (the demo's 27 tokens over 2 ranks) still shards."""
    N = group.size()
    per_rank = -(-vocab // N)
    if per_rank * (N - 1) >= vocab:
        raise ValueError(f"cannot shard over {N} ranks: the vocabulary size ({vocab}) leaves a rank no rows")
    first = group.rank() * per_rank
    return first, min(per_rank, vocab - first), per_rank


def _keep_rows(module: nn.Module, first: int, rows: int) -> None:
    """Keep rows [first, first + rows) of a layer's weight (and of a quantized layer's
    scales and biases, and of a bias)."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in module:
            module[name] = mx.contiguous(module[name][first : first + rows])


def _gather_rows(local: mx.array, rows_per_rank: int, vocab: int, group: mx.distributed.Group) -> mx.array:
    """Every rank's logit slice (..., rows) concatenated in rank order: each padded to
    the same width for all_gather, the padding cut off again."""
    pad = rows_per_rank - local.shape[-1]
    if pad:
        local = mx.pad(local, [(0, 0)] * (local.ndim - 1) + [(0, pad)])
    return all_gather_last(local, group)[..., :vocab]


class VocabShardedEmbedding(nn.Module):
    """An (optionally quantized) embedding whose rows are split over the ranks
    (`vocabulary_rows`). Lookups and `as_linear` give every rank the full, exact result
    (a row is added to zeros, logit slices are concatenated)."""

    def __init__(self, embedding: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.vocab = embedding.weight.shape[0]
        self.offset, self.rows, self.rows_per_rank = vocabulary_rows(self.vocab, group)
        _keep_rows(embedding, self.offset, self.rows)
        self.local = embedding
        self.group = group

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self.offset
        inside = (local >= 0) & (local < self.rows)
        h = self.local(mx.where(inside, local, 0))
        h = mx.where(inside[..., None], h, mx.zeros_like(h))
        return mx.distributed.all_sum(h, group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        return _gather_rows(self.local.as_linear(x), self.rows_per_rank, self.vocab, self.group)

    def weighted_rows(self, weights: mx.array, local_product) -> mx.array:
        """sum_v weights[..., v] * row_v over the whole vocabulary: `local_product(embedding,
        w)` of this rank's rows and their weights, summed over the ranks."""
        part = local_product(self.local, weights[..., self.offset : self.offset + self.rows])
        return mx.distributed.all_sum(part, group=self.group)


class VocabShardedHead(nn.Module):
    """An output projection split by vocabulary rows; the logit slices are gathered."""

    def __init__(self, linear: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.vocab = linear.weight.shape[0]
        first, rows, self.rows_per_rank = vocabulary_rows(self.vocab, group)
        _keep_rows(linear, first, rows)
        self.local = linear
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        return _gather_rows(self.local(x), self.rows_per_rank, self.vocab, self.group)


class SummedOverRanks(nn.Module):
    """A module whose output on each rank is a partial sum (its weights sharded in place):
    the ranks' outputs added with one all_sum."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        self.group = group

    def __call__(self, *args, **kwargs) -> mx.array:
        return mx.distributed.all_sum(self.inner(*args, **kwargs), group=self.group)


def shard_mlp(mlp: nn.Module, group: mx.distributed.Group) -> None:
    """A gated MLP (gate_proj, up_proj, down_proj) split by hidden units: the down
    projection sums the ranks' parts."""
    mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
    mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
    mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_in_place(mlp: nn.Module, group: mx.distributed.Group) -> None:
    """A gated MLP or SwitchGLU whose output stays a partial sum (summed by its caller):
    its weights split by hidden units, no communication of its own."""
    shard_inplace(mlp.gate_proj, "all-to-sharded", group=group)
    shard_inplace(mlp.up_proj, "all-to-sharded", group=group)
    shard_inplace(mlp.down_proj, "sharded-to-all", group=group)


def shard_mlx_lm_layers(text_module: Any, backbone: nn.Module, group: mx.distributed.Group) -> None:
    """mlx-lm's own `Model.shard` of `text_module` (it reads only `self.model.layers`)
    applied to a backbone of that module's blocks."""
    text_module.Model.shard(SimpleNamespace(model=backbone), group)


def attention_sizes(args: Any) -> list:
    """The sizes mlx-lm's attention and MLP sharding split, as (what, value)."""
    return [
        ("num_attention_heads", args.num_attention_heads),
        ("num_key_value_heads", args.num_key_value_heads),
        ("intermediate_size", args.intermediate_size),
    ]


def shard_vocabulary(model: Any, group: mx.distributed.Group) -> None:
    """Embeddings (and the head, unless tied to them) split by vocabulary rows."""
    backbone = getattr(model, model.backbone_name)
    name = model.embedding_name
    setattr(backbone, name, VocabShardedEmbedding(getattr(backbone, name), group))
    if not model.tied:
        setattr(model, model.head_name, VocabShardedHead(getattr(model, model.head_name), group))


def quantization_groups(model: nn.Module) -> list:
    """(what, groups per row) of every quantized weight: a layer split by its inputs
    splits its quantization groups too (checked for every layer, which is stricter than
    needed for the ones split by their outputs)."""
    return [
        (f"the quantization groups per row of {path[: -len('.scales')]}", value.shape[-1])
        for path, value in tree_flatten(model.parameters())
        if path.endswith(".scales")
    ]


def shard_model(model: Any, group: Optional[mx.distributed.Group] = None) -> None:
    """Shard a diffusion family's model in place over `group` (default: the global one).
    Every size that must divide by the group size is checked before any weight moves."""
    group = group or mx.distributed.init()
    if getattr(model, "shard_group", None) is not None:
        raise ValueError("this model is sharded already")
    N = group.size()
    if N == 1:
        return
    check_divisible(model.shard_sizes(), N)
    vocabulary_rows(model.vocab_size, group)  # (every rank must hold a row)
    check_divisible(quantization_groups(model), N)
    model.shard_layers(group)
    model.shard_vocabulary(group)
    model.shard_group = group
