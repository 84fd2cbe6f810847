"""Training throughput: mlx_lm_diffusion.lora's step against mlx_lm.lora's on the same backbone.

A LLaDA (bidirectional Llama layers) and an mlx-lm llama of the same shape, each with
mlx-lm's LoRA layers on every block, run the trainer's step (mlx_lm.tuner.trainer.train's:
value_and_grad of the loss, the Adam update, compiled with the model, optimizer and random
state) on the same batch: the LLaDA with its masked-diffusion objective
(mlx_lm_diffusion.training.objectives, noise drawn inside the step), the llama with mlx-lm's
default next-token loss. Side by side in one run, alternating; prints the tokens/s of each
(batch tokens through the model per second, best run) and the ratio diffusion / mlx-lm as
the median of back-to-back pairs (goal >= 0.9x).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/lora_throughput.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from checkpoints_ar import write_causal  # noqa: E402

import mlx_lm_diffusion as mld  # noqa: E402
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


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ar_path = write_causal(Path(tmp) / "llama", "llama", hidden_size=256, intermediate_size=768,
                               num_hidden_layers=4)
        dllm_path = write_llada(Path(tmp) / "llada", d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, mlp=768)
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
    print(f"batch {BATCH} x {LENGTH + 1} tokens, LoRA rank {LORA['rank']} on every block, hidden 256, 4 layers")
    print(f"{'mlx_lm.lora tok/s':>18} {'diffusion tok/s':>16} {'ratio (median)':>15} {'ratio (best)':>13}")
    print(f"{tokens / best_theirs:18.0f} {tokens / best_ours:16.0f} {statistics.median(ratios):14.2f}x "
          f"{best_theirs / best_ours:12.2f}x")


if __name__ == "__main__":
    main()
