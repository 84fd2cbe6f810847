"""The server's throughput with OpenBLAS on one thread (OPENBLAS_NUM_THREADS=1) against its
default (one thread per core), side by side in one run.

    python bench/bench_openblas_threads.py [--rounds 2] [--clients 8] [--requests 32]

OpenBLAS reads the variable when it loads, so each setting is its own process:
bench/bench_server.py (batched and --no-batch servers, SDAR and LLaDA micro models, no
second-turn part), the two settings alternating `--rounds` times so that both see the
same load. Reported: generated tok/s per model, mode and setting (each round, and the
median), and the batched / serial ratio under each setting. Only meaningful where
OpenBLAS is the BLAS MLX calls (LD_PRELOAD of libopenblas on Linux); elsewhere the
variable changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {"default": None, "1 thread": "1"}


def run_bench(setting: str, args, out: Path) -> list:
    env = dict(os.environ)
    env.pop("OPENBLAS_NUM_THREADS", None)
    if SETTINGS[setting] is not None:
        env["OPENBLAS_NUM_THREADS"] = SETTINGS[setting]
    command = [
        sys.executable,
        str(Path(__file__).with_name("bench_server.py")),
        "--history",
        "0",
        "--requests",
        str(args.requests),
        "--max-tokens",
        str(args.max_tokens),
        "--json",
        str(out),
        "--clients",
        *map(str, args.clients),
    ]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, nargs="+", default=[8])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    figures: dict = {}  # (setting, model, clients, mode) -> [tok/s per round]
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for setting in SETTINGS:
                for r in run_bench(setting, args, Path(tmp) / f"{round_}-{setting}.json"):
                    figures.setdefault((setting, r["model"], r["clients"], r["mode"]), []).append(r["tok_per_s"])
                print(f"round {round_ + 1}, OPENBLAS_NUM_THREADS {SETTINGS[setting] or 'unset'}: done", flush=True)
    print(
        f"\ngenerated tok/s, {args.requests} streamed requests per line, max_tokens {args.max_tokens}; "
        f"each round's figure, then the median"
    )
    print(
        f"{'model':<18}{'clients':>8}{'mode':>9}"
        + "".join(f"{s:>28}" for s in SETTINGS)
        + f"{'1 thread / default':>20}"
    )
    keys = sorted({k[1:] for k in figures}, key=lambda k: (k[0], k[1], k[2] != "batched"))
    for model, clients, mode in keys:
        cells, medians = [], []
        for setting in SETTINGS:
            values = figures.get((setting, model, clients, mode), [])
            medians.append(statistics.median(values))
            cells.append(" ".join(f"{v:.0f}" for v in values) + f" | {medians[-1]:.1f}")
        print(
            f"{model:<18}{clients:>8}{mode:>9}"
            + "".join(f"{c:>28}" for c in cells)
            + f"{medians[1] / medians[0]:>19.2f}x"
        )
    print("\nbatched / serial tok/s (medians):")
    for model, clients, mode in keys:
        if mode != "batched":
            continue
        ratios = [
            statistics.median(figures[(s, model, clients, "batched")])
            / statistics.median(figures[(s, model, clients, "serial")])
            for s in SETTINGS
        ]
        print(f"  {model:<18}{clients:>3} clients: " + ", ".join(f"{s} {r:.2f}x" for s, r in zip(SETTINGS, ratios)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
