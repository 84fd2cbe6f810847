"""Trida2.0 / FLARE's self-speculation on the Qwen3.5 hybrid against mlx-lm's greedy generate on
the same weights.

A micro Trida checkpoint (hidden 256, 4 layers: three gated-delta, one attention; random weights:
drafts are rarely right) and the same with every layer's output zeroed and an untied head that
always proposes one token (`force_bigram(forced=...)`: every draft right, every round accepted
whole), each decoded greedily by this package and by mlx_lm.stream_generate on the same weights
loaded as a stock Qwen3.5, side by side in one run: tok/s of each (best of the back-to-back
pairs), forwards, tokens per forward, the time ratio (median of the pairs) and whether the tokens
are identical (mlx_lm_diffusion.testing.speculative_race).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_trida.py
"""

from __future__ import annotations

from mlx_lm_diffusion.testing.hybrid_checkpoints import force_bigram, trida_as_qwen3_5, write_trida
from mlx_lm_diffusion.testing.speculative_race import race

SIZE = dict(
    hidden=256,
    n_layers=4,
    n_heads=8,
    n_kv_heads=4,
    head_dim=32,
    inter=768,
    linear_k_heads=4,
    linear_v_heads=8,
    linear_k_dim=32,
    linear_v_dim=32,
    tied=False,
)
PROMPT = "The quick brown fox jumps over the lazy dog"


def main():
    race(
        [
            ("random", lambda p: write_trida(p, **SIZE)),
            ("forced", lambda p: force_bigram(write_trida(p, **SIZE), forced=100)),
        ],
        trida_as_qwen3_5,
        "Trida",
        PROMPT,
    )


if __name__ == "__main__":
    main()
