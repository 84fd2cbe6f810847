"""The ids of the k largest logits over a large vocabulary, exactly, in two small passes.

`mx.argpartition` over a 262,144-token row costs on MLX's CPU backend about as much as
the head's matmul several times over (measured ~340 ms CPU for 64 positions, against
~20 ms for a max over the same logits). Every one of the k largest values lies in one of
the k chunks with the largest maxima (every value of a chunk whose max is below the k-th
largest chunk max is below k other values: the k best maxima), so: the max of each chunk
of S logits, an argpartition over the V/S maxima for the k best chunks, and one over
their k*S logits. With S near sqrt(V/k) the partitions see about 2*sqrt(V*k) values, not V
(at V = 262,144 and k = 256: 16,384).
"""

from __future__ import annotations

import math

import mlx.core as mx


def chunk_size(vocab_size: int, k: int) -> int:
    """S balancing the two partitions (V/S chunk maxima, k*S candidates): the largest
    divisor of V up to sqrt(V/k), so chunks tile the row; 1: no chunking."""
    if not 0 < k < vocab_size:
        return 1
    return next(s for s in range(math.isqrt(vocab_size // k), 0, -1) if vocab_size % s == 0)


def top_k_ids(logits: mx.array, k: int) -> mx.array:
    """(..., k) uint32 ids of the k largest of `logits` (..., V) along the last axis, in no
    particular order; the same set as argpartition's (up to ties at the k-th value)."""
    V = logits.shape[-1]
    S = chunk_size(V, k)
    if S < 2:  # a small (or prime) vocabulary: one partition
        return mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
    lead = logits.shape[:-1]
    maxima = mx.max(logits.reshape(*lead, V // S, S), axis=-1)
    chunks = mx.argpartition(-maxima, kth=k - 1, axis=-1)[..., :k].astype(mx.uint32)
    candidates = (chunks[..., None] * S + mx.arange(S, dtype=mx.uint32)).reshape(*lead, k * S)
    chosen = mx.argpartition(-mx.take_along_axis(logits, candidates, axis=-1), kth=k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(candidates, chosen, axis=-1)
