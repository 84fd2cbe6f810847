"""Fast-dLLM's prefix and dual caches on LLaDA and Dream micro models (a benchmark, not a test).

Side by side in one run: a 32-token prompt, 128 / 256 / 512 generated tokens, blocks of
32, one token per forward (the quota rule with one step per position), with cache None,
"prefix" and "dual": tokens/s, the speedup over no cache and the forward counts (equal
by construction). Decodes are interleaved and the median of `--repeats` is reported.

With `--peer PATH` (a checkout of github.com/MacPaw/Fast-dLLM-mlx, never copied into
this repository) the same Dream checkpoint also runs through the peer's
`diffusion_generate_step` at identical settings: dual cache, threshold 0.9, block 32,
greedy; and with one token per forward (the peer's threshold above 1: only the most
confident commits; here the quota rule, ranked by probability). The peer table reports
the best of `--repeats` interleaved runs of each.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/bench_bidirectional_cache.py [--peer /tmp/peer] [--lengths 128 256 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from safetensors.numpy import load_file, save_file  # noqa: E402

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.decoding.engine import Engine  # noqa: E402
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve  # noqa: E402
from mlx_lm_diffusion.testing.checkpoints import MASK_ID, VOCAB, write_dream, write_llada  # noqa: E402
from model_adapters import adapter_for  # noqa: E402

PROMPT = list(range(40, 72))  # 32 tokens
BLOCK = 32
SIZE = dict(n_layers=4, n_heads=8, n_kv_heads=4, max_len=1024)


def decode(model, tok, max_tokens, **options):
    """Wall seconds and forwards of one decode that fills the whole canvas (no EOS stop)."""
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()
    resolved = resolve(DecodeOptions(max_tokens=max_tokens, block_length=BLOCK, **options), adapter, len(PROMPT))
    tic = time.perf_counter()
    last = None
    for last in Engine(adapter, resolved, keep_logprobs=False).run(mx.array([PROMPT])):
        pass
    return time.perf_counter() - tic, last.forwards, last.canvas[0, len(PROMPT) :]


def cache_table(models, lengths, repeats):
    print(f"{'model':6} {'tokens':>6} {'cache':>7} {'forwards':>8} {'tok/s':>8} {'speedup':>8} {'ms/token':>9}")
    for name, (model, tok) in models.items():
        for n in lengths:
            decode(model, tok, n, cache="dual")  # warm up this shape
            times = {mode: [] for mode in (None, "prefix", "dual")}
            forwards = {}
            for _ in range(repeats):  # interleaved: the machine drifts
                for mode in times:
                    wall, forwards[mode], _ = decode(model, tok, n, cache=mode)
                    times[mode].append(wall)
            base = statistics.median(times[None])
            for mode, walls in times.items():
                wall = statistics.median(walls)
                print(
                    f"{name:6} {n:6d} {str(mode):>7} {forwards[mode]:8d} {n / wall:8.1f} {base / wall:7.2f}x"
                    f" {1000 * wall / n:9.2f}",
                    flush=True,
                )
            assert len(set(forwards.values())) == 1, forwards


def peer_table(path, dream_dir, model, tok, lengths, repeats):
    sys.path.insert(0, str(path))
    try:
        from fast_dllm_mlx.generate import DreamGenerationConfig, diffusion_generate_step, load
    except ImportError as error:
        print(f"\npeer: cannot import fast_dllm_mlx from {path} ({error}); skipped")
        return
    peer_model = Counted(load(str(dream_dir))[0])
    vocab = peer_model.model.args.vocab_size
    prompt = mx.array([PROMPT])

    def run_peer(n, threshold):
        config = DreamGenerationConfig(
            max_length=len(PROMPT) + n,
            steps=n,
            block_length=BLOCK,
            threshold=threshold,
            temperature=0.0,
            dual_cache=True,
            mask_token_id=MASK_ID,
        )
        peer_model.forwards = 0
        tic = time.perf_counter()
        out = diffusion_generate_step(prompt, peer_model, config)
        mx.eval(out)
        wall = time.perf_counter() - tic
        assert MASK_ID not in out[0, len(PROMPT) :].tolist(), "the peer left masks"
        return wall, peer_model.forwards

    print(
        f"\nDream (vocabulary {vocab}), dual cache, block {BLOCK}, greedy: this project vs "
        f"MacPaw/Fast-dLLM-mlx ({path})"
    )
    print(
        f"{'tokens':>6} {'rule':>22} {'ours tok/s':>10} {'fwd/tok':>8} {'peer tok/s':>10} {'fwd/tok':>8}"
        f" {'ours/peer':>9}"
    )
    # one token per forward: the most confident commits (the peer: a threshold above 1, its
    # force-one; here the quota rule, one per step, ranked by probability, not Dream's entropy)
    settings = [
        ("threshold 0.9", dict(threshold=0.9), 0.9),
        ("one token per forward", dict(strategy="low_confidence"), 1.01),
    ]
    for n in lengths:
        for label, ours, peer_threshold in settings:
            decode(model, tok, n, cache="dual", **ours)
            run_peer(n, peer_threshold)
            mine, theirs = [], []
            for _ in range(repeats):
                wall, forwards, _ = decode(model, tok, n, cache="dual", **ours)
                mine.append(wall)
                peer_wall, peer_forwards = run_peer(n, peer_threshold)
                theirs.append(peer_wall)
            a, b = min(mine), min(theirs)  # (interleaved; a shared machine's load only adds time)
            print(
                f"{n:6d} {label:>22} {n / a:10.1f} {forwards / n:8.2f} {n / b:10.1f} {peer_forwards / n:8.2f}"
                f" {b / a:8.2f}x",
                flush=True,
            )


def _peer_ready(dream: Path) -> None:
    """The peer's ModelArgs requires `rope_scaling`; the peer never removes the mask token
    from its proposals (and stops a block when a step changes nothing), so the mask row
    of the head is zeroed, as a trained model's mask logit is low (the engine suppresses
    it either way)."""
    config = json.loads((dream / "config.json").read_text())
    (dream / "config.json").write_text(json.dumps({**config, "rope_scaling": None}))
    weights = load_file(str(dream / "model.safetensors"))
    weights["lm_head.weight"][MASK_ID] = 0.0
    save_file(weights, str(dream / "model.safetensors"), metadata={"format": "pt"})


class Counted:
    """The peer's model with its forwards counted."""

    def __init__(self, model):
        self.model, self.forwards = model, 0

    @property
    def layers(self):
        return self.model.layers

    def __call__(self, *args, **kwargs):
        self.forwards += 1
        return self.model(*args, **kwargs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", type=Path, default=None, help="checkout of MacPaw/Fast-dLLM-mlx")
    parser.add_argument(
        "--peer-vocabs",
        type=int,
        nargs="+",
        default=[VOCAB, 32768],
        help="vocabulary sizes of the Dream checkpoints the peer comparison runs on",
    )
    parser.add_argument("--peer-only", action="store_true", help="skip the cache table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        llada = write_llada(Path(tmp) / "llada", d_model=256, mlp=512, **SIZE)
        dream = write_dream(Path(tmp) / "dream", hidden=256, inter=512, **SIZE)
        _peer_ready(dream)
        models = {"LLaDA": mld.load(str(llada)), "Dream": mld.load(str(dream))}
        if not args.peer_only:
            cache_table(models, args.lengths, args.repeats)
        if args.peer is None:
            print("\npeer: no --peer checkout of MacPaw/Fast-dLLM-mlx given; skipped")
        elif not (args.peer / "fast_dllm_mlx").is_dir():
            print(f"\npeer: {args.peer} holds no fast_dllm_mlx package; skipped")
        else:
            for vocab in args.peer_vocabs:
                path = dream
                if vocab != VOCAB:  # (a realistic vocabulary: the head's share of a forward)
                    path = write_dream(Path(tmp) / f"dream{vocab}", hidden=256, inter=512, vocab=vocab, **SIZE)
                    _peer_ready(path)
                peer_table(args.peer, path, *mld.load(str(path)), args.lengths, args.repeats)


if __name__ == "__main__":
    main()
