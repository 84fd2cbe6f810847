"""LLaDA 1.x / 1.5: Llama layers with bidirectional attention, OLMo-style weight names.

The Hugging Face checkpoints name weights `model.transformer.blocks.N.*`; `sanitize`
renames them onto mlx-lm's Llama layers (idempotent: renamed keys pass through).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import BaseModelArgs

from .base import Adapter as _BaseAdapter
from .base import FamilyDefaults, LayerStack


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    d_model: int
    n_layers: int
    n_heads: int
    mlp_hidden_size: int
    vocab_size: int
    n_kv_heads: Optional[int] = None
    embedding_size: Optional[int] = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    weight_tying: bool = False
    include_bias: bool = False
    include_qkv_bias: bool = False
    mask_token_id: int = 126336
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        if self.include_bias or self.include_qkv_bias:
            raise ValueError("LLaDA checkpoints with linear biases are not supported")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads

    def llama_args(self) -> llama.ModelArgs:
        return llama.ModelArgs(
            model_type="llama",
            hidden_size=self.d_model,
            num_hidden_layers=self.n_layers,
            intermediate_size=self.mlp_hidden_size,
            num_attention_heads=self.n_heads,
            num_key_value_heads=self.n_kv_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.embedding_size or self.vocab_size,
            rope_theta=self.rope_theta,
            tie_word_embeddings=self.weight_tying,
        )



class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = LayerStack(args.llama_args(), llama.TransformerBlock)
        if not args.weight_tying:
            self.lm_head = nn.Linear(args.d_model, args.embedding_size or args.vocab_size, bias=False)

    @property
    def vocab_size(self) -> int:
        return self.args.embedding_size or self.args.vocab_size

    @property
    def max_length(self) -> int:
        return self.args.max_sequence_length

    def backbone(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        return self.model(inputs, mask, cache)

    def head(self, hidden: mx.array) -> mx.array:
        if self.args.weight_tying:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def __call__(self, inputs: mx.array, cache=None, mask=None) -> mx.array:
        """Raw logits (B, L, V) with LLaDA's training-time (bidirectional) attention."""
        return self.head(self.backbone(inputs, mask, cache))

    @property
    def layers(self):
        return self.model.layers

    def sanitize(self, weights: dict) -> dict:
        renamed = {_rename(k): v for k, v in weights.items()}
        if self.args.weight_tying:
            renamed.pop("lm_head.weight", None)
        return {k: v for k, v in renamed.items() if "rotary_emb.inv_freq" not in k}


# OLMo-style names of the Hugging Face checkpoint -> mlx-lm Llama names.
_BLOCK_RENAMES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ff_norm": "post_attention_layernorm",
}
_BLOCK = re.compile(r"^model\.transformer\.blocks\.(\d+)\.(\w+)\.(weight|scales|biases)$")
_TOP_RENAMES = {
    "model.transformer.wte.": "model.embed_tokens.",
    "model.transformer.ln_f.": "model.norm.",
    "model.transformer.ff_out.": "lm_head.",
}


def _rename(key: str) -> str:
    m = _BLOCK.match(key)
    if m and m.group(2) in _BLOCK_RENAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_RENAMES[m.group(2)]}.{m.group(3)}"
    for old, new in _TOP_RENAMES.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


class Adapter(_BaseAdapter):
    """Bidirectional canvas, no shift, no cache: the LLaDA reference `generate`."""

    family = "LLaDA 1.x/1.5"
    # LLaDA's demo: block 32, one token per step, low-confidence remasking.
    defaults = FamilyDefaults(block_length=32, strategy="low_confidence")
