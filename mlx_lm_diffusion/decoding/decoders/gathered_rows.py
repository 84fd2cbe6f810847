"""The block positions a step reads, gathered before the output layer.

A masked-block step's commit rule reads only the positions it may commit: the masks of
the rows still decoding. The model's output layer, the log-softmax and the entropy over
the vocabulary cost as much per position as a layer of a small model, so a step asks
the adapter for the logits of those positions only (`Adapter.predict_rows`: the head
runs over the gathered hidden states) and spreads the per-position results (proposal,
probability, entropy) back over the block for the rule, whose inputs keep their shape.

The gathered count is rounded up to a bucket (`bucket`: powers of two and the halfway
sizes 3, 6, 12, ...; never more than the block), so a decode sees a few shapes only, not
a fresh one per step (mlx-vlm's turbo engine measured a fresh shape per step drifting
throughput down 6x once kernels are specialised per shape). The padding slots are real
block positions the step does not read (committed or finished positions), each at most
once per row: their logits are computed and never used, and scattering the gathered
values back writes each position once, so no padding value reaches a commit. A bucket
as wide as the block gathers nothing before the head (the whole block's head is the same
work): the step takes the rows it reads from the block's logits instead, so that the
passes over the vocabulary still cover those rows only.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


def bucket(count: int, width: int) -> int:
    """The smallest bucket size >= `count` (1, 2, 3, 4, 6, 8, 12, 16, 24, ...), at most `width`."""
    size = 1
    while size < count:
        # 1 -> 2 -> 3 -> 4 -> 6 -> 8 -> 12 ...: each power of two, then 1.5 times it
        size = size * 3 // 2 if size >= 2 and size & (size - 1) == 0 else 1 << size.bit_length()
    return min(size, width)


def read_positions(read: mx.array, size: int) -> mx.array:
    """(B, size) int32 block positions: each row's read positions (True in `read`, (B, W))
    in order, then its unread positions in order as padding. A row must read at most
    `size` positions (the caller's host count guarantees it)."""
    width = read.shape[1]
    position = mx.arange(width, dtype=mx.int32)
    # read positions sort first, each group in position order (keys are distinct)
    order = mx.argsort(mx.where(read, position, position + width), axis=1)
    return order[:, :size].astype(mx.int32)


def take_rows(values: mx.array, rows: mx.array) -> mx.array:
    """values (B, W, ...) at block positions rows (B, K): (B, K, ...). One index per row
    of the trailing dimensions (a take over the flattened rows), not take_along_axis's
    index per element, which costs about 6 ns an element on the CPU (4x the take for
    rows of a 32k vocabulary)."""
    B, W = values.shape[:2]
    # (one row: its positions are the flat indices, no offsets to add: five ops fewer)
    flat = rows.reshape(-1) if B == 1 else (rows + mx.arange(B, dtype=rows.dtype)[:, None] * W).reshape(-1)
    taken = mx.take(values.reshape(B * W, *values.shape[2:]), flat, axis=0)
    return taken.reshape(*rows.shape, *values.shape[2:])


def spread(values: mx.array, rows: mx.array, base: mx.array) -> mx.array:
    """`base` (B, W, ...) with `values` (B, K, ...) written at block positions `rows` (B, K);
    the positions of a row are distinct, so each is written once."""
    index = rows.reshape(rows.shape + (1,) * (values.ndim - 2))
    return mx.put_along_axis(base, index, values.astype(base.dtype), axis=1)


def spread_filled(values: mx.array, rows: Optional[mx.array], width: int, fill: float = 0.0) -> mx.array:
    """(B, width) per-position `values` (B, K) spread over the block, `fill` where unread;
    `values` itself when nothing was gathered (`rows` None)."""
    if rows is None:
        return values
    return spread(values, rows, mx.full((values.shape[0], width), fill, dtype=values.dtype))


__all__ = ["bucket", "read_positions", "take_rows", "spread", "spread_filled"]
