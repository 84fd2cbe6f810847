"""Start-up to first token of the generate CLI against `mlx_lm.generate` on the same machine
(a benchmark, not a test): each command started fresh, REPEATS times alternated, median.

- `mlx_lm_diffusion.generate` on the embedded demo (no --model), `--max-tokens 8`;
- `mlx_lm.generate` on a tiny random llama written here (2 layers, the test checkpoints'
  byte tokenizer), `--max-tokens 8`: mlx-lm's own start-up, the peer a user compares with;
- `python -c "import mlx_lm_diffusion"` and `python -c "import mlx_lm"`: the imports alone.

Both CLIs import transformers (mlx-lm's tokenizer wrapper), which imports torch when it is
installed (the `test` extra installs it; a user's `pip install mlx-lm-diffusion` does not):
`import torch` alone is timed too, the part of either start-up a user without torch skips.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_startup.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPEATS = 5


def seconds(command: list, env: dict) -> float:
    tic = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr[-500:]}")
    return time.perf_counter() - tic


def measure(env: dict, llama_path: Path) -> dict:
    py = sys.executable
    commands = {
        "mlx_lm_diffusion.generate (demo)": [
            py,
            "-m",
            "mlx_lm_diffusion.generate",
            "--prompt",
            "357+468=",
            "--max-tokens",
            "8",
            "--verbose",
            "False",
        ],
        "mlx_lm.generate (tiny llama)": [
            py,
            "-m",
            "mlx_lm.generate",
            "--model",
            str(llama_path),
            "--prompt",
            "hi",
            "--max-tokens",
            "8",
            "--verbose",
            "False",
        ],
        "import mlx_lm_diffusion": [py, "-c", "import mlx_lm_diffusion"],
        "import mlx_lm": [py, "-c", "import mlx_lm"],
        "import torch": [py, "-c", "import torch"],
    }
    times = {name: [] for name in commands}
    for _ in range(REPEATS):
        for name, command in commands.items():
            times[name].append(seconds(command, env))
    return {name: statistics.median(t) for name, t in times.items()}


def import_shares(module: str, env: dict) -> dict:
    """Milliseconds of `import module` by top-level package (each module's own time, from
    `python -X importtime`): what a door imports, and whose imports they are."""
    import collections
    import re

    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"], env=env, capture_output=True, text=True
    )
    shares = collections.Counter()
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if m:
            shares[m[2].split(".")[0]] += int(m[1]) / 1000
    return dict(shares.most_common(8))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        from mlx_lm_diffusion.testing.causal_checkpoints import write_causal

        llama_path = write_causal(Path(tmp) / "llama", "llama")  # (a stock mlx-lm checkpoint)
        rows = {"this environment (torch installed)": measure({**os.environ, "HF_HUB_OFFLINE": "1"}, llama_path)}
    for label, row in rows.items():
        print(f"\n{label} (median of {REPEATS}, seconds)")
        for name, value in row.items():
            print(f"  {name:36s} {value:6.2f}")
        ratio = row["mlx_lm_diffusion.generate (demo)"] / row["mlx_lm.generate (tiny llama)"]
        print(f"  start to answer, ours / mlx_lm.generate: {ratio:.2f}x")
    for module in ("mlx_lm_diffusion.cli.generate", "mlx_lm_diffusion.cli.chat", "mlx_lm_diffusion.server"):
        shares = import_shares(module, os.environ)
        print(
            f"\nimport {module}: ms by package, own time: "
            + ", ".join(f"{name} {ms:.0f}" for name, ms in shares.items())
        )


if __name__ == "__main__":
    main()
