"""LFM2.5-Diffusion's DUO sampler: forwards per token at the presets, and what a float32 posterior
changes against the reference's float64.

A micro LFM2 diffusion checkpoint (hidden 256, 6 layers: convolutions and two attention layers;
random weights) decodes seeded prompts at nfe4 / nfe8 / nfe32: forwards, tokens, tokens per
forward (a block costs steps + 1 forwards, the readout; the decode stops after the block holding
the end token, so short answers cost a whole block) and tok/s. Then the same seeded decodes with
`duo_float64=False`: the share of tokens that differ from the float64 run, and the largest
difference between the two posteriors on one step.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_lfm2_diffusion.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.decoders.duo_block import duo_posterior
from mlx_lm_diffusion.testing.hybrid_checkpoints import write_lfm2_diffusion

SIZE = dict(
    hidden=256,
    n_heads=8,
    n_kv_heads=4,
    inter=768,
    cond=64,
    frequencies=64,
    layer_types=("conv", "conv", "full_attention", "conv", "conv", "full_attention"),
)
PROMPTS = ["The quick brown fox", "Hello there", "abc", "What is C. elegans?"]
SEEDS = range(4)
MAX_TOKENS = 96


def decode(model, tok, preset: str, float64: bool) -> tuple:
    tokens, forwards, seconds = [], 0, 0.0
    for prompt in PROMPTS:
        for seed in SEEDS:
            tic = time.perf_counter()
            out = list(
                mld.stream_generate(
                    model, tok, prompt, max_tokens=MAX_TOKENS, preset=preset, seed=seed, duo_float64=float64
                )
            )
            seconds += time.perf_counter() - tic
            tokens.append([r.token for r in out])
            forwards += out[-1].forwards
    return tokens, forwards, seconds


def main():
    with tempfile.TemporaryDirectory() as tmp:
        model, tok = mld.load(str(write_lfm2_diffusion(Path(tmp) / "lfm2", **SIZE)))
        decode(model, tok, "nfe4", True)  # warm up
        print(f"{'preset':7} {'forwards':>8} {'tokens':>7} {'tok/fwd':>8} {'tok/s':>7} {'f32 tokens differing':>21}")
        for preset in ("nfe4", "nfe8", "nfe32"):
            tokens, forwards, seconds = decode(model, tok, preset, True)
            single, _, _ = decode(model, tok, preset, False)
            n = sum(map(len, tokens))
            differing = sum(a != b for x, y in zip(tokens, single) for a, b in zip(x, y))
            compared = sum(min(len(x), len(y)) for x, y in zip(tokens, single))
            print(
                f"{preset:7} {forwards:8} {n:7} {n / forwards:8.2f} {n / seconds:7.1f} "
                f"{differing:6}/{compared} ({differing / max(compared, 1):.1%})",
                flush=True,
            )
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((1, 32, 64400)).astype(np.float32) * 4
    x0 = np.exp(logits - logits.max(-1, keepdims=True))
    x0 /= x0.sum(-1, keepdims=True)
    xt = mx.array(rng.integers(0, 64400, (1, 32)))
    with mx.stream(mx.cpu):
        q64 = duo_posterior(mx.array(x0.astype(np.float64), dtype=mx.float64), xt, 0.3, 0.05)
        q32 = duo_posterior(mx.array(x0), xt, 0.3, 0.05)
        gap = np.abs(np.array(q64) - np.array(q32).astype(np.float64))
    print(
        f"one step, 32 positions x 64,400 tokens (LFM2.5's real vocabulary): float32 posterior's largest "
        f"absolute difference {gap.max():.2e}, relative {np.max(gap / np.array(q64)):.2e}"
    )


if __name__ == "__main__":
    main()
