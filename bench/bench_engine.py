"""Engine overhead on LLaDA and Dream micro models (a benchmark, not a test).

overhead = decode wall time / (forwards x wall time of one bare forward of the same
shape), measured side by side in one run. Also forwards per token and tokens/s.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python bench/bench_engine.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mlx_lm_diffusion as mld  # noqa: E402
from checkpoints import write_dream, write_llada  # noqa: E402
from model_adapters import adapter_for  # noqa: E402

GEN, PROMPT = 128, list(range(40, 72))
SIZE = dict(n_layers=4, n_heads=8, n_kv_heads=4)


def bare_forward_seconds(adapter, block, repeats=20):
    canvas = mx.array([PROMPT + [adapter.mask_id] * GEN])
    start = len(PROMPT)
    end = start + block
    mx.eval(adapter.predict(None, canvas, start, end))
    tic = time.perf_counter()
    for _ in range(repeats):
        mx.eval(adapter.predict(None, canvas, start, end))
    return (time.perf_counter() - tic) / repeats


def decode(model, tok, **options):
    tic = time.perf_counter()
    out = list(mld.stream_generate(model, tok, PROMPT, max_tokens=GEN, **options))
    # count all tokens: the random micro models rarely emit EOS, and we time the canvas
    return time.perf_counter() - tic, len(out), out[-1].forwards


def main():
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        llada = write_llada(Path(tmp) / "llada", d_model=256, mlp=512, **SIZE)
        dream = write_dream(Path(tmp) / "dream", hidden=256, inter=512, **SIZE)
        cases = [
            ("LLaDA", llada, dict(block_length=32), 32),
            ("LLaDA", llada, dict(block_length=32, threshold=0.9), 32),
            ("Dream", dream, dict(), GEN),
            ("Dream", dream, dict(block_length=32), 32),
        ]
        for name, path, options, block in cases:
            model, tok = mld.load(str(path))
            adapter = adapter_for(model, tok)
            decode(model, tok, **options)  # warm up
            # pairs measured back to back (a decode, then its forwards bare); the median
            # pair is reported: the machine is noisy and drifts
            runs = []
            for _ in range(5):
                wall, tokens, forwards = decode(model, tok, **options)
                runs.append((wall / (forwards * bare_forward_seconds(adapter, block, forwards)),
                             wall, tokens, forwards))
            ratio, wall, tokens, forwards = sorted(runs)[len(runs) // 2]
            rows.append((name, options, tokens, forwards, wall, ratio))
    print(f"{'model':6} {'options':44} {'tokens':>6} {'fwd/tok':>8} {'tok/s':>8} {'overhead':>8}")
    for name, options, tokens, forwards, wall, ratio in rows:
        print(f"{name:6} {str(options):44} {tokens:6d} {forwards / tokens:8.2f} {tokens / wall:8.1f} {ratio:8.3f}")


if __name__ == "__main__":
    main()
