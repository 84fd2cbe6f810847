"""SDAR / TraDo: Qwen3 layers (q/k RMSNorm) with block-causal attention.

The checkpoints use Qwen3's weight names, so `sanitize` only drops what mlx-lm
drops. Attention is block-causal with the config's `block_size` (4 in the released
checkpoints) on absolute positions; there is no logit shift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3
from mlx_lm.models.base import BaseModelArgs

from .base import FamilyDefaults, LayerStack
from .block_cache import BlockCausalAdapter, window_mask


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
    head_dim: Optional[int] = None
    max_position_embeddings: int = 32768
    rope_theta: float = 1000000.0
    rope_scaling: Optional[Dict[str, Union[float, str]]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    block_size: int = 4
    mask_token_id: Optional[int] = None  # else the tokenizer's mask token
    eos_token_id: Optional[Union[int, list]] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        if self.attention_bias:
            raise ValueError("SDAR checkpoints with attention biases are not supported")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads

    def qwen3_args(self) -> qwen3.ModelArgs:
        return qwen3.ModelArgs(
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            head_dim=self.head_dim,
            tie_word_embeddings=self.tie_word_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
        )



class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LayerStack(args.qwen3_args(), qwen3.TransformerBlock)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_position_embeddings

    @property
    def block_size(self) -> int:
        return self.args.block_size

    def backbone(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        return self.model(inputs, mask, cache)

    def head(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs: mx.array, cache=None, mask=None) -> mx.array:
        """Raw logits (B, L, V) with SDAR's training-time block-causal attention
        (positions continue from the cache's offset when a cache is given)."""
        if mask is None:
            offset = cache[0].offset if cache else 0
            mask = window_mask(offset, offset + inputs.shape[1], self.args.block_size)
        return self.head(self.backbone(inputs, mask, cache))

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights: dict) -> dict:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights


class Adapter(BlockCausalAdapter):
    """SDAR's `block_diffusion_generate`: blocks of the config's block_size from
    position 0, the prompt's full blocks cached once, the prompt's tail decoded
    together with the first block's masks."""

    family = "SDAR/TraDo"
    # The reference script: block_length = denoising_steps = 4 (the model's block
    # size), low_confidence_dynamic; the task's threshold default 0.9.
    defaults = FamilyDefaults(block_length=4, strategy="low_confidence_dynamic", threshold=0.9)

    def __init__(self, model: Any, tokenizer: Any = None, use_cache: bool = True):
        super().__init__(model, tokenizer, use_cache)
        self.attention_block = model.block_size
        self.defaults = FamilyDefaults(
            block_length=model.block_size, strategy="low_confidence_dynamic", threshold=0.9
        )
