"""I-DLM's introspective strided decoding against mlx-lm's greedy generate on the same weights.

A micro I-DLM checkpoint (hidden 256, 4 layers, random weights: every draft is rejected) and
the same with weights that make every draft right (`write_idlm(forced=...)`: every round is
accepted whole), each decoded greedily by this package and by mlx_lm.stream_generate on the
same weights loaded as a stock Qwen3, side by side in one run: tok/s of each (best of the
back-to-back pairs), forwards, tokens per forward, the time ratio (median of the pairs) and
whether the tokens are identical (mlx_lm_diffusion.testing.speculative_race).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_idlm.py
"""

from __future__ import annotations

from mlx_lm_diffusion.testing.block_checkpoints import idlm_as_qwen3, write_idlm
from mlx_lm_diffusion.testing.speculative_race import race

SIZE = dict(hidden=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, inter=768)
PROMPT = "The quick brown fox jumps over the lazy dog"


def main():
    race(
        [("random", lambda p: write_idlm(p, **SIZE)), ("forced", lambda p: write_idlm(p, forced=100, **SIZE))],
        idlm_as_qwen3,
        "I-DLM",
        PROMPT,
        pairs=7,
    )


if __name__ == "__main__":
    main()
