"""LLaDA2.2 on a random micro checkpoint in its released layout (block 32, block routing):
its edit decoding (DELETE / SPLIT, the reference's defaults) against threshold-0.95
decoding on the same checkpoint, the prefix cache's speedup on the edit decoding, and the
expert weights a forward reads with block routing against per-token routing at the released
2.2-mini router sizes (a benchmark, not a test).

- forwards per block and tok/s: edit decoding (defaults) and `edit_ops=[]`, threshold 0.95,
  side by side, 256 generated tokens, EOS off (every run fills its canvas). Random weights:
  the counts show the decoders' mechanics, not a trained model's (others measured 9.3-12.1
  forwards per 32-token block with edits against 11.5-14.9 on 2.2-mini).
- cache speedup: the edit decoding without the prefix cache / with it, tokens identical.
- expert bytes per forward: distinct experts a forward gathers in one MoE layer x one
  expert's bytes, for a decoding step's window (one 32-token block after a cached prefix)
  and a 512-token prefill; router sizes of 2.2-mini (256 experts, top 8, capacity 48,
  window 32), expert size hidden 2048 x moe_intermediate 512 x 3 matrices (LLaDA2.x-mini's),
  bf16. Random router weights and hidden states: per-token routing's count is then near its
  ceiling (real tokens share experts more), block routing's is at most 48 per window.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/bench_llada2_2.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models import bailing_moe

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.block_checkpoints import write_llada2_2
from model_adapters import adapter_for
from model_adapters.families.llada2 import BlockRouter, Router

GEN, PROMPT = 256, list(range(40, 72))
SIZE = dict(hidden=128, n_layers=4, n_heads=8, n_kv_heads=4, n_experts=16, top_k=4, moe_inter=64)
MINI = dict(experts=256, top_k=8, capacity=48, window=32, hidden=2048, moe_inter=512, bytes_per_param=2)


def decode(model, tokenizer, use_cache=True, **options):
    adapter = adapter_for(model, tokenizer)
    adapter.use_cache, adapter.eos_ids = use_cache, frozenset()
    resolved = resolve(DecodeOptions(max_tokens=GEN, **options), adapter, len(PROMPT))
    tic = time.perf_counter()
    for last in Engine(adapter, resolved, keep_logprobs=False).run(mx.array([PROMPT])):
        pass
    return time.perf_counter() - tic, last.canvas[0, len(PROMPT) :].tolist(), last.forwards


def decoders(model, tokenizer) -> None:
    blocks = GEN // 32
    runs = {"edits (defaults)": {}, "threshold 0.95, no edits": dict(edit_ops=[], threshold=0.95)}
    best = {
        name: min((decode(model, tokenizer, **o) for _ in range(2)), key=lambda r: r[0]) for name, o in runs.items()
    }
    print(f"{'decoding':28s} {'forwards/block':>15s} {'tok/s':>8s}")
    for name, (seconds, _, forwards) in best.items():
        print(f"{name:28s} {forwards / blocks:15.2f} {GEN / seconds:8.1f}")
    cold = min(decode(model, tokenizer, use_cache=False) for _ in range(2))
    warm = best["edits (defaults)"]
    assert cold[1:] == warm[1:], "the cache changed the tokens"
    print(f"prefix cache speedup on the edit decoding: {cold[0] / warm[0]:.2f}x (tokens and forwards identical)")


def expert_bytes() -> None:
    m = MINI
    args = bailing_moe.ModelArgs.from_dict(
        {
            "model_type": "bailing_moe",
            "hidden_size": m["hidden"],
            "intermediate_size": 4 * m["hidden"],
            "moe_intermediate_size": m["moe_inter"],
            "num_experts": m["experts"],
            "num_shared_experts": 1,
            "norm_topk_prob": True,
            "num_attention_heads": 16,
            "num_experts_per_tok": m["top_k"],
            "num_hidden_layers": 1,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e6,
            "vocab_size": 1024,
            "first_k_dense_replace": 0,
            "max_position_embeddings": 4096,
            "n_group": 1,
            "topk_group": 1,
            "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "routed_scaling_factor": 2.5,
        }
    )
    per_token, block = Router(args), BlockRouter(args, m["window"], m["capacity"])
    block.update(per_token.parameters())
    expert = 3 * m["hidden"] * m["moe_inter"] * m["bytes_per_param"]
    rng = np.random.default_rng(0)
    print(
        f"\nexpert weights read per forward, one MoE layer ({m['experts']} experts, top {m['top_k']}, "
        f"capacity {m['capacity']}, window {m['window']}; {expert / 2**20:.1f} MiB an expert, bf16)"
    )
    print(f"{'forward':30s} {'per-token':>18s} {'block-routed':>18s} {'ratio':>7s}")
    for name, length in (("a step (one 32-token block)", 32), ("a 512-token prefill", 512)):
        x = mx.array(rng.standard_normal((1, length, m["hidden"])).astype(np.float32))
        counts = [len(np.unique(np.array(router(x)[0]))) for router in (per_token, block)]
        mib = [c * expert / 2**20 for c in counts]
        print(
            f"{name:30s} {counts[0]:4d} ({mib[0]:7.1f} MiB) {counts[1]:4d} ({mib[1]:7.1f} MiB) "
            f"{counts[0] / counts[1]:6.2f}x"
        )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write_llada2_2(Path(tmp) / "llada2_2", block_size=32, expert_capacity=6, **SIZE)
        model, tokenizer = mld.load(str(path))
        print(
            f"LLaDA2.2 micro checkpoint (random weights, block 32, {SIZE['n_experts']} experts, capacity 6), "
            f"{len(PROMPT)}-token prompt, {GEN} tokens\n"
        )
        decoders(model, tokenizer)
    expert_bytes()


if __name__ == "__main__":
    main()
