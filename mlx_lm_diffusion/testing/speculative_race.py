"""A self-speculative decoder against mlx-lm's greedy decode of the same weights, side by side
(bench/bench_idlm.py, bench/bench_trida.py): per checkpoint and N, tok/s of each (best of the
back-to-back pairs after a warm-up), forwards, tokens per forward, the time ratio (median of the
pairs) and whether the tokens are identical."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence


def timed(fn: Callable) -> tuple:
    """(seconds, result) of one call."""
    tic = time.perf_counter()
    out = fn()
    return time.perf_counter() - tic, out


def ours(model, tokenizer, ids: list, tokens: int, **options) -> Callable:
    """A call decoding `ids` with this package: (tokens, forwards)."""
    import mlx_lm_diffusion as mld

    def run():
        out = [(r.token, r.forwards) for r in mld.stream_generate(model, tokenizer, ids, max_tokens=tokens, **options)]
        return [t for t, _ in out], out[-1][1]

    return run


def race(
    checkpoints: Sequence[tuple],
    as_stock: Callable,
    label: str,
    prompt: str,
    tokens: int = 128,
    pairs: int = 5,
    strides: Sequence[int] = (2, 4, 8),
) -> None:
    """Print the table: `checkpoints` are (name, writer(path) -> path), `as_stock(path, to)` the
    same weights as a checkpoint of mlx-lm's own (its greedy decode is the reference)."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    import mlx_lm_diffusion as mld

    print(
        f"{'weights':8} {'N':>2} {'mlx-lm tok/s':>13} {label + ' tok/s':>12} {'forwards':>9} {'tok/fwd':>8} "
        f"{'time ratio':>10} identical"
    )
    for name, write in checkpoints:
        with tempfile.TemporaryDirectory() as tmp:
            path = write(Path(tmp) / name)
            model, tok = mld.load(str(path))
            stock, stock_tok = mlx_lm.load(str(as_stock(path, Path(tmp) / "stock")))
            ids = tok.encode(prompt)

            def ref(stock=stock, stock_tok=stock_tok, ids=ids):
                return [
                    r.token
                    for r in mlx_lm.stream_generate(stock, stock_tok, ids, max_tokens=tokens, sampler=make_sampler(0.0))
                ]

            for n in strides:
                mine = ours(model, tok, ids, tokens, block_length=n)
                ref(), mine()  # warm up
                runs = [(timed(ref), timed(mine)) for _ in range(pairs)]
                ratio = statistics.median(o[0] / r[0] for r, o in runs)
                t_ref, t_ours = min(r[0] for r, _ in runs), min(o[0] for _, o in runs)
                decoded, forwards = runs[0][1][1]
                same = all(r[1] == o[1][0] for r, o in runs)
                k = len(decoded)
                print(
                    f"{name:8} {n:2} {k / t_ref:13.1f} {k / t_ours:12.1f} {forwards:9} "
                    f"{k / forwards:8.2f} {ratio:10.2f} {same}",
                    flush=True,
                )
