"""Decoders, one per decoding paradigm, chosen by the adapter's `decoder` name."""

from __future__ import annotations

from typing import Any

from .base import BlockState, Canvas, Decoder, Forward, Queued, ReadBack
from .masked_block import MaskedBlockDecoder
from .uniform_canvas import UniformCanvasDecoder

DECODERS: dict[str, type[Decoder]] = {d.name: d for d in (MaskedBlockDecoder, UniformCanvasDecoder)}


def decoder_class(adapter: Any) -> type[Decoder]:
    name = adapter.decoder
    if name not in DECODERS:
        raise ValueError(f"{adapter.family} asks for decoder {name!r}; known: {', '.join(DECODERS)}")
    return DECODERS[name]


__all__ = ["DECODERS", "decoder_class", "Decoder", "Canvas", "BlockState", "Forward", "Queued", "ReadBack"]
