"""Tensor-parallel forwards at 1 and 2 ranks on a mid-size LLaDA and LLaDA2 micro model
(a benchmark, not a test).

Per rank: parameter bytes, active memory after the load, peak memory, the time of one
full-canvas forward (best of a few), and the communication cost of a forward: the same
collectives (one all_sum per attention and per MLP block, the embedding's all_sum, the
head's all_gather) timed alone. Then a short greedy decode, checked token-identical to
the single process. On one machine the two ranks share its cores, so the speed is
not what two Macs give: the point is memory per rank and the cost of the collectives.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/bench_distributed.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.parallel.distributed import parameter_bytes  # noqa: E402
from mlx_lm_diffusion.testing.block_checkpoints import write_llada2  # noqa: E402
from mlx_lm_diffusion.testing.checkpoints import write_llada  # noqa: E402
from mlx_lm_diffusion.testing.engine_runs import engine_decode  # noqa: E402

CANVAS = 256  # tokens per forward (prompt + canvas of a decode)
REPEATS = 5
PROMPT = list(range(40, 72))
MODELS = {
    "llada (dense)": lambda p: write_llada(p, d_model=512, n_layers=4, n_heads=8, n_kv_heads=8, mlp=1536, max_len=1024),
    "llada2 (MoE)": lambda p: write_llada2(
        p,
        hidden=512,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        inter=1536,
        moe_inter=256,
        n_experts=16,
        top_k=4,
        n_group=1,
        topk_group=1,
    ),
}


def _best(fn) -> float:
    fn()  # warm-up (graph building, allocations)
    times = []
    for _ in range(REPEATS):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return min(times)


def _collectives(model, group) -> float:
    """The collectives of one forward, alone: sizes from the model's shapes."""
    hidden = model.args.text.hidden_size
    x = mx.ones((1, CANVAS, hidden))
    logits = mx.ones((1, CANVAS, model.vocab_size // group.size()))
    n_sums = 2 * len(model.layers) + 1  # attention and MLP outputs, the embedding

    def run():
        outs = [mx.distributed.all_sum(x + i, group=group) for i in range(n_sums)]
        outs.append(mx.distributed.all_gather(mx.moveaxis(logits, -1, 0), group=group))
        mx.eval(outs)

    return _best(run)


def measure(path: str, group) -> dict:
    mx.reset_peak_memory()
    model, tokenizer = mld.load(path, group=group)
    active = mx.get_active_memory()
    canvas = mx.array([[(7 * i) % 250 for i in range(CANVAS)]])
    forward = _best(lambda: mx.eval(model(canvas)))
    comm = _collectives(model, group) if group is not None else 0.0
    tokens, forwards = engine_decode(model, tokenizer, PROMPT, max_tokens=32, block_length=32, threshold=0.9)
    return {
        "bytes": parameter_bytes(model),
        "active": active,
        "peak": mx.get_peak_memory(),
        "forward": forward,
        "comm": comm,
        "tokens": tokens,
        "forwards": forwards,
    }


def rank_main(paths: dict, out: Path) -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    result = {name: measure(path, group) for name, path in paths.items()}
    (out / f"rank{group.rank()}.json").write_text(json.dumps(result))


def main() -> None:
    if len(sys.argv) == 3:  # a rank under mlx.launch
        return rank_main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = {name: str(write(tmp / name.split()[0])) for name, write in MODELS.items()}
        (tmp / "paths.json").write_text(json.dumps(paths))
        single = {name: measure(path, None) for name, path in paths.items()}
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=path)
        launch = Path(sys.executable).with_name("mlx.launch")
        subprocess.run(
            [
                str(launch),
                "--backend",
                "ring",
                "-n",
                "2",
                "--python",
                sys.executable,
                __file__,
                str(tmp / "paths.json"),
                str(tmp),
            ],
            env=env,
            check=True,
            timeout=1200,
        )
        ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    report(single, ranks)


def report(single: dict, ranks: list) -> None:
    mb = 1 / 2**20
    print(f"canvas {CANVAS} tokens per forward, fp32, ring backend over 127.0.0.1, both ranks on this machine")
    print(
        f"{'model':15} {'ranks':>5} {'params MB/rank':>14} {'active MB':>9} {'peak MB':>8} "
        f"{'forward ms':>10} {'collectives ms':>14} {'same tokens':>11}"
    )
    for name, one in single.items():
        print(
            f"{name:15} {1:5} {one['bytes'] * mb:14.1f} {one['active'] * mb:9.1f} {one['peak'] * mb:8.1f} "
            f"{one['forward'] * 1e3:10.1f} {'-':>14} {'-':>11}"
        )
        for r, rank in enumerate(ranks):
            two = rank[name]
            same = two["tokens"] == one["tokens"] and two["forwards"] == one["forwards"]
            print(
                f"{'':15} {'2:' + str(r):>5} {two['bytes'] * mb:14.1f} {two['active'] * mb:9.1f} "
                f"{two['peak'] * mb:8.1f} {two['forward'] * 1e3:10.1f} {two['comm'] * 1e3:14.1f} {str(same):>11}"
            )


if __name__ == "__main__":
    main()
