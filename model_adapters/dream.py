"""Dream 7B: Qwen2 layers (q/k/v biases) with bidirectional attention.

Weights use Qwen2's names, so `sanitize` only drops what mlx-lm drops. Dream is
trained to predict token i at position i - 1: the adapter shifts the logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen2
from mlx_lm.models.base import BaseModelArgs

from .base import Adapter as _BaseAdapter
from .base import FamilyDefaults, LayerStack


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: Optional[int] = None
    max_position_embeddings: int = 131072
    rope_theta: float = 1000000.0
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    tie_word_embeddings: bool = False
    mask_token_id: int = 151666
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads

    def qwen2_args(self) -> qwen2.ModelArgs:
        return qwen2.ModelArgs(
            model_type="qwen2",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            tie_word_embeddings=self.tie_word_embeddings,
        )



class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LayerStack(args.qwen2_args(), qwen2.TransformerBlock)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    def backbone(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        return self.model(inputs, mask, cache)

    def head(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs: mx.array, cache=None, mask=None) -> mx.array:
        """Raw, unshifted logits (B, L, V) with bidirectional attention."""
        return self.head(self.backbone(inputs, mask, cache))

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights


class Adapter(_BaseAdapter):
    """Bidirectional canvas with Dream's shift: position i is read from row i - 1."""

    family = "Dream"
    # Dream's model card: the whole canvas is one block, one token per step,
    # alg="entropy", alg_temp=0.
    defaults = FamilyDefaults(block_length=None, strategy="entropy")

    def predict(self, state: Any, canvas: mx.array, start: int, end: int) -> mx.array:
        if start < 1:
            raise ValueError("Dream needs at least one prompt token before the canvas")
        hidden = self.model.backbone(canvas)
        return self.model.head(hidden[:, start - 1 : end - 1])
