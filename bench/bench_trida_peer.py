"""Trida2.0's self-speculative decode: this package against trillion-labs/trida-stack's MLX port
(`trida_mlx`, Apache-2.0) on the same micro checkpoint, side by side in one run.

The peer's code is not part of this repository: put its `inference/mlx/trida_mlx/` package
(model.py, decode.py, kernels.py, __init__.py) under a directory and name it in TRIDA_STACK_MLX
(default /tmp/trida_peer, i.e. /tmp/trida_peer/trida_mlx/decode.py). Without it the bench says
so in one line and exits.

The checkpoints are bench_trida.py's: a micro Trida written by `write_trida` (hidden 256, 4 layers:
three gated-delta, one attention; untied head), random ("random": drafts rarely right) and with
every layer's output zeroed and a head that always proposes one token ("forced":
`force_bigram(forced=100)`, every draft right). Ours: `mlx_lm_diffusion.load` and
`stream_generate(block_length=N)`; the peer: `trida_mlx.model.load_model(dtype=float32)`,
`TridaRuntime` and its greedy `selfspec_generate(n=N, eos_ids=set(), mask_id=259)`. Both are
timed from the prompt's ids to the last token (prefill included), best of the back-to-back pairs
after a warm-up; the time ratio is ours / peer (median of the pairs, below 1: ours faster).
"identical": ours == peer == mlx-lm's greedy stream_generate on the same weights as a stock
qwen3_5 (over the tokens ours wrote: ours stops at an EOS id, the peer is given none; the prompt
is one where greedy decoding meets no EOS in 128 tokens, and a shorter decode is flagged).
Forwards, as each counts them: decode rounds, the prompt's pass not counted.

    TRIDA_STACK_MLX=/tmp/trida_peer \
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_trida_peer.py
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

PEER = Path(os.environ.get("TRIDA_STACK_MLX", "/tmp/trida_peer"))
TOKENS, PAIRS = 128, 5
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
PROMPT = "Hello world"  # (random weights: no EOS in 128 greedy tokens; "The quick brown fox..." meets one at 67)
MASK_ID = 259  # write_trida's mask (its block_diffusion.json)


def main():
    if not (PEER / "trida_mlx" / "decode.py").is_file():
        raise SystemExit(f"no trida-stack MLX port at {PEER}/trida_mlx (set TRIDA_STACK_MLX): nothing to compare")
    sys.path.insert(0, str(PEER))
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.testing.hybrid_checkpoints import force_bigram, trida_as_qwen3_5, write_trida
    from mlx_lm_diffusion.testing.speculative_race import ours as ours_of
    from mlx_lm_diffusion.testing.speculative_race import timed

    peer_model = importlib.import_module("trida_mlx.model")
    peer_decode = importlib.import_module("trida_mlx.decode")
    peer_kernels = importlib.import_module("trida_mlx.kernels")
    print(
        f"peer: {PEER / 'trida_mlx'} (fused Metal canvas kernel: {peer_kernels.fused_available()}), "
        f"device {mx.default_device()}, mlx-lm {mlx_lm.__version__}"
    )
    print(
        f"{'weights':8} {'N':>2} {'tokens':>6} {'fwd ours':>8} {'fwd peer':>8} {'tok/fwd ours':>12} "
        f"{'tok/fwd peer':>12} {'tok/s ours':>10} {'tok/s peer':>10} {'ours/peer':>9} identical"
    )
    for name, forced in (("random", None), ("forced", 100)):
        with tempfile.TemporaryDirectory() as tmp:
            path = write_trida(Path(tmp) / name, **SIZE)
            if forced is not None:
                force_bigram(path, forced=forced)
            model, tok = mld.load(str(path))
            peer, _, _ = peer_model.load_model(str(path), dtype=mx.float32)
            rt = peer_model.TridaRuntime(peer)
            stock, stock_tok = mlx_lm.load(str(trida_as_qwen3_5(path, Path(tmp) / "qwen3_5")))
            ids = tok.encode(PROMPT)
            ar = [
                r.token
                for r in mlx_lm.stream_generate(stock, stock_tok, ids, max_tokens=TOKENS, sampler=make_sampler(0.0))
            ]
            for strides in (2, 4, 8):
                ours = ours_of(model, tok, ids, TOKENS, block_length=strides)

                def theirs():
                    stats = peer_decode.DecodeStats()
                    chunks = peer_decode.selfspec_generate(
                        rt,
                        rt.make_cache(),
                        list(ids),
                        max_new_tokens=TOKENS,
                        eos_ids=set(),
                        sp=peer_decode.SamplingParams(temperature=0.0),
                        mask_id=MASK_ID,
                        n=strides,
                        stats=stats,
                    )
                    return [t for chunk in chunks for t in chunk], stats.forwards

                ours(), theirs()  # warm up
                runs = [(timed(ours), timed(theirs)) for _ in range(PAIRS)]
                ratio = statistics.median(o[0] / p[0] for o, p in runs)
                t_ours, t_peer = min(o[0] for o, _ in runs), min(p[0] for _, p in runs)
                (mine, fwd_ours), (their, fwd_peer) = runs[0][0][1], runs[0][1][1]
                n, n_peer = len(mine), len(their)
                common = min(n, len(ar))
                same = all(o[1] == runs[0][0][1] and p[1] == runs[0][1][1] for o, p in runs) and (
                    mine == their[:n] and mine[:common] == ar[:common]
                )
                flag = "" if n == n_peer == TOKENS else f" (ours {n}, peer {n_peer}, mlx-lm {len(ar)} tokens)"
                print(
                    f"{name:8} {strides:2} {n:6} {fwd_ours:8} {fwd_peer:8} {n / fwd_ours:12.2f} "
                    f"{n_peer / fwd_peer:12.2f} {n / t_ours:10.1f} {n_peer / t_peer:10.1f} {ratio:9.2f} "
                    f"{same}{flag}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
