"""Training throughput: mlx_lm_diffusion.lora's step against mlx_lm.lora's on the same backbone.

Two pairs of the same backbone shape: a LLaDA (bidirectional Llama layers) and an mlx-lm
llama; an SDAR (block-causal Qwen3 layers, blocks of 4) and an mlx-lm qwen3. Each model gets
mlx-lm's LoRA layers on every block and runs the trainer's step (mlx_lm.tuner.trainer.train's:
value_and_grad of the loss, the Adam update, compiled with the model, optimizer and random
state) on the same batch: the diffusion model with its family's objective
(mlx_lm_diffusion.training.objectives, noise drawn inside the step), the autoregressive one
with mlx-lm's default next-token loss. Side by side in one run, alternating; prints the
tokens/s of each (batch tokens through the model per second, best run) and the ratio
diffusion / mlx-lm as the median of back-to-back pairs and of the best runs (goal >= 0.9x).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/lora_throughput.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.testing.block_checkpoints import write_sdar  # noqa: E402
from mlx_lm_diffusion.testing.causal_checkpoints import write_causal  # noqa: E402
from mlx_lm_diffusion.testing.checkpoints import write_llada  # noqa: E402
from mlx_lm_diffusion.training.objectives import objective_for  # noqa: E402
from model_adapters import adapter_for  # noqa: E402

BATCH, LENGTH, STEPS, PAIRS = 8, 128, 10, 7
LORA = {"rank": 8, "dropout": 0.0, "scale": 20.0}


def make_step(model, loss):
    """mlx_lm.tuner.trainer.train's compiled step (without gradient accumulation)."""
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), LORA)
    model.train()
    optimizer = optim.Adam(learning_rate=1e-5)
    value_and_grad = nn.value_and_grad(model, loss)
    state = [model.state, optimizer.state, mx.random.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(batch, lengths):
        (value, tokens), grad = value_and_grad(model, batch, lengths)
        optimizer.update(model, grad)
        return value, tokens

    def run(batch, lengths):
        for _ in range(STEPS):
            value, tokens = step(batch, lengths)
            mx.eval(state, value, tokens)

    return run


def timed(fn, *args) -> float:
    tic = time.perf_counter()
    fn(*args)
    return time.perf_counter() - tic


def rows(tmp: Path) -> list:
    """(name, AR checkpoint, diffusion checkpoint) of the same backbone shape."""
    shape = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4)
    return [
        (
            "LLaDA / llama",
            write_causal(tmp / "llama", "llama", **shape),
            write_llada(tmp / "llada", d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mlp=768),
        ),
        (
            "SDAR / qwen3",
            write_causal(tmp / "qwen3", "qwen3", head_dim=64, tie_word_embeddings=False, **shape),
            write_sdar(tmp / "sdar", hidden=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, inter=768),
        ),
    ]


def measure(ar_path: Path, dllm_path: Path) -> tuple:
    """(mlx-lm tok/s, diffusion tok/s, median ratio, best ratio) of one pair of models."""
    ar_model, _ = mld.load(str(ar_path), autoregressive=True)
    dllm_model, dllm_tok = mld.load(str(dllm_path))
    objective = objective_for(adapter_for(dllm_model, dllm_tok), "diffusion", "tokens")
    ours, theirs = make_step(dllm_model, objective), make_step(ar_model, default_loss)
    mx.random.seed(0)
    batch = mx.random.randint(0, 250, (BATCH, LENGTH + 1)).astype(mx.int32)  # (mlx-lm pads to 1 + 32k)
    lengths = mx.array([[0, LENGTH + 1]] * BATCH)
    ours(batch, lengths), theirs(batch, lengths)  # warm up: compile both
    ratios, best_ours, best_theirs = [], float("inf"), float("inf")
    for _ in range(PAIRS):
        t_theirs, t_ours = timed(theirs, batch, lengths), timed(ours, batch, lengths)
        ratios.append(t_theirs / t_ours)
        best_ours, best_theirs = min(best_ours, t_ours), min(best_theirs, t_theirs)
    tokens = STEPS * BATCH * (LENGTH + 1)
    return tokens / best_theirs, tokens / best_ours, statistics.median(ratios), best_theirs / best_ours


def main() -> None:
    print(f"batch {BATCH} x {LENGTH + 1} tokens, LoRA rank {LORA['rank']} on every block, hidden 256, 4 layers")
    print(
        f"{'models':14} {'mlx_lm.lora tok/s':>18} {'diffusion tok/s':>16} {'ratio (median)':>15} {'ratio (best)':>13}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, ar_path, dllm_path in rows(Path(tmp)):
            theirs, ours, median, best = measure(ar_path, dllm_path)
            print(f"{name:14} {theirs:18.0f} {ours:16.0f} {median:14.2f}x {best:12.2f}x")


if __name__ == "__main__":
    main()
