"""LLaDA 1.x / 1.5: Llama layers with bidirectional attention, OLMo-style weight names.

The Hugging Face checkpoints name weights `model.transformer.blocks.N.*`; `sanitize`
renames them onto mlx-lm's Llama layers (idempotent: renamed keys pass through).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlx_lm.models import llama

from model_adapters.attention.bidirectional_cache import BidirectionalCacheAdapter
from model_adapters.base import DiffusionArgs, DiffusionModel, FamilyDefaults, LayerStack


@dataclass
class ModelArgs(DiffusionArgs):
    text_module = llama
    renames = {
        "d_model": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "n_kv_heads": "num_key_value_heads",
        "mlp_hidden_size": "intermediate_size",
        "weight_tying": "tie_word_embeddings",
        "embedding_size": "vocab_size",  # the padded vocabulary the weights have
        "max_sequence_length": "max_position_embeddings",
    }
    text_defaults = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 4096}
    include_bias: bool = False
    include_qkv_bias: bool = False
    mask_token_id: int = 126336

    def __post_init__(self):
        if self.include_bias or self.include_qkv_bias:
            raise ValueError("LLaDA checkpoints with linear biases are not supported")

    @classmethod
    def from_dict(cls, params: dict) -> "ModelArgs":
        # The weights have embedding_size rows, padded past the tokenizer's vocab_size (OLMo's
        # layout, 126464 and 126464 in LLaDA-8B): the model is built from embedding_size, so a
        # vocab_size above it, or a mask id past the vocab_size, is a config that contradicts
        # itself (vocab_size 7 with mask 260 loaded and decoded noise with exit 0).
        vocab, rows, mask = (params.get(k) for k in ("vocab_size", "embedding_size", "mask_token_id"))
        if isinstance(vocab, int) and isinstance(rows, int) and vocab > rows:
            raise ValueError(f"config.json's vocab_size ({vocab}) exceeds its embedding_size ({rows})")
        if isinstance(vocab, int) and isinstance(mask, int) and not 0 <= mask < vocab:
            raise ValueError(f"config.json's mask_token_id ({mask}) lies outside its vocab_size ({vocab})")
        return super().from_dict(params)


class Model(DiffusionModel):
    """LLaDA's training-time (bidirectional) attention over mlx-lm's Llama layers."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, LayerStack(args.text, llama.TransformerBlock))

    def rename(self, key: str) -> str:
        return _rename(key)


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
            return new + key[len(old) :]
    return key


class Adapter(BidirectionalCacheAdapter):
    """Bidirectional canvas, no shift: the LLaDA reference `generate`; with `cache`,
    Fast-dLLM's prefix or dual cache (model_adapters.attention.bidirectional_cache)."""

    family = "LLaDA 1.x/1.5"
    # LLaDA's demo: block 32, one token per step, low-confidence remasking.
    defaults = FamilyDefaults(block_length=32, strategy="low_confidence")
