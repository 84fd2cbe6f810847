"""The "ar" adapter at block length 1 against mlx_lm.generate on the same causal LM.

Both decode greedily the same prompt for the same number of tokens, side by side in
one run; prints tokens/s of each (best run), the time ratio engine / mlx-lm (goal
<= 1.10) as the median of back-to-back pairs and as the ratio of the best runs (noise
only adds time), and whether the tokens are identical.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_ar.py
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import mlx_lm

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.testing.causal_checkpoints import write_causal  # noqa: E402

TOKENS, PROMPT, PAIRS = 128, list(range(40, 72)), 15
SIZE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4)  # a micro model
ROWS = [("llama", {}), ("qwen3", {}), ("llama", dict(vocab_size=32000))]  # the last: a real vocabulary


def timed(fn):
    tic = time.perf_counter()
    out = fn()
    return time.perf_counter() - tic, out


def main():
    print(f"{'model':8} {'vocab':>6} {'mlx-lm tok/s':>13} {'ar tok/s':>9} {'ratio':>6} {'best':>5} identical")
    for model_type, extra in ROWS:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "m"
            write_causal(path, model_type, **SIZE, **extra)
            cfg = json.loads((path / "config.json").read_text())
            model, tok = mld.load(str(path), autoregressive=True)
            ref = lambda: [r.token for r in mlx_lm.stream_generate(model, tok, PROMPT, max_tokens=TOKENS)]
            ours = lambda: [r.token for r in mld.stream_generate(model, tok, PROMPT, max_tokens=TOKENS, block_length=1)]
            ref(), ours()  # warm up
            # back-to-back pairs, the median of their ratios: the machine drifts between pairs
            runs = [(timed(ref), timed(ours)) for _ in range(PAIRS)]
            ratio = statistics.median(o[0] / r[0] for r, o in runs)
            t_ref, t_ours = min(r[0] for r, _ in runs), min(o[0] for _, o in runs)
            same = all(r[1] == o[1] for r, o in runs)
            n = len(runs[0][0][1])
            print(
                f"{model_type:8} {cfg['vocab_size']:6} {n / t_ref:13.1f} {n / t_ours:9.1f} {ratio:6.2f} "
                f"{t_ours / t_ref:5.2f} {same}"
                f"   ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']})"
            )


if __name__ == "__main__":
    main()
