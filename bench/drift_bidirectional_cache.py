"""Drift of Fast-dLLM's approximate caches on the demo model (a measurement, not a test).

Held-out exact match of the demo checkpoint (mlx_lm_diffusion/demo/model, a LLaDA) with
cache None, "prefix" and "dual", and with preset="fast" (threshold 0.9, dual cache,
block 32), at its decoding defaults and with short blocks (so that an answer spans
several blocks and the kept keys and values go stale), at every canvas length.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/drift_bidirectional_cache.py [--problems 512] [--max-tokens 8 64]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.demo.evaluate import evaluate
from mlx_lm_diffusion.demo.problems import held_out_problems


def decoding_defaults(path: Path) -> dict:
    """The checkpoint's decoding defaults: generation_config.json, else recipe.json's."""
    for name, key in (("generation_config.json", None), ("recipe.json", "default_decoding")):
        file = path / name
        if file.exists():
            config = json.loads(file.read_text())
            config = config.get(key, {}) if key else config
            return {k: config[k] for k in ("block_length", "steps", "strategy") if k in config}
    return {}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEMO_MODEL_PATH)
    p.add_argument("--problems", type=int, default=512)
    p.add_argument("--max-tokens", type=int, nargs="+", default=[8, 64])
    p.add_argument("--short-block", type=int, default=2, help="block length of the short-block rows")
    args = p.parse_args()
    model, tok = mld.load(str(args.model))
    pairs = held_out_problems(args.problems)
    defaults = decoding_defaults(args.model)
    short = {**defaults, "block_length": args.short_block, "steps": args.short_block}
    rules = [
        ("defaults", defaults),
        ("threshold 0.9", {**defaults, "strategy": None, "threshold": 0.9}),
        (f"block {args.short_block}", short),
        (f"block {args.short_block}, thr 0.9", {**short, "strategy": None, "steps": None, "threshold": 0.9}),
    ]
    print(f"{args.problems} held-out problems; checkpoint defaults {defaults}")
    print(f"{'decoding':<22}{'max_tokens':>11}{'cache':>8}{'exact match':>13}{'tok/forward':>13}")
    for m in args.max_tokens:
        for name, options in rules:
            for cache in (None, "prefix", "dual"):
                r = evaluate(model, tok, pairs, max_tokens=m, cache=cache, **options)
                print(
                    f"{name:<22}{m:>11}{str(cache):>8}{100 * r.accuracy:>12.1f}%{r.tokens_per_forward:>13.2f}",
                    flush=True,
                )
        r = evaluate(model, tok, pairs, max_tokens=m, preset="fast")
        print(
            f"{'preset fast':<22}{m:>11}{'dual':>8}{100 * r.accuracy:>12.1f}%{r.tokens_per_forward:>13.2f}", flush=True
        )


if __name__ == "__main__":
    main()
