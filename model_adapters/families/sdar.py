"""SDAR / TraDo: Qwen3 layers (q/k RMSNorm) with block-causal attention.

The checkpoints use Qwen3's weight names, so `sanitize` only drops what mlx-lm
drops. Attention is block-causal with the config's `block_size` (4 in the released
checkpoints) on absolute positions; there is no logit shift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models import qwen3

from model_adapters.attention.block_cache import BlockCausalAdapter, BlockCausalModel
from model_adapters.base import DiffusionArgs, FamilyDefaults, LayerStack


@dataclass
class ModelArgs(DiffusionArgs):
    text_module = qwen3
    text_defaults = {"max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": False}
    attention_bias: bool = False
    block_size: int = 4

    def __post_init__(self):
        if self.attention_bias:
            raise ValueError("SDAR checkpoints with attention biases are not supported")


class Model(BlockCausalModel):
    """SDAR's training-time block-causal attention over mlx-lm's Qwen3 layers."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, LayerStack(args.text, qwen3.TransformerBlock))


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
        self.defaults = FamilyDefaults(block_length=model.block_size, strategy="low_confidence_dynamic", threshold=0.9)
