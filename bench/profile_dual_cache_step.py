"""Where a dual-cache step's time goes, here and in MacPaw's Fast-dLLM-mlx (a profile, not a test).

On the Dream micro model of bench/bench_bidirectional_cache.py (4 layers, hidden 256, a
32-token prompt, blocks of 32), for each vocabulary:

1. whole decodes (dual cache, greedy; threshold 0.9 and one token per forward), both
   sides: ms per forward, and on our side how much of it the host spends blocked on
   read-backs (the rest is Python: graph building and the engine's bookkeeping);
2. the pieces of one later step of a block, timed alone at the decode's shapes (the
   block in the middle of the canvas, half of it masked): the window forward over the
   kept keys and values, per layer its attention (with the kept-KV fetch) and its MLP,
   the fetch alone, the head, the statistics and the commit rule, the graph building
   alone (Python, nothing evaluated);
3. the MLX operations one step dispatches (counted in the step's lazy graph), by kind.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/profile_dual_cache_step.py --peer /tmp/peer [--vocabs 288 32768] [--tokens 256]
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_bidirectional_cache import BLOCK, PROMPT, SIZE, Counted, _peer_ready, decode  # noqa: E402
from mlx_arsenal.diffusion import threshold_transfer, topk_transfer  # noqa: E402

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.decoding.decoders import base as decoder_base  # noqa: E402
from mlx_lm_diffusion.decoding.decoders.gathered_rows import bucket, read_positions, spread, spread_filled  # noqa: E402
from mlx_lm_diffusion.decoding.decoders.vocab_stats import greedy_parts  # noqa: E402
from mlx_lm_diffusion.testing.checkpoints import MASK_ID, write_dream  # noqa: E402
from model_adapters import adapter_for  # noqa: E402


def timed(fn, iters: int) -> float:
    """Median ms of `fn()` evaluated, after two warm-up calls."""
    for _ in range(2):
        mx.eval(fn())
    walls = []
    for _ in range(iters):
        tic = time.perf_counter()
        mx.eval(fn())
        walls.append(time.perf_counter() - tic)
    return 1000 * statistics.median(walls)


def built(fn, iters: int) -> float:
    """Median ms to build `fn()`'s graph (its evaluation, after each build, is not timed)."""
    walls = []
    for _ in range(iters):
        tic = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - tic)
        mx.eval(out)
    return 1000 * statistics.median(walls)


def op_counts(*arrays) -> collections.Counter:
    """The MLX operations in the lazy graph of `arrays`, by kind."""
    text = io.StringIO()
    mx.export_to_dot(text, *arrays)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', text.getvalue()))


class Blocked:
    """Wall time our engine's host spends handing graphs to MLX and waiting for them: in
    `mx.async_eval` / `mx.eval` (on the CPU these return only once all but a few of the
    graph's kernels ran) and in the read-backs (Canvas.sync, Canvas.host_of)."""

    def __init__(self):
        self.seconds = collections.Counter()

    def _wrap(self, name, fn):
        def inner(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - tic

        return inner

    @contextmanager
    def patched(self):
        canvas = decoder_base.Canvas
        targets = [(canvas, "sync"), (canvas, "host_of"), (mx, "async_eval"), (mx, "eval")]
        originals = [(owner, name, getattr(owner, name)) for owner, name in targets]
        for owner, name, fn in originals:
            setattr(owner, name, self._wrap(name, fn))
        try:
            yield self
        finally:
            for owner, name, fn in originals:
                setattr(owner, name, fn)


def whole_decodes(model, tok, peer, n: int, repeats: int) -> list:
    """(label, ours ms/forward, ours forwards, ours ms/forward in (async_)eval, in read-backs,
    peer ms/forward, peer forwards)."""
    from fast_dllm_mlx.generate import DreamGenerationConfig, diffusion_generate_step

    rows = []
    for label, ours, threshold in (
        ("threshold 0.9", dict(threshold=0.9), 0.9),
        ("one token per forward", dict(strategy="low_confidence"), 1.01),
    ):
        config = DreamGenerationConfig(
            max_length=len(PROMPT) + n,
            steps=n,
            block_length=BLOCK,
            threshold=threshold,
            temperature=0.0,
            dual_cache=True,
            mask_token_id=MASK_ID,
        )
        decode(model, tok, n, cache="dual", **ours)
        mx.eval(diffusion_generate_step(mx.array([PROMPT]), peer, config))
        mine, blocked, theirs = [], [], []
        for _ in range(repeats):
            with Blocked().patched() as waits:
                wall, forwards, _ = decode(model, tok, n, cache="dual", **ours)
            mine.append(wall)
            blocked.append(
                (waits.seconds["async_eval"] + waits.seconds["eval"], waits.seconds["sync"] + waits.seconds["host_of"])
            )
            peer.forwards = 0
            tic = time.perf_counter()
            mx.eval(diffusion_generate_step(mx.array([PROMPT]), peer, config))
            theirs.append(time.perf_counter() - tic)
        best = min(range(repeats), key=mine.__getitem__)
        evals, reads = blocked[best]
        rows.append(
            (
                label,
                1000 * mine[best] / forwards,
                forwards,
                1000 * evals / forwards,
                1000 * reads / forwards,
                1000 * min(theirs) / peer.forwards,
                peer.forwards,
            )
        )
    return rows


def step_pieces(model, tok, peer, n: int, iters: int) -> dict:
    """Each piece of one later step of the middle block, timed alone (ms) and its op count."""
    from fast_dllm_mlx.cache import make_dual_prompt_cache

    P = len(PROMPT)
    start = P + BLOCK * ((n // BLOCK) // 2)
    end = start + BLOCK
    tokens = mx.concatenate([mx.array([PROMPT]), mx.full((1, n), MASK_ID)], axis=1).astype(mx.int32)
    adapter = adapter_for(model, tok)
    adapter.cache_mode = "dual"
    state = adapter.start(tokens[:, :P])
    mx.eval(adapter.block_hidden(state, tokens, start, end))  # the block's first forward keeps the KV
    # half of the block committed (the kept KV stays that of the all-masked block, as in a decode)
    block = tokens[:, start:end]
    filled = mx.where(mx.arange(BLOCK) % 2 == 0, mx.array(PROMPT[:1] * BLOCK), block)
    tokens = mx.concatenate([tokens[:, :start], filled, tokens[:, end:]], axis=1)
    candidates = tokens[:, start:end] == MASK_ID
    masked = int(candidates.sum().item())
    rows = read_positions(candidates, bucket(masked, BLOCK))
    backbone = model.model
    window = tokens[:, start:end]

    peer_caches = make_dual_prompt_cache(peer.model)
    mx.eval(peer.model(tokens, mask="full", cache=peer_caches))
    peer_backbone = peer.model.model

    def ours_forward():  # (the adapter's cached step: the window over the kept KV, Dream's shift)
        return adapter.block_hidden(state, tokens, start, end)

    def peer_forward():
        return peer_backbone(window, mask="full", cache=peer_caches, cache_position=start, replace_cache=True)

    h = backbone.embed_tokens(window)
    layer, peer_layer = backbone.layers[0], peer_backbone.layers[0]
    normed = layer.input_layernorm(h)
    head_dim = model.args.text.hidden_size // model.args.text.num_attention_heads
    keys = layer.self_attn.k_proj(normed).reshape(1, BLOCK, -1, head_dim).transpose(0, 2, 1, 3)
    values = layer.self_attn.v_proj(normed).reshape(1, BLOCK, -1, head_dim).transpose(0, 2, 1, 3)
    mx.eval(h, normed, keys, values)
    hidden = ours_forward()
    mx.eval(hidden)
    head_rows = mx.take_along_axis(hidden, rows[..., None], axis=1)
    mx.eval(head_rows)
    logits = model.head(head_rows)
    mx.eval(logits)
    peer_logits = peer.model.lm_head(hidden)
    mx.eval(peer_logits)

    def ours_stats_rule(rule):
        x0, prob, _, _, _ = greedy_parts(logits + mx.zeros((model.vocab_size,)))
        x0 = spread(x0, rows, window)
        prob = spread_filled(prob, rows, BLOCK)
        commit = (
            threshold_transfer(prob, candidates, 0.9) if rule == "threshold" else topk_transfer(prob, candidates, 1)
        )
        return mx.where(commit, x0, window), mx.where(commit, prob, mx.zeros_like(prob))

    from fast_dllm_mlx.generate import _compiled_select_confident_updates_greedy, _shift_logits

    def peer_select(threshold):
        return _compiled_select_confident_updates_greedy(window, _shift_logits(peer_logits), MASK_ID, threshold)

    def ours_step():
        hidden = adapter.block_hidden(state, tokens, start, end)
        return model.head(mx.take_along_axis(hidden, rows[..., None], axis=1))

    def peer_step():
        return _shift_logits(
            peer.model(window, mask="full", cache=peer_caches, cache_position=start, replace_cache=True)
        )

    def ours_whole_step():
        logits = ours_step()
        x0, prob, _, _, _ = greedy_parts(logits + mx.zeros((model.vocab_size,)))
        commit = threshold_transfer(spread_filled(prob, rows, BLOCK), candidates, 0.9)
        return mx.where(commit, spread(x0, rows, window), window)

    def peer_whole_step():
        return _compiled_select_confident_updates_greedy(window, peer_step(), MASK_ID, 0.9)

    fetch = layer0_cache(state, start)
    peer_cache0 = peer_caches[0]
    pieces = {
        "window forward (backbone)": (timed(ours_forward, iters), timed(peer_forward, iters)),
        "layer 0 attention (with KV fetch)": (
            timed(lambda: layer.self_attn(normed, None, fetch), iters),
            timed(
                lambda: peer_layer.self_attn(
                    normed, mask="full", cache=peer_cache0, cache_position=start, replace_cache=True
                ),
                iters,
            ),
        ),
        "layer 0 KV fetch alone": (
            timed(lambda: fetch.update_and_fetch(keys, values), iters),
            timed(lambda: peer_cache0.update_and_fetch(keys, values, position=start, replace=True), iters),
        ),
        "layer 0 MLP": (
            timed(lambda: layer.mlp(layer.post_attention_layernorm(h)), iters),
            timed(lambda: peer_layer.mlp(peer_layer.post_attention_layernorm(h)), iters),
        ),
        f"head ({head_rows.shape[1]} rows here, {BLOCK} peer)": (
            timed(lambda: model.head(head_rows), iters),
            timed(lambda: peer.model.lm_head(hidden), iters),
        ),
        "statistics + rule, threshold 0.9": (
            timed(lambda: ours_stats_rule("threshold"), iters),
            timed(lambda: peer_select(0.9), iters),
        ),
        "statistics + rule, one per forward": (
            timed(lambda: ours_stats_rule("top1"), iters),
            timed(lambda: peer_select(1.01), iters),
        ),
        "forward + head + rule (threshold)": (timed(ours_whole_step, iters), timed(peer_whole_step, iters)),
    }
    ops = []
    for step in (ours_whole_step, peer_whole_step):
        out = step()
        ops.append(op_counts(out))
        mx.eval(out)
    pieces["graph building alone (Python)"] = (built(ours_whole_step, iters), built(peer_whole_step, iters))
    return pieces, ops


def layer0_cache(state, start: int):
    """Layer 0's cache for a later step of the block at `start`: this checkout's kind (the
    kept prefix and suffix concatenated around the window, or the window written into a
    kept copy of the canvas's keys and values, in place once it is the only holder)."""
    if hasattr(state, "layers"):  # (the concatenating FrozenCache)
        return state.layers[0]
    from model_adapters.attention.bidirectional_cache import WindowCache

    keys, values = state.kept[0][:2]
    return WindowCache(mx.array(start, mx.int32), keys + 0, values + 0)


def report(vocab: int, n: int, decodes: list, pieces: dict, ops: tuple) -> None:
    print(f"\nDream micro (vocabulary {vocab}), {n} tokens, dual cache, block {BLOCK}; ms per forward")
    print(
        f"{'decode':>22} {'ours':>7} {'fwd':>4} {'in eval':>8} {'reads':>6} {'python':>7} {'peer':>7} {'fwd':>4}"
        f" {'ours/peer':>9}"
    )
    for label, mine, forwards, evals, reads, theirs, peer_forwards in decodes:
        print(
            f"{label:>22} {mine:7.3f} {forwards:4d} {evals:8.3f} {reads:6.3f} {mine - evals - reads:7.3f}"
            f" {theirs:7.3f} {peer_forwards:4d} {mine / theirs:8.2f}x"
        )
    print(f"{'one later step, alone':>40} {'ours ms':>8} {'peer ms':>8} {'ours/peer':>9}")
    for label, (mine, theirs) in pieces.items():
        print(f"{label:>40} {mine:8.3f} {theirs:8.3f} {mine / theirs:8.2f}x")
    for side, counts in zip(("ours", "peer"), ops):
        listed = ", ".join(f"{name} {k}" for name, k in counts.most_common())
        print(f"ops per step ({side}): {sum(counts.values())}: {listed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer", type=Path, required=True, help="checkout of MacPaw/Fast-dLLM-mlx")
    parser.add_argument("--vocabs", type=int, nargs="+", default=[288, 32768])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(args.peer))
    from fast_dllm_mlx.generate import load

    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocabs:
            path = write_dream(Path(tmp) / f"dream{vocab}", hidden=256, inter=512, vocab=vocab, **SIZE)
            _peer_ready(path)
            model, tok = mld.load(str(path))
            peer = Counted(load(str(path))[0])
            decodes = whole_decodes(model, tok, peer, args.tokens, args.repeats)
            pieces, ops = step_pieces(model, tok, peer, args.tokens, args.iters)
            report(vocab, args.tokens, decodes, pieces, ops)


if __name__ == "__main__":
    main()
