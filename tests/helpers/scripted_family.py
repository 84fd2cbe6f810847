"""A diffusion family that writes a fixed answer, for the server tests that need a model
to write something particular (a tool call): answer position i is SCRIPT's token i, then
EOS, with near-certainty, whatever the prompt and whatever order the decoder commits in.
Its weights are toy_family's (Qwen2 layers); only the adapter's predictions are scripted."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from toy_family import Model, ModelArgs  # noqa: F401  (the family's model: register_family reads them here)

from model_adapters import register_family
from model_adapters.base import NO_SETUP, DecodeSetup, FamilyDefaults
from model_adapters.base import Adapter as BaseAdapter

MODEL_TYPE = "scripted_diffusion"
SCRIPT = ""  # the answer every decode writes (a test sets it)
CERTAIN = 30.0  # the scripted token's logit over every other's 0


class Adapter(BaseAdapter):
    family = "Scripted"
    defaults = FamilyDefaults(block_length=8, strategy="low_confidence")

    def __init__(self, model: Any, tokenizer: Any = None):
        super().__init__(model, tokenizer)
        self.tokenizer = tokenizer

    def start(self, prompt: mx.array, reuse: Any = None, setup: DecodeSetup = NO_SETUP) -> Any:
        return {"prompt_length": prompt.shape[1], "script": self.tokenizer.encode(SCRIPT, add_special_tokens=False)}

    def predict(self, state: Any, canvas: mx.array, start: int, end: int) -> mx.array:
        script, eos = state["script"], min(self.eos_ids)
        logits = np.zeros((canvas.shape[0], end - start, self.vocab_size), np.float32)
        for i, position in enumerate(range(start, end)):
            k = position - state["prompt_length"]
            logits[:, i, script[k] if 0 <= k < len(script) else eos] = CERTAIN
        return mx.array(logits)


register_family(MODEL_TYPE, __name__)
