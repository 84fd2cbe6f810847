"""Dream 7B: Qwen2 layers (q/k/v biases) with bidirectional attention.

Weights use Qwen2's names, so `sanitize` only drops what mlx-lm drops. Dream is
trained to predict token i at position i - 1: the adapter shifts the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models import qwen2

from model_adapters.attention.bidirectional_cache import BidirectionalCacheAdapter
from model_adapters.base import DiffusionArgs, DiffusionModel, FamilyDefaults, LayerStack


@dataclass
class ModelArgs(DiffusionArgs):
    text_module = qwen2
    text_defaults = {"max_position_embeddings": 131072, "tie_word_embeddings": False}
    mask_token_id: int = 151666


class Model(DiffusionModel):
    """Raw, unshifted logits with bidirectional attention over mlx-lm's Qwen2 layers."""

    def __init__(self, args: ModelArgs):
        super().__init__(args, LayerStack(args.text, qwen2.TransformerBlock))


class Adapter(BidirectionalCacheAdapter):
    """Bidirectional canvas with Dream's shift: position i is read from row i - 1; with
    `cache`, Fast-dLLM's prefix or dual cache (model_adapters.attention.bidirectional_cache)."""

    family = "Dream"
    # Dream's model card: the whole canvas is one block, one token per step,
    # alg="entropy", alg_temp=0.
    defaults = FamilyDefaults(block_length=None, strategy="entropy")
    shift = 1
