"""Decoders, one per decoding paradigm, chosen by the adapter's `decoder` name."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from mlx_lm_diffusion.decoding.decoders.base import BlockState, Canvas, Decoder, Forward, Queued, ReadBack
from mlx_lm_diffusion.decoding.decoders.block_edits import BlockEditsDecoder
from mlx_lm_diffusion.decoding.decoders.duo_block import DuoBlockDecoder
from mlx_lm_diffusion.decoding.decoders.introspective import IntrospectiveDecoder
from mlx_lm_diffusion.decoding.decoders.masked_block import MaskedBlockDecoder
from mlx_lm_diffusion.decoding.decoders.speculative import SpeculativeDecoder
from mlx_lm_diffusion.decoding.decoders.uniform_canvas import UniformCanvasDecoder

DECODERS: dict[str, type[Decoder]] = {
    d.name: d
    for d in (
        MaskedBlockDecoder,
        UniformCanvasDecoder,
        SpeculativeDecoder,
        BlockEditsDecoder,
        IntrospectiveDecoder,
        DuoBlockDecoder,
    )
}


def decoder_class(adapter: Any, family: Optional[Mapping] = None) -> type[Decoder]:
    """The adapter's decoder for a decode with these family options (None: its default)."""
    name = adapter.decoder_for(family) if family is not None and hasattr(adapter, "decoder_for") else adapter.decoder
    if name not in DECODERS:
        raise ValueError(f"{adapter.family} asks for decoder {name!r}; known: {', '.join(DECODERS)}")
    return DECODERS[name]


__all__ = ["DECODERS", "decoder_class", "Decoder", "Canvas", "BlockState", "Forward", "Queued", "ReadBack"]
