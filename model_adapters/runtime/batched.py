"""Batched forwards: the forward requests of many single-row decodes answered by one model call.

Each row of a running batch (mlx_lm_diffusion.decoding.batch) is its own decode: its own canvas,
prompt length, blocks and cache. Only the model forward is shared. These functions take
the rows' `Forward` requests (state, canvas (1, T_i), start_i, end_i) and return, per row,
the logits its own `Adapter.predict` would return:

- `bidirectional_batch` (LLaDA, Dream without a cache): the canvases right-padded to
  one width, padding keys masked out; positions start at 0 in every row, so RoPE needs
  no offsets. Canvases of very different widths go to separate calls (`width_groups`):
  every row of a call costs the widest row's full-canvas forward.
- `causal_prefix_batch` (Nemotron-Labs Diffusion): each row's block, bidirectional over
  its own causal KV cache (left-padded, masked), RoPE from each row's offset.
- `causal_feed_batch` (the ar adapter): each row's new tokens fed through an mlx-lm causal
  LM over its own KV cache (its cached prefix left-padded, its new tokens right-padded);
  `causal_verify_batch` (Nemotron's self-speculation) feeds each row's drafted window the
  same way.
- `block_causal_batch` (SDAR, LLaDA2 with or without the prefix cache): each row's
  window (cached prefix to the end of its attention block) left-padded to one width,
  RoPE rotated from each row's own offset (mlx-lm's attention takes `cache.offset` as a
  per-row array, as mlx-lm's BatchKVCache does), keys = each row's cached prefix (read
  from the batch's StackedPrefix, kept across steps: model_adapters.runtime.stacked_prefix)
  then the window, masked block-causally on each row's absolute positions. The rows'
  own KVCaches are then updated as `predict` would leave them.

Widths are rounded up (canvases on a GPU and cached prefixes to a multiple of `BUCKET`,
windows to one of the attention block), so that the shapes MLX builds kernels for stay
few while rows join and leave.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from model_adapters.runtime.stacked_prefix import stacked_prefix_of
from model_adapters.runtime.thread_compiled import ThreadTables

BUCKET = 16  # padded widths are multiples of this
# Canvases batched into one call differ in width by at most this factor. A GPU builds its
# kernels per shape, so fewer calls of bucketed widths pay; on a CPU every padded column
# costs its full attention row and its layers, and a second call costs only its dispatch:
# 8 and 16 LLaDA rows of bench_server's prompts (44-72 tokens, 24-32 new) stepped 7-10%
# faster at 1.2 than at 1.5 (1.1 the same, 1.05 slower; bench/profile_batch_step.py).
WIDTH_SPREAD = 1.5
CPU_WIDTH_SPREAD = 1.2


def bucketed(width: int) -> int:
    return -(-width // BUCKET) * BUCKET


def width_groups(widths: Sequence[int], spread: Optional[float] = None) -> list:
    """Indices of `widths` in groups whose widest is at most `spread` times the narrowest
    (by default the device's: WIDTH_SPREAD, CPU_WIDTH_SPREAD on a CPU): a short canvas
    padded to a long one would cost the long one's forward."""
    if spread is None:
        spread = WIDTH_SPREAD if mx.default_device() == mx.gpu else CPU_WIDTH_SPREAD
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    groups: list = []
    for i in order:
        if groups and widths[i] <= spread * widths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def bidirectional_batch(
    adapter: Any, requests: Sequence[Any], shift: int, keep: Optional[Callable[[Any, mx.array, list], None]] = None
) -> list:
    """Full-canvas bidirectional forwards: one model call per group of similar widths.
    `keep(request, hidden, kept)`: with it, every layer's keys and values are captured too
    (Fast-dLLM's block-first forward keeps them), and each row's are handed to it: the row's
    hidden states (1, T_i, H) and its keys and values (k0, v0, k1, v1, ...: (1, H, T_i, D))."""
    groups = width_groups([r.canvas.shape[1] for r in requests])
    return answered(requests, groups, lambda rows: _bidirectional_call(adapter, rows, shift, keep))


def answered(requests: Sequence[Any], groups: Sequence[Sequence[int]], answer: Callable[[list], list]) -> list:
    """The replies to `requests`, in their order, from one `answer(rows)` call per group of
    request indices (each call returns its rows' replies in order). One group of every
    request: its reply as it is (a RowLogits: one stacked head for the fused commit)."""
    groups = [g for g in groups if g]
    if len(groups) == 1 and len(groups[0]) == len(requests):
        return answer(list(requests))
    out: list = [None] * len(requests)
    for group in groups:
        for i, reply in zip(group, answer([requests[i] for i in group])):
            out[i] = reply
    return out


def by_width(requests: Sequence[Any], also: Optional[Callable[[Any], Any]] = None) -> list:
    """Indices of the requests grouped by the width of their blocks (end - start), and by
    `also(request)` where given (what else one call needs equal)."""
    groups: dict = {}
    for i, r in enumerate(requests):
        groups.setdefault((r.end - r.start, also(r) if also is not None else None), []).append(i)
    return list(groups.values())


def _bidirectional_call(adapter: Any, requests: Sequence[Any], shift: int, keep: Optional[Callable]) -> list:
    lengths = [r.canvas.shape[1] for r in requests]
    width = max(lengths)
    if len(set(lengths)) > 1 and mx.default_device() == mx.gpu:
        # (a GPU builds kernels per shape: few widths pay. On a CPU nothing is built per shape,
        # and every padded column costs the full canvas's attention row: pad to the widest only)
        width = bucketed(width)
    tokens = token_matrix([(r, 0, length, 0, width - length) for r, length in zip(requests, lengths)])
    mask = None
    if min(lengths) < width:  # (B, 1, 1, K): each row attends to its own tokens only
        valid = np.arange(width)[None, :] < np.array(lengths)[:, None]
        mask = mx.array(valid)[:, None, None, :]
    if keep is None:
        hidden = canvas_backbone(adapter, tokens, mask)
    else:
        hidden, *kept = canvas_backbone(adapter, tokens, mask, capture=True)
        for row, (r, length) in enumerate(zip(requests, lengths)):
            keep(r, hidden[row : row + 1, :length], [a[row : row + 1, :, :length] for a in kept])
    return stacked_head(adapter, hidden, [(r.start - shift, r.end - r.start) for r in requests])


class CaptureCache:
    """One layer's cache that keeps the keys and values it is given (rotated, as the layer
    computed them), positions from 0: a forward that attends to its own tokens only and
    hands its keys and values on (Fast-dLLM's block-first forward)."""

    offset = 0

    def __init__(self):
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values
        return keys, values


def captured_forward(backbone: Callable, layers: int, tokens: mx.array, mask: Optional[mx.array] = None) -> tuple:
    """The backbone over `tokens` (B, T), keeping each layer's keys and values: (hidden,
    k0, v0, k1, v1, ...)."""
    caches = [CaptureCache() for _ in range(layers)]
    hidden = backbone(tokens, mask, caches)
    return (hidden, *[a for c in caches for a in (c.keys, c.values)])


def canvas_backbone(adapter: Any, tokens: mx.array, mask: Optional[mx.array], capture: bool = False):
    """The backbone over batched full canvases (no cache), through mx.compile as
    `window_backbone` (COMPILE_WINDOWS). `capture`: `captured_forward`'s tuple instead of
    the hidden states."""
    model = adapter.model
    if capture:
        call = partial(captured_forward, model.backbone, len(model.layers))
    else:
        call = lambda t, m=None: model.backbone(t, m)  # noqa: E731
    inputs = (tokens,) if mask is None else (tokens, mask)
    if not COMPILE_WINDOWS:
        return call(*inputs)
    return _compiled(adapter, ("canvas", mask is not None, capture), lambda: call, *inputs)(*inputs)


MAX_TRACES = 64  # distinct input shapes one compiled backbone call keeps before it is made afresh


def _compiled(adapter: Any, kind: tuple, make: Callable[[], Callable], *inputs: mx.array) -> Callable:
    """The adapter's compiled backbone call `kind` (mx.compile(make()), made on first use)
    for these inputs. Kept with the adapter, not with the model (runtime.model_cache):
    mx.compile keeps the weights the traced call captures as constants, so a trace kept
    past a change of the model's weights in place (a training step, a fuse) would decode
    with the old ones; adapters are made per request, or for a server's lifetime. MLX keeps one trace per distinct input shape with a compiled function
    and frees them with it. A server's rows come in many widths and counts (a LLaDA
    canvas is padded to its widest row only), so once MAX_TRACES shapes are held a new
    one makes the function afresh: memory stays bounded in a long-running server."""
    tables = getattr(adapter, "_compiled_backbones", None)
    if tables is None:  # (per thread: thread_compiled)
        tables = adapter._compiled_backbones = ThreadTables()
    return bounded_compile(tables.table(), kind, make, tuple(tuple(a.shape) for a in inputs), MAX_TRACES)


def bounded_compile(table: dict, key: Any, make: Callable[[], Callable], shapes: Any, max_traces: int) -> Callable:
    """`table[key]`'s mx.compile(make()) for inputs of `shapes`, made on first use and made
    afresh (its traces freed with the old function) once it holds `max_traces` other shapes.
    `table` maps key -> (compiled function, the shapes it has traced)."""
    entry = table.get(key)
    if entry is None or (shapes not in entry[1] and len(entry[1]) >= max_traces):
        entry = table[key] = (mx.compile(make()), set())
    entry[1].add(shapes)
    return entry[0]


class RowLogits(list):
    """Per-row logits (1, W_i, V) that are slices of one stacked array (`source`, (B, W, V),
    row i's at source[i, :W_i]): a fused commit (mlx_lm_diffusion.decoding.decoders.fused_commit) reads the
    stacked array instead of stacking the slices again."""

    source: Optional[mx.array] = None


def stacked_head(adapter: Any, hidden: mx.array, reads: Sequence[tuple]) -> RowLogits:
    """The LM head at each row's read positions (column, width) of `hidden` (B, T, H), in
    one call: the columns are gathered first (padded to the widest read by repeating the
    row's last column), so the head's cost does not grow with the number of rows."""
    width = max(w for _, w in reads)
    columns = np.array([[c + min(j, w - 1) for j in range(width)] for c, w in reads], dtype=np.int32)
    if (columns == columns[0]).all() and (np.diff(columns[0]) == 1).all():
        gathered = hidden[:, int(columns[0, 0]) : int(columns[0, 0]) + width]
    else:
        gathered = mx.take_along_axis(hidden, mx.array(columns)[..., None], axis=1)
    source = adapter.model.head(gathered)
    out = RowLogits(source[i : i + 1, :w] for i, (_, w) in enumerate(reads))
    out.source = source
    return out


def token_matrix(spans: Sequence[tuple]) -> mx.array:
    """(B, width) int32: per row (request, lo, hi, left, right), its canvas's tokens
    [lo, hi) with `left` zeros before and `right` after. Built on the host from the rows'
    host copies where the requests carry a current one (`host`, fused_commit.FusedForward),
    so that the device gets one array instead of a slice, a pad and a concatenation per
    row; on the device for the others."""
    if all(getattr(r, "host", None) is not None for r, *_ in spans):
        # (one zero matrix filled by slices: np.pad per row costs ~20 us of Python each)
        out = np.zeros((len(spans), max(left + hi - lo + right for _, lo, hi, left, right in spans)), np.int32)
        for i, (r, lo, hi, left, _) in enumerate(spans):
            out[i, left : left + hi - lo] = r.host[0, lo:hi]
        return mx.array(out)
    rows = []
    for r, lo, hi, left, right in spans:
        host = getattr(r, "host", None)
        if host is not None:
            rows.append(mx.array(np.pad(host[:, lo:hi], ((0, 0), (left, right))).astype(np.int32)))
            continue
        row = r.canvas if (lo, hi) == (0, r.canvas.shape[1]) else r.canvas[:, lo:hi]
        parts = (
            ([mx.zeros((1, left), row.dtype)] if left else [])
            + [row]
            + ([mx.zeros((1, right), row.dtype)] if right else [])
        )
        rows.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1))
    return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)


def _pad_left(x: mx.array, width: int, axis: int) -> mx.array:
    missing = width - x.shape[axis]
    if not missing:
        return x
    shape = list(x.shape)
    shape[axis] = missing
    return mx.concatenate([mx.zeros(shape, x.dtype), x], axis=axis)


class _BatchLayerView:
    """One layer's keys and values for a batched block-causal window: every row's cached
    prefix (left-padded to `stored`) before the window's own keys; RoPE from `offset`
    (B,). The window's keys and values are kept for the rows' caches."""

    def __init__(self, offset: mx.array, prefix: Optional[tuple]):
        self.offset = offset
        self.prefix = prefix
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values
        if self.prefix is None:
            return keys, values
        k, v = self.prefix
        return mx.concatenate([k, keys], axis=2), mx.concatenate([v, values], axis=2)


def block_causal_batch(adapter: Any, requests: Sequence[Any]) -> list:
    """Block-causal window forwards of every row at once (BlockCausalAdapter.predict's)."""
    block, layers = adapter.attention_block, len(adapter.model.layers)
    plans = [_window_plan(r, block) for r in requests]  # (offset, stop) per row
    # (windows span one or two attention blocks: a block multiple keeps the shapes few)
    width = -(-max(stop - offset for offset, stop in plans) // block) * block
    stored = max(offset for offset, _ in plans)
    stored = bucketed(stored) if stored else 0
    tokens = token_matrix([(r, offset, stop, width - (stop - offset), 0) for r, (offset, stop) in zip(requests, plans)])
    first = np.array([offset - (width - (stop - offset)) for offset, stop in plans])  # position of column 0
    # (each row's cached prefix: positions [0, offset) at columns [0, offset), kept stacked across steps)
    prefixes = stacked_prefix_of(adapter).read([r.state for r in requests], stored) if stored else [None] * layers
    mask = _block_causal_mask(plans, first, width, stored, block)
    hidden, views = window_backbone(adapter, tokens, mask, mx.array(first), prefixes)
    reads = []
    for row, (r, (offset, stop)) in enumerate(zip(requests, plans)):
        column = width - (stop - offset) - offset  # canvas position p sits at column p + column
        reads.append((r.start + column, r.end - r.start))
        if r.state is not None and r.state.layers:
            _store(r.state, views, row, offset, stop, column, block)
    return stacked_head(adapter, hidden, reads)


# the batched block-causal and full-canvas backbone calls through mx.compile (window_backbone)
COMPILE_WINDOWS = True


def window_backbone(adapter: Any, tokens: mx.array, mask: mx.array, first: mx.array, prefixes: list):
    """The backbone over a batched block-causal window: (hidden, per-layer views holding the
    window's keys and values). Through `mx.compile` (COMPILE_WINDOWS): on MLX's CPU backend
    the fast norm, RoPE and attention ops expand into ~330 primitives for a 2-layer step,
    each dispatched from the calling thread; compiled, the elementwise runs are fused and a
    shape seen before is not traced again in Python (a 1-row forward and head measured
    1.7 -> 0.9 ms, 8 rows 5.5 -> 4.2 ms, the same logits bit for bit). A new shape is traced
    once (the widths are bucketed: few shapes; at most MAX_TRACES are kept); each new fused kernel is built once by
    MLX's CPU JIT and cached on disk."""
    if not COMPILE_WINDOWS:
        views = [_BatchLayerView(first, prefix) for prefix in prefixes]
        return adapter.model.backbone(tokens, mask, views), views
    with_prefix = prefixes[0] is not None
    flat = [a for prefix in prefixes for a in prefix] if with_prefix else []
    window = _compiled(
        adapter,
        ("window", with_prefix),
        lambda: _pure_window(adapter.model, len(prefixes), with_prefix),
        tokens,
        mask,
        *flat,
    )
    hidden, *kv = window(tokens, mask, first, *flat)
    views = []
    for layer, prefix in enumerate(prefixes):
        view = _BatchLayerView(first, prefix)
        view.keys, view.values = kv[2 * layer], kv[2 * layer + 1]
        views.append(view)
    return hidden, views


def _pure_window(model: Any, layers: int, with_prefix: bool):
    """The backbone call as a pure function of arrays (what mx.compile traces): the window's
    keys and values, which the views capture, are returned instead."""

    def forward(tokens, mask, first, *flat):
        views = [_BatchLayerView(first, (flat[2 * i], flat[2 * i + 1]) if with_prefix else None) for i in range(layers)]
        hidden = model.backbone(tokens, mask, views)
        return (hidden, *[a for view in views for a in (view.keys, view.values)])

    return forward


def causal_prefix_batch(adapter: Any, requests: Sequence[Any], caches: Sequence[list]) -> list:
    """Bidirectional block passes over each row's own causal KV cache (Nemotron-Labs
    Diffusion's predict), one model call per block width: every row's block (B, W),
    RoPE and the attention scale from each row's own offset (its cache length), keys =
    its cached prefix (left-padded to a common length, the padding masked out) then the
    block. Nothing is stored: the rows' caches are left as they are (predict trims the
    block away again). `caches[i]`: row i's per-layer KVCaches, holding [0, start)."""

    def call(rows: list) -> list:  # (rows: (request, its caches) pairs of one block width)
        group = [r for r, _ in rows]
        return _causal_prefix_call(adapter, group, [c for _, c in rows], group[0].end - group[0].start)

    return answered(list(zip(requests, caches)), by_width(requests), call)


def _causal_prefix_call(adapter: Any, requests: list, caches: list, width: int) -> list:
    tokens = mx.concatenate([r.canvas[:, r.start : r.end] for r in requests], axis=0)
    views, masks = stacked_prefix_views(caches, [None] * len(caches[0]), width)
    hidden = adapter.model.backbone(tokens, masks[0], views)  # (masks[0] None: no row has a prefix)
    return stacked_head(adapter, hidden, [(0, width)] * len(requests))


def _stacked_caches(layer_caches: list, stored: int, window: Optional[int] = None) -> Optional[tuple]:
    """(B, H, stored, D) keys and values of one layer's caches, left-padded; None: no prefix.
    `window`: each cache's last `window - 1` positions only (a sliding-window layer's)."""
    if not stored:
        return None
    filled = [c for c in layer_caches if c.offset]
    if not filled:
        return None
    like = filled[0].keys[..., :1, :]
    zeros = mx.zeros((1, like.shape[1], stored, like.shape[3]), like.dtype)

    def kept(c: Any, a: mx.array) -> mx.array:
        lo = max(0, c.offset - window + 1) if window else 0
        return zeros if not c.offset else _pad_left(a[..., lo : c.offset, :], stored, axis=2)

    keys = [kept(c, c.keys) for c in layer_caches]
    values = [kept(c, c.values) for c in layer_caches]
    return mx.concatenate(keys, axis=0), mx.concatenate(values, axis=0)


def stacked_prefix_views(layer_caches: Sequence[list], windows: Sequence[Optional[int]], width: int) -> tuple:
    """Per layer, a view of many rows' caches for a batched forward of `width` new positions each,
    attending to each row's cached prefix and the new positions (no causal order among
    them): (views, masks). A view holds the layer's prefixes left-padded to one width
    (bucketed; `windows[layer]`: the last window - 1 positions only) and rotates from each
    row's own offset; a mask (B, 1, 1, stored + width) hides the padding (None where no
    row has a prefix), before the new positions' keys."""
    offsets = np.array([caches[0].offset for caches in layer_caches])
    views, masks, by_window = [], [], {}
    for layer, window in enumerate(windows):
        lengths = np.minimum(offsets, window - 1) if window else offsets
        stored = bucketed(int(lengths.max())) if lengths.max() else 0
        views.append(
            _BatchLayerView(mx.array(offsets), _stacked_caches([c[layer] for c in layer_caches], stored, window))
        )
        if window not in by_window:
            real = np.arange(stored + width)[None, :] >= (stored - lengths)[:, None]  # (B, stored + width)
            by_window[window] = mx.array(real)[:, None, None, :] if stored else None
        masks.append(by_window[window])
    return views, masks


class _CausalFeedView(_BatchLayerView):
    """A layer's view for a batched causal feed; it also answers the model's mask call
    (mlx-lm's create_attention_mask asks the cache for its mask, as BatchKVCache does)."""

    def __init__(self, offset: mx.array, prefix: Optional[tuple], mask: mx.array):
        super().__init__(offset, prefix)
        self.mask = mask

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        return self.mask


def causal_feed_batch(model: Any, caches: Sequence[list], feeds: Sequence[mx.array]) -> RowLogits:
    """Feed each row's new tokens (1, L_i) to an mlx-lm causal LM over its own KV cache, in
    one call (`causal_feed`; the model asks its first cache for the mask). Returns the
    logits after each row's last token, (1, 1, V) float32 per row (a RowLogits over one
    (B, 1, V) array)."""
    out = causal_feed(lambda tokens, mask, views: model(tokens, cache=views), caches, feeds)
    last = mx.array([f.shape[1] - 1 for f in feeds])[:, None, None]
    source = mx.take_along_axis(out, last, axis=1)
    source = source if source.dtype == mx.float32 else source.astype(mx.float32)
    rows = RowLogits(source[i : i + 1] for i in range(len(feeds)))
    rows.source = source
    return rows


def causal_verify_batch(adapter: Any, requests: Sequence[Any]) -> RowLogits:
    """Self-speculation's verify passes (Nemotron-Labs Diffusion's `verify`) of many rows in
    one call: each row's window (request.canvas[:, start:end]) fed causally over its own KV
    cache (`causal_feed`), which stores its keys and values; per row the logits (1, L_i, V)
    after each of its window's positions."""
    feeds = [r.canvas[:, r.start : r.end] for r in requests]
    hidden = causal_feed(adapter.model.backbone, [r.state.cache for r in requests], feeds)
    return stacked_head(adapter, hidden, [(0, f.shape[1]) for f in feeds])


def causal_feed(call: Callable, caches: Sequence[list], feeds: Sequence[mx.array]) -> mx.array:
    """`call(tokens, mask, views)` (a causal backbone, or an mlx-lm LM that asks its first
    cache for the mask) over each row's new tokens (1, L_i) on top of its own KV cache: the
    tokens right-padded to one width, RoPE from each row's own offset, keys = its cached
    prefix (left-padded to one length, the padding masked out) then the new ones, masked
    causally on each row's positions. The new keys and values go into each row's cache.
    Returns call's output, (B, width, ...): row i's new positions are its first L_i columns.

    Right, not left, padding (mlx-lm's BatchKVCache pads on the left): a row's padding then
    sits after its tokens, at positions past them, never below 0. Left padding puts it at
    negative positions wherever a row's cache is shorter than the padding, and Ministral-3's
    llama-4 attention scaling takes log(1 + floor(position / max)) = log(0) there: NaN
    queries, whose values the real rows' zero attention weights still carry in (0 * NaN)."""
    width = max(f.shape[1] for f in feeds)
    fed = np.array([c[0].offset for c in caches])
    lengths = np.array([f.shape[1] for f in feeds])
    stored = bucketed(int(fed.max())) if fed.max() else 0
    tokens = mx.concatenate(
        [
            f if f.shape[1] == width else mx.concatenate([f, mx.zeros((1, width - f.shape[1]), f.dtype)], axis=1)
            for f in feeds
        ],
        axis=0,
    )
    query_pos = fed[:, None] + np.arange(width)[None, :]
    cached_pos = fed[:, None] - stored + np.arange(stored)[None, :]
    key_pos = np.concatenate([cached_pos, query_pos], axis=1)
    # (a padded query sees the row's real keys before it: no row of the mask is empty)
    key_real = np.concatenate([cached_pos >= 0, np.arange(width)[None, :] < lengths[:, None]], axis=1)
    allowed = key_real[:, None, :] & (key_pos[:, None, :] <= query_pos[:, :, None])
    mask = mx.array(allowed)[:, None]
    views = [
        _CausalFeedView(mx.array(fed), _stacked_caches([c[layer] for c in caches], stored), mask)
        for layer in range(len(caches[0]))
    ]
    out = call(tokens, mask, views)
    for row, (row_caches, n) in enumerate(zip(caches, lengths)):
        for cache, view in zip(row_caches, views):
            cache.update_and_fetch(view.keys[row : row + 1, :, :n], view.values[row : row + 1, :, :n])
    return out


def _window_plan(request: Any, block: int) -> tuple[int, int]:
    state = request.state
    stop = min(-(-request.end // block) * block, request.canvas.shape[1])
    offset = state.stored if state is not None and state.layers else 0
    return offset, stop


def _block_causal_mask(plans, first: np.ndarray, width: int, stored: int, block: int) -> mx.array:
    """(B, 1, width, stored + width) boolean: a query attends to a real key whose block is
    not after its own (absolute positions per row); padded queries attend to themselves.
    Cached column j is position j of every row (StackedPrefix's layout), real below the
    row's offset."""
    B = len(plans)
    offsets = np.array([offset for offset, _ in plans])
    query_pos = first[:, None] + np.arange(width)[None, :]  # (B, W)
    query_real = query_pos >= offsets[:, None]
    cached_pos = np.broadcast_to(np.arange(stored)[None, :], (B, stored))  # (B, S)
    key_pos = np.concatenate([cached_pos, query_pos], axis=1)
    key_real = np.concatenate([cached_pos < offsets[:, None], query_real], axis=1)
    allowed = key_real[:, None, :] & (key_pos[:, None, :] // block <= query_pos[:, :, None] // block)
    own = np.zeros((B, width, stored + width), dtype=bool)
    own[:, np.arange(width), stored + np.arange(width)] = True
    allowed |= own & ~query_real[:, :, None]
    return mx.array(allowed)[:, None]


def _store(state: Any, views: list, row: int, offset: int, stop: int, column: int, block: int) -> None:
    """Leave the row's cache as `predict` would: whole attention blocks of final tokens."""
    keep = max(offset, min(state.final // block * block, stop))
    if keep == offset:
        return
    lo, hi = offset + column, keep + column
    for cache, view in zip(state.layers, views):
        cache.update_and_fetch(view.keys[row : row + 1, :, lo:hi], view.values[row : row + 1, :, lo:hi])
