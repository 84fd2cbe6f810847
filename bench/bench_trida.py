"""Trida2.0 / FLARE's self-speculation on the Qwen3.5 hybrid against mlx-lm's greedy generate on
the same weights.

A micro Trida checkpoint (hidden 256, 4 layers: three gated-delta, one attention; random weights:
drafts are rarely right) and the same with every layer's output zeroed and an untied head that
always proposes one token (`force_bigram(forced=...)`: every draft right, every round accepted
whole), each decoded greedily by this package and by mlx_lm.stream_generate on the same weights
loaded as a stock Qwen3.5, side by side in one run: tok/s of each (best of the back-to-back
pairs), forwards, tokens per forward, the time ratio (median of the pairs) and whether the tokens
are identical.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_trida.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import mlx_lm
from mlx_lm.sample_utils import make_sampler

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.testing.hybrid_checkpoints import force_bigram, trida_as_qwen3_5, write_trida

TOKENS, PAIRS = 128, 5
SIZE = dict(hidden=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, inter=768, linear_k_heads=4,
            linear_v_heads=8, linear_k_dim=32, linear_v_dim=32, tied=False)
PROMPT = "The quick brown fox jumps over the lazy dog"


def timed(fn):
    tic = time.perf_counter()
    out = fn()
    return time.perf_counter() - tic, out


def main():
    print(f"{'weights':8} {'N':>2} {'mlx-lm tok/s':>13} {'Trida tok/s':>12} {'forwards':>9} {'tok/fwd':>8} "
          f"{'time ratio':>10} identical")
    for name, forced in (("random", None), ("forced", 100)):
        with tempfile.TemporaryDirectory() as tmp:
            path = write_trida(Path(tmp) / name, **SIZE)
            if forced is not None:
                force_bigram(path, forced=forced)
            model, tok = mld.load(str(path))
            stock, stock_tok = mlx_lm.load(str(trida_as_qwen3_5(path, Path(tmp) / "qwen3_5")))
            ids = tok.encode(PROMPT)
            for strides in (2, 4, 8):
                ref = lambda: [r.token for r in mlx_lm.stream_generate(  # noqa: E731
                    stock, stock_tok, ids, max_tokens=TOKENS, sampler=make_sampler(0.0))]

                def ours():
                    out = [(r.token, r.forwards) for r in mld.stream_generate(model, tok, ids, max_tokens=TOKENS,
                                                                              block_length=strides)]
                    return [t for t, _ in out], out[-1][1]

                ref(), ours()  # warm up
                runs = [(timed(ref), timed(ours)) for _ in range(PAIRS)]
                ratio = statistics.median(o[0] / r[0] for r, o in runs)
                t_ref, t_ours = min(r[0] for r, _ in runs), min(o[0] for _, o in runs)
                tokens, forwards = runs[0][1][1]
                same = all(r[1] == o[1][0] for r, o in runs)
                n = len(tokens)
                print(f"{name:8} {strides:2} {n / t_ref:13.1f} {n / t_ours:12.1f} {forwards:9} "
                      f"{n / forwards:8.2f} {ratio:10.2f} {same}", flush=True)


if __name__ == "__main__":
    main()
