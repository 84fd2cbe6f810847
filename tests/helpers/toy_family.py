"""A toy diffusion family, defined outside the package: the whole of what a new family is.

Qwen2 layers, bidirectional attention, a configurable logit shift (its own option,
`logit_shift`: 1 reads position i's prediction at i - 1, as Dream does; 0 reads it at i).
It registers itself with one line; the engine, the options and the front doors are not
touched. Decoding it with logit_shift=1 must give Dream's tokens on the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import qwen2

from model_adapters import register_family
from model_adapters.base import NO_SETUP, DecodeSetup, DiffusionArgs, DiffusionModel, FamilyDefaults, LayerStack
from model_adapters.base import Adapter as BaseAdapter
from model_adapters.option import Option

MODEL_TYPE = "toy_diffusion"


@dataclass
class ModelArgs(DiffusionArgs):
    text_module = qwen2
    text_defaults = {"tie_word_embeddings": False}


class Model(DiffusionModel):
    def __init__(self, args: ModelArgs):
        super().__init__(args, LayerStack(args.text, qwen2.TransformerBlock))


class Adapter(BaseAdapter):
    family = "Toy"
    defaults = FamilyDefaults(block_length=8, strategy="low_confidence")
    options = (
        Option(
            "logit_shift", int, "Toy: positions between a token and the row predicting it", default=1, low=0, high=1
        ),
    )

    def start(self, prompt: mx.array, reuse: Any = None, setup: DecodeSetup = NO_SETUP) -> int:
        return self.family_option(setup, "logit_shift")  # (the decode's state: its shift)

    def predict(self, shift: int, canvas: mx.array, start: int, end: int) -> mx.array:
        hidden = self.model.backbone(canvas)
        return self.model.head(hidden[:, start - shift : end - shift])


register_family(MODEL_TYPE, __name__)
