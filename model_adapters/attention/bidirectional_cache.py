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
`cache.update_and_fetch(keys, values)` for the keys and values to attend to. A later
step's forward writes its window into a kept copy of the whole canvas's keys and values
(no concatenation per layer and step) and is compiled (`window_forward`): tokens are
those of the uncompiled forward (the fused kernels compute the same float32 operations).

In a batch (`predict_batch`: many decodes, mlx_lm_diffusion.decoding.batch), the rows at their
block's first step share full-canvas forwards as rows without a cache do (padded canvases,
model_adapters.runtime.batched.bidirectional_batch), each keeping its own keys and values; the rows
at a later step share one window forward (`cached_window_batch`): their kept keys and
values stacked (right-padded to one width, the padding masked out), each row's window
written over its own positions and rotated from its own offset, so that each row attends
to what it attends to alone, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, ClassVar, Optional

import mlx.core as mx
import numpy as np

from model_adapters.base import NO_SETUP, DecodeSetup
from model_adapters.base import Adapter as _BaseAdapter
from model_adapters.option import Option
from model_adapters.runtime.batched import (
    CaptureCache,
    _compiled,
    answered,
    bidirectional_batch,
    captured_forward,
    stacked_head,
    token_matrix,
)
from model_adapters.runtime.model_cache import model_cache
from model_adapters.runtime.thread_compiled import ThreadTables

CACHE_MODES = ("prefix", "dual")

CACHE_OPTION = Option(
    "cache",
    str,
    "LLaDA / Dream: Fast-dLLM's approximate KV cache: prefix (keep the keys and values before the "
    "block) or dual (keep every position outside the block); default none, exact",
    choices=CACHE_MODES,
)

# Fast-dLLM's defaults: threshold 0.9 with the dual cache, blocks of 32.
FAST_PRESET = {"threshold": 0.9, "cache": "dual", "block_length": 32}


class WindowCache:
    """One layer's cache in a block's later step: the kept keys and values of the whole
    canvas (as the block's first forward computed them) with the window's own written
    over its positions, which start at `offset` (a scalar int32 array: the compiled
    window forward takes it as an input, so blocks at other offsets reuse its trace).
    The layer attends to the kept prefix, the window and the kept suffix in canvas order,
    as after a concatenation, without copying the kept part: MLX's slice update writes
    in place when nothing else holds the buffer (see CacheState.kept)."""

    def __init__(self, offset: mx.array, keys: mx.array, values: mx.array):
        self.offset = offset
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values


class BatchWindowCache:
    """One layer's cache in a batched later step (`cached_window_batch`): the rows' kept
    keys and values, stacked (B, H, K, D), with each row's window written over its own
    positions (`positions`: (B, 1, W, 1), the row's offset onwards); RoPE from `offset` (B,)."""

    def __init__(self, offset: mx.array, positions: mx.array, keys: mx.array, values: mx.array):
        self.offset, self.positions = offset, positions
        self.keys, self.values = keys, values

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys = mx.put_along_axis(self.keys, self.positions, keys, axis=2)
        self.values = mx.put_along_axis(self.values, self.positions, values, axis=2)
        return self.keys, self.values


def batch_window_forward(
    backbone: Callable, tokens: mx.array, offset: mx.array, positions: mx.array, mask: mx.array, *kept: mx.array
) -> mx.array:
    """The backbone over the rows' windows `tokens` (B, W) over their stacked kept keys and
    values (k0, v0, k1, v1, ...: (B, H, K, D) per layer); `mask` (B, 1, 1, K): the keys a
    row has (its canvas's positions). The hidden states (B, W, hidden)."""
    caches = [BatchWindowCache(offset, positions, kept[i], kept[i + 1]) for i in range(0, len(kept), 2)]
    return backbone(tokens, mask, caches)


def window_forward(backbone: Callable, window: mx.array, offset: mx.array, *kept: mx.array) -> tuple:
    """The backbone over `window` (B, W) at positions offset ... over the kept keys and
    values (k0, v0, k1, v1, ...: (B, H, L, D) per layer, the canvas's): the hidden states
    (B, W, hidden) and the kept arrays with the window written in (nothing of them is
    read again but by the step after next, which writes its own window over it)."""
    caches = [WindowCache(offset, kept[i], kept[i + 1]) for i in range(0, len(kept), 2)]
    hidden = backbone(window, None, caches)
    return (hidden, *[a for c in caches for a in (c.keys, c.values)])


@dataclass
class CacheState:
    """Per-decode state: the block whose outside keys and values are kept.

    `kept` holds two copies of the canvas's keys and values (a flat list per copy: k0,
    v0, k1, v1, ...), and the block's later steps write their window into them in turn.
    The engine queues step t + 1 before step t is read back (pipelining), so the buffer
    step t attends to is still read when step t + 1 is queued: writing into it would
    copy it whole (as a concatenation of prefix, window and suffix does). Step t + 1
    writes the buffer step t - 1 read instead, which has been read back by then, so the
    write works in place. (Each copy's first write in a block copies it: both start as
    the block's first forward's keys and values, which that forward's graph still holds.)"""

    mode: str
    start: Optional[int] = None  # the kept block's start; None before the first block
    kept: list = field(default_factory=list)  # [copy 0, copy 1], each [k0, v0, k1, v1, ...]
    turn: int = 0  # the copy the next step writes into
    first_hidden: Optional[mx.array] = None  # Dream: (B, 1, H) the hidden state predicting the block's first position
    # `window_forward` over the adapter's backbone, compiled (MLX fuses the layers' elementwise
    # operations: on the CPU a small model's step costs about what it dispatches); traced once
    # per window shape, with the weights the decode started with; kept per thread and released
    # on the thread that traced it (runtime.thread_compiled): `forward()`
    compiled: ThreadTables = field(default_factory=ThreadTables)

    def forward(self, backbone: Callable) -> Callable:
        table = self.compiled.table()
        if "window" not in table:
            table["window"] = mx.compile(partial(window_forward, backbone))
        return table["window"]


class BidirectionalCacheAdapter(_BaseAdapter):
    """A full-canvas bidirectional family with Fast-dLLM's optional caches (`cache`).
    Subclasses set `family`, `defaults` and `shift` (1: position i is predicted at i - 1)."""

    shift: ClassVar[int] = 0
    options = (CACHE_OPTION,)
    presets = {"fast": FAST_PRESET}

    def start(self, prompt: mx.array, reuse: Any = None, setup: DecodeSetup = NO_SETUP) -> Optional[CacheState]:
        """The decode's cache (its `cache` option), or None: no cache."""
        mode = self.family_option(setup, "cache")
        return CacheState(mode) if mode else None

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
        if len(requests) == 1:
            return super().predict_batch(requests)
        if any(r.start < self.shift for r in requests):
            raise ValueError(f"{self.family} needs at least one prompt token before the canvas")
        # each row decodes with its own cache mode: rows without a cache (the whole canvas),
        # rows at their block's first step (the whole canvas, keeping its keys and values) and
        # rows at a later step (the window over them, prefix and dual alike): a call each kind
        kinds = [0 if r.state is None else 1 if r.state.start != r.start else 2 for r in requests]
        groups = [[i for i, kind in enumerate(kinds) if kind == k] for k in range(3)]
        return answered(requests, groups, self._answer_kind)

    def _answer_kind(self, requests: list) -> list:
        """Rows all without a cache, all at their block's first step, or all at a later
        step of it: one call (a lone row: its own `predict`, whose later steps write its
        window in place)."""
        if len(requests) == 1:
            return super().predict_batch(requests)
        if requests[0].state is None:
            return bidirectional_batch(self, requests, self.shift)
        if requests[0].state.start != requests[0].start:
            return self._open_blocks(requests)
        return cached_window_batch(self, requests)

    def _open_blocks(self, requests: list) -> list:
        """Several rows' block-first steps: full-canvas forwards batched as without a cache
        (bidirectional_batch), each row keeping its own keys and values as `_open_block` does."""
        return bidirectional_batch(
            self, requests, self.shift, keep=lambda r, hidden, kept: self._keep(r.state, r.start, hidden, kept)
        )

    def _open_block(self, state: CacheState, canvas: mx.array, start: int, end: int) -> mx.array:
        """The block's first step: the whole canvas, keeping every layer's keys and values
        (the block's own positions are overwritten by each later step's window; under
        prefix, the window runs to the canvas's end, so only those before it are read)."""
        hidden, *kept = captured_forward(self.model.backbone, len(self.model.layers), canvas)
        # prefix: the window is the block and everything after it, dual: the block only;
        # either way the kept canvas outside the window is what its steps attend to
        self._keep(state, start, hidden, kept)
        return hidden[:, start - self.shift : end - self.shift]

    def _keep(self, state: CacheState, start: int, hidden: mx.array, kept: list) -> None:
        """A block's first forward over the canvas (hidden (1, T, H), each layer's keys and
        values `kept`) starts the block at `start` in `state`."""
        state.kept, state.turn = [kept, list(kept)], 0
        state.start = start
        state.first_hidden = hidden[:, start - 1 : start] if self.shift else None

    def _cached_step(self, state: CacheState, canvas: mx.array, start: int, end: int) -> mx.array:
        """A later step: the window (block, plus everything after it for prefix) over the
        kept keys and values."""
        stop = end if state.mode == "dual" else canvas.shape[1]
        kept, state.kept[state.turn] = state.kept[state.turn], None  # (the write must hold its only reference)
        forward = state.forward(self.model.backbone)
        hidden, *written = forward(canvas[:, start:stop], mx.array(start, mx.int32), *kept)
        del kept
        state.kept[state.turn], state.turn = written, 1 - state.turn
        if not self.shift:
            return hidden[:, : end - start]
        # positions start + 1 ... end - 1 from the window, `start` from the block's first forward
        return mx.concatenate([state.first_hidden.astype(hidden.dtype), hidden[:, : end - start - 1]], axis=1)


def cached_window_batch(adapter: BidirectionalCacheAdapter, requests: list) -> list:
    """The logits each row's `_cached_step` gives, from one forward: every row's window
    (dual: its block; prefix: its block to its canvas's end) right-padded to one width W,
    over its kept keys and values stacked to one width K (`stacked_kept`). A row's window
    is written over its own positions, so it attends to its keys in canvas order, as
    alone; its padding columns are written past its canvas's end, where its keys are
    masked out (a dual row's padding written after its block would overwrite the kept
    keys it attends to there), and their queries are not read."""
    lengths = np.array([r.canvas.shape[1] for r in requests])
    starts = np.array([r.start for r in requests])
    stops = np.array([r.end if r.state.mode == "dual" else r.canvas.shape[1] for r in requests])
    windows = stops - starts
    width = int(windows.max())
    keys_width = int((lengths + width - windows).max())  # (every row's padding past its canvas)
    tokens = token_matrix([(r, r.start, int(stop), 0, width - int(stop) + r.start) for r, stop in zip(requests, stops)])
    column = np.arange(width)[None, :]
    written = np.where(column < windows[:, None], starts[:, None] + column, (lengths - windows)[:, None] + column)
    positions = mx.array(written.astype(np.int32))[:, None, :, None]
    mask = mx.array(np.arange(keys_width)[None, :] < lengths[:, None])[:, None, None, :]
    kept = stacked_kept(adapter, [r.state for r in requests], keys_width)
    forward = _compiled(
        adapter,
        ("fast-dllm window",),
        lambda: partial(batch_window_forward, adapter.model.backbone),
        tokens,
        positions,
        mask,
        *kept,
    )
    hidden = forward(tokens, mx.array(starts.astype(np.int32)), positions, mask, *kept)
    if adapter.shift:  # position `start` from the block's first forward, start + i from window row i - 1
        first = mx.concatenate([r.state.first_hidden for r in requests], axis=0).astype(hidden.dtype)
        hidden = mx.concatenate([first, hidden[:, :-1]], axis=1)
    return stacked_head(adapter, hidden, [(0, r.end - r.start) for r in requests])


def stacked_kept(adapter: Any, states: list, width: int) -> list:
    """The rows' kept keys and values, per layer (B, H, width, D), right-padded with zeros.
    Reused from the previous call while the same rows are in the same blocks: what a row's
    windows attend to outside its block is what its block's first forward kept (its own
    later steps write only inside the block, which every window step writes over), and
    stacking costs a pad and a concatenation per row and layer."""
    blocks = [(state, state.start) for state in states]
    cache = model_cache(adapter.model)
    memo = cache.get("stacked kept")
    # (the memo holds the states, so `is` compares live objects, never reused ids; not
    # their kept arrays, whose in-place window writes a second holder would turn into copies)
    if (
        memo is not None
        and memo[0] == width
        and len(memo[1]) == len(blocks)
        and all(a is b and start == begun for (a, start), (b, begun) in zip(memo[1], blocks))
    ):
        return memo[2]

    def padded(a: mx.array) -> mx.array:
        missing = width - a.shape[2]
        return a if not missing else mx.pad(a, [(0, 0), (0, 0), (0, missing), (0, 0)])

    rows = [state.kept[state.turn] for state in states]
    stacked = [mx.concatenate([padded(row[j]) for row in rows], axis=0) for j in range(len(rows[0]))]
    cache["stacked kept"] = (width, blocks, stacked)
    return stacked


__all__ = [
    "BatchWindowCache",
    "batch_window_forward",
    "cached_window_batch",
    "stacked_kept",
    "BidirectionalCacheAdapter",
    "CACHE_MODES",
    "CACHE_OPTION",
    "CaptureCache",
    "WindowCache",
    "window_forward",
    "FAST_PRESET",
]
