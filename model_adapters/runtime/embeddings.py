"""Weighted sums of embedding rows (self-conditioning's expected embedding), for a plain or a
quantized table."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def weighted_rows(table: nn.Module, weights: mx.array) -> mx.array:
    """weights (..., V) @ the table's rows (an Embedding or a QuantizedEmbedding of V rows): a
    quantized table is read through quantized_matmul, never dequantized whole."""
    if isinstance(table, nn.QuantizedEmbedding):
        return mx.quantized_matmul(
            weights,
            table.weight,
            table.scales,
            table.biases,
            transpose=False,
            group_size=table.group_size,
            bits=table.bits,
            mode=getattr(table, "mode", "affine"),
        )
    return weights.astype(table.weight.dtype) @ table.weight
