"""Fast-dLLM's approximate key/value caches for the bidirectional families (LLaDA 1.x/1.5, Dream).

A bidirectional model recomputes the whole canvas at every step. Fast-dLLM
(NVlabs/Fast-dLLM, `llada/generate.py`: generate_with_prefix_cache and
generate_with_dual_cache; `dream/model/generation_utils_block.py` with dual_cache off/on)
keeps the keys and values computed outside the current block instead:

- every block's first step is one forward over the whole canvas; its logits drive that
  step's commits (a regular step of the chosen commit rule) and each layer's keys and
  values are kept: `cache="prefix"` keeps the positions before the block, `cache="dual"`
  every position outside it (before and after);
- every later step of the block runs `canvas[start:]` (prefix) or only
  `canvas[start:end]` (dual) over the kept keys and values, with absolute RoPE positions
  (the window's queries and keys are rotated from offset `start`), and keeps nothing new.

It is approximate: the kept keys and values were computed when the block was all masks
(and, for dual, the suffix too), and are not refreshed until the next block starts.
Every step is one model forward (the engine counts `predict` calls), the block's first
full forward included, as Fast-dLLM's `nfe`; a block that fills at its first step
spends no further forward (Fast-dLLM's older snapshot runs one more). `cache=None`
decodes exactly as without this module. The block's first step is recognised by
`start` changing (the state remembers the block whose keys and values it holds).

Dream's logit shift (position i is predicted from the hidden state at i - 1): the
block's first position needs the hidden state at `start - 1`, which is outside the
block. As in Fast-dLLM's Dream loop, it comes from the block's first full forward
(row `start - 1`, which Fast-dLLM uses to commit the block's first token) and is not
recomputed: that hidden state (kept, and put through the head only at the steps that
read the position) feeds the block's first position at every step of the block.
Every other position i of the block reads the cached window's row i - 1 (Fast-dLLM's
`cat([logits[:, :1], logits[:, :-1]])` over the window, whose first row it never reads).
Deviation from Fast-dLLM's Dream loop: there the first full forward commits exactly the
block's first token, whatever the algorithm; here the first step is a regular step of
the chosen commit rule, as in Fast-dLLM's LLaDA loops, so every rule and schedule works
unchanged (the block's first token is committed when the rule picks it).

The caches are mlx-lm cache objects handed to the layers: mlx-lm's llama and qwen2
attention rotate the queries and keys by `cache.offset` and then call
`cache.update_and_fetch(keys, values)` for the keys and values to attend to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import mlx.core as mx

from .base import Adapter as _BaseAdapter
from .batched import bidirectional_batch
from .option import Option

CACHE_MODES = ("prefix", "dual")

CACHE_OPTION = Option(
    "cache", str,
    "LLaDA / Dream: Fast-dLLM's approximate KV cache: prefix (keep the keys and values before the "
    "block) or dual (keep every position outside the block); default none, exact",
    choices=CACHE_MODES,
)

# Fast-dLLM's defaults: threshold 0.9 with the dual cache, blocks of 32.
FAST_PRESET = {"threshold": 0.9, "cache": "dual", "block_length": 32}


class CaptureCache:
    """One layer's cache for a block's first forward: positions from 0; keeps the keys
    and values it is given (rotated, as the layer computed them)."""

    offset = 0

    def __init__(self):
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values
        return keys, values


class FrozenCache:
    """One layer's kept keys and values for a block's later steps: the window's positions
    start at `offset`; the window's own keys and values are placed between the kept
    prefix and suffix for attention and never stored."""

    def __init__(self, offset: int, prefix: Optional[tuple], suffix: Optional[tuple]):
        self.offset = offset
        self.prefix, self.suffix = prefix, suffix

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        parts = [p for p in (self.prefix, (keys, values), self.suffix) if p is not None]
        if len(parts) == 1:
            return keys, values
        return (mx.concatenate([k for k, _ in parts], axis=2),
                mx.concatenate([v for _, v in parts], axis=2))


@dataclass
class CacheState:
    """Per-decode state: the block whose outside keys and values are kept."""

    mode: str
    start: Optional[int] = None  # the kept block's start; None before the first block
    layers: list = field(default_factory=list)  # a FrozenCache per layer
    first_hidden: Optional[mx.array] = None  # Dream: (B, 1, H) the hidden state predicting the block's first position


class BidirectionalCacheAdapter(_BaseAdapter):
    """A full-canvas bidirectional family with Fast-dLLM's optional caches (`cache`).
    Subclasses set `family`, `defaults` and `shift` (1: position i is predicted at i - 1)."""

    shift: ClassVar[int] = 0
    options = (CACHE_OPTION,)
    presets = {"fast": FAST_PRESET}

    def __init__(self, model: Any, tokenizer: Any = None):
        super().__init__(model, tokenizer)
        self.cache_mode: Optional[str] = None

    def configure(self, options: Any) -> None:
        self.cache_mode = options.family.get("cache")

    def start(self, prompt: mx.array) -> Optional[CacheState]:
        return CacheState(self.cache_mode) if self.cache_mode else None

    def predict(self, state: Optional[CacheState], canvas: mx.array, start: int, end: int) -> mx.array:
        return self.model.head(self.block_hidden(state, canvas, start, end))

    def block_hidden(self, state: Optional[CacheState], canvas: mx.array, start: int, end: int) -> mx.array:
        """The hidden states whose head predicts positions [start, end) (Dream: rows shifted by one)."""
        if start < self.shift:
            raise ValueError(f"{self.family} needs at least one prompt token before the canvas")
        if state is None:  # no cache: the whole canvas at every step
            hidden = self.model.backbone(canvas)
            return hidden[:, start - self.shift : end - self.shift]
        if state.start != start:
            return self._open_block(state, canvas, start, end)
        return self._cached_step(state, canvas, start, end)

    def predict_batch(self, requests: list) -> list:
        if self.cache_mode is not None or len(requests) == 1:
            # (Fast-dLLM's kept keys and values differ per row and block: one call per row)
            return super().predict_batch(requests)
        if any(r.start < self.shift for r in requests):
            raise ValueError(f"{self.family} needs at least one prompt token before the canvas")
        return bidirectional_batch(self, requests, self.shift)

    def _open_block(self, state: CacheState, canvas: mx.array, start: int, end: int) -> mx.array:
        """The block's first step: the whole canvas, keeping the keys and values outside
        the block (prefix: before it only)."""
        captured = [CaptureCache() for _ in self.model.layers]
        hidden = self.model.backbone(canvas, None, captured)[:, start - self.shift : end - self.shift]
        dual = state.mode == "dual" and end < canvas.shape[1]
        state.layers = [
            FrozenCache(
                start,
                (c.keys[:, :, :start], c.values[:, :, :start]),
                (c.keys[:, :, end:], c.values[:, :, end:]) if dual else None,
            )
            for c in captured
        ]
        state.start = start
        state.first_hidden = hidden[:, :1] if self.shift else None
        return hidden

    def _cached_step(self, state: CacheState, canvas: mx.array, start: int, end: int) -> mx.array:
        """A later step: the window (block, plus everything after it for prefix) over the
        kept keys and values."""
        stop = end if state.mode == "dual" else canvas.shape[1]
        hidden = self.model.backbone(canvas[:, start:stop], None, state.layers)
        if not self.shift:
            return hidden[:, : end - start]
        # positions start + 1 ... end - 1 from the window, `start` from the block's first forward
        return mx.concatenate([state.first_hidden.astype(hidden.dtype), hidden[:, : end - start - 1]], axis=1)


__all__ = ["BidirectionalCacheAdapter", "CACHE_MODES", "CACHE_OPTION", "CaptureCache", "FrozenCache", "FAST_PRESET"]
