"""The adapter contract between a model family and the decoding engine.

An adapter wires one family's specifics (mask token, attention layout, logit
shift, cache, reference defaults) behind four calls. The engine never sees
any of that; an adapter never sees commit rules, schedules or streaming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class FamilyDefaults:
    """A family's reference decoding settings (what its own demo code uses)."""

    block_length: Optional[int]  # None: the whole generation is one block
    strategy: str
    steps: Optional[int] = None  # None: one denoising step per block position
    threshold: Optional[float] = None
    editing_threshold: Optional[float] = None  # None: committed tokens never change
    max_post_steps: int = 16  # editing passes allowed once a block has no masks
    entropy_bound: Optional[float] = None  # None: the entropy rules' own default


class LayerStack(nn.Module):
    """Embeddings, an mlx-lm block class repeated, the final norm: the backbone of the
    families built from mlx-lm's plain layers (llama, qwen2, qwen3). Unlike mlx-lm's own
    model classes it builds no causal mask: the caller owns the attention layout."""

    def __init__(self, args: Any, block: type):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [block(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        cache = cache or [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.norm(h)


class Adapter:
    """Base adapter for a masked-diffusion family with full-canvas attention.

    Subclasses set `family`, `defaults` and, when needed, override `predict`
    (logit shift, caches) and `finish_block`.
    """

    family: ClassVar[str] = ""
    defaults: ClassVar[FamilyDefaults]
    align_blocks: ClassVar[bool] = False  # blocks on absolute multiples of block_length
    presets: ClassVar[dict] = {}  # named option sets (LLaDA2.1's "speed" / "quality")
    # The decoding paradigm (mlx_lm_diffusion.decoders): "masked_block" or "uniform_canvas".
    decoder: ClassVar[str] = "masked_block"
    # The family's own decoding options (model_adapters.option.Option), with their
    # defaults; the resolved values reach `configure` and the decoder as `options.family`.
    options: ClassVar[tuple] = ()

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        self.model = model
        args = model.args
        self.mask_id: Optional[int] = args.mask_token_id
        self.vocab_size: int = model.vocab_size
        self.max_length: Optional[int] = model.max_length
        self.eos_ids: frozenset[int] = frozenset(_stop_ids(args, tokenizer))

    @property
    def block_length(self) -> Optional[int]:
        return self.defaults.block_length

    @property
    def suppress_ids(self) -> frozenset:
        """Token ids never proposed: the mask token."""
        return frozenset() if self.mask_id is None else frozenset({self.mask_id})

    def check_options(self, family: dict, values: dict) -> None:
        """Refuse a combination of this family's options (`family`, defaults filled in)
        and the options set (`values`) that it cannot decode (ValueError)."""

    def configure(self, options: Any) -> None:
        """Read the family's own switches from the resolved options (`options.family`)."""

    def start(self, prompt: mx.array) -> Any:
        """Prepare a decode of `prompt` (B, P); returns the adapter's state."""
        return None

    def block_seed(self, state: Any, canvas: mx.array, start: int) -> Optional[mx.array]:
        """Logits (B, V) proposing the token at `start` from an earlier causal pass, or
        None when the block starts all masked."""
        return None

    def condition(self, state: Any, scaled_logits: mx.array) -> None:
        """Uniform-noise canvases: keep this step's scaled logits as the next step's
        self-conditioning input."""

    def predict(self, state: Any, canvas: mx.array, start: int, end: int) -> mx.array:
        """Logits (B, end - start, V): row i predicts the token at position start + i."""
        hidden = self.model.backbone(canvas)
        return self.model.head(hidden[:, start:end])

    def finish_block(self, state: Any, canvas: mx.array, start: int, end: int) -> None:
        """Called once positions [start, end) are final (a cache may store them)."""


def _stop_ids(args: Any, tokenizer: Any) -> set[int]:
    """EOS ids from the config and the tokenizer; a pad id distinct from EOS stops too."""
    ids: set[int] = set()
    for name in ("eos_token_id", "pad_token_id"):
        value = getattr(args, name, None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer is not None:
        ids.update(getattr(tokenizer, "eos_token_ids", ()) or ())
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None:
            ids.add(int(eos))
    mask_id = getattr(args, "mask_token_id", None)
    ids.discard(mask_id)
    return ids
