"""Train the demo model: a small LLaDA-architecture model on `a+b=` addition.

    python -m mlx_lm_diffusion.demo.train --out DIR [--steps N] [--seed S] ...

Masked-diffusion objective as in LLaDA's SFT: per sequence a mask ratio t ~ U(0, 1),
generated positions (answer and EOS padding; never the prompt) masked at that ratio,
cross-entropy on the masked positions weighted by 1/t, summed and divided by the
generated length, averaged over the batch (`mask_batch` has the two masking variants).
Problems are generated on the fly from a seeded stream that never yields a held-out
pair. Training is deterministic for a seed: the same command gives the same loss curve.

The checkpoint is written in the Hugging Face LLaDA layout (`model.transformer.*`,
config model_type "llada") with a character-level tokenizer, so `load()` reads it
like any other LLaDA checkpoint; recipe.json beside it records the command, seed,
configuration, wall time and final metrics; generation_config.json carries the model's
decoding defaults (block_length, steps per block, strategy, max_new_tokens) and
tokenizer_config.json a chat template that renders the last user message as is.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from functools import partial
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from model_adapters import llada

from .problems import GEN_LENGTH, held_out_problems, training_batch
from .vocab import EOS_ID, MASK_ID, VOCAB_SIZE, write_tokenizer

MASK_EPS = 1e-3  # LLaDA's minimum mask probability
# The decoding defaults written to generation_config.json (DecodeOptions field names;
# steps are denoising steps per block; max_new_tokens is the length when none is asked:
# the trained canvas, the only length this model answers right at).
GENERATION_DEFAULTS = {"block_length": GEN_LENGTH, "steps": GEN_LENGTH, "strategy": "low_confidence",
                       "max_new_tokens": GEN_LENGTH}


def model_config(d_model: int, n_layers: int, n_heads: int, mlp: int, rope_theta: float = 10000.0,
                 max_len: int = 512) -> dict:
    """config.json of the demo model, in the Hugging Face LLaDA format."""
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "d_model": d_model,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_heads,
        "mlp_hidden_size": mlp,
        "vocab_size": VOCAB_SIZE,
        "embedding_size": VOCAB_SIZE,
        "rope_theta": rope_theta,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": max_len,
        "weight_tying": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "mask_token_id": MASK_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
    }


def build_model(config: dict) -> llada.Model:
    model = llada.Model(llada.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def mask_batch(rng: np.random.Generator, prompts: np.ndarray, targets: np.ndarray,
               masking: str = "count"):
    """Noised inputs (B, P + L), the masked positions (B, L) and their 1/t weights (B,).

    t is uniform per sequence, stratified over the batch (MDLM's low-discrepancy
    sampler). "bernoulli" (LLaDA): each generated position is masked with probability
    p = (1 - eps) t + eps, weight 1/p. "count": exactly k = max(1, ceil(t L)) positions
    are masked, weight L/k (one over the ratio actually masked): no row without a mask,
    no rare row with a huge weight."""
    B, L = targets.shape
    t = rng.permutation((rng.random() + np.arange(B) / B) % 1.0)
    if masking == "count":
        k = np.maximum(1, np.ceil(t * L)).astype(np.int64)
        ranks = rng.random((B, L)).argsort(axis=1).argsort(axis=1)
        masked = ranks < k[:, None]
        p = k / L
    elif masking == "bernoulli":
        p = (1 - MASK_EPS) * t + MASK_EPS
        masked = rng.random((B, L)) < p[:, None]
    else:
        raise ValueError(f"masking must be 'bernoulli' or 'count', got {masking!r}")
    noised = np.where(masked, MASK_ID, targets)
    inputs = np.concatenate([prompts, noised], axis=1).astype(np.int32)
    return inputs, masked, (1.0 / p).astype(np.float32)


def diffusion_loss(model: nn.Module, inputs, targets, masked, weights) -> mx.array:
    """Masked-diffusion loss: weighted CE on masked generated positions / generated length."""
    L = targets.shape[1]
    logits = model(inputs)[:, -L:]
    ce = nn.losses.cross_entropy(logits, targets, reduction="none")
    per_row = mx.sum(ce * masked, axis=1) * weights / L
    return mx.mean(per_row)


def hf_weights(model: nn.Module) -> dict:
    """The model's weights under the Hugging Face LLaDA names (inverse of `sanitize`)."""
    inverse_block = {v: k for k, v in llada._BLOCK_RENAMES.items()}
    inverse_top = {v: k for k, v in llada._TOP_RENAMES.items()}
    out = {}
    for name, value in tree_flatten(model.parameters()):
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            local = ".".join(parts[3:-1])
            out[f"model.transformer.blocks.{parts[2]}.{inverse_block[local]}.{parts[-1]}"] = value
            continue
        for mlx_prefix, hf_prefix in inverse_top.items():
            if name.startswith(mlx_prefix):
                out[hf_prefix + name[len(mlx_prefix):]] = value
                break
        else:
            raise KeyError(f"no Hugging Face name for {name}")
    return out


def save_checkpoint(model: nn.Module, config: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), hf_weights(model), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_generation_config(out)
    write_tokenizer(out)


def write_generation_config(out: Path) -> None:
    """generation_config.json: the model's decoding defaults and its special token ids."""
    generation = {**GENERATION_DEFAULTS, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "mask_token_id": MASK_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def lr_schedule(lr: float, steps: int, warmup: int):
    warmup = max(1, min(warmup, steps // 2))
    return optim.join_schedules(
        [optim.linear_schedule(lr / warmup, lr, warmup),
         optim.cosine_decay(lr, max(steps - warmup, 1), lr * 0.05)],
        [warmup],
    )


class Progress:
    """One line every `every` steps: loss (running mean), tokens/s, elapsed and ETA."""

    def __init__(self, steps: int, every: int, stream=sys.stderr):
        self.steps, self.every, self.stream = steps, every, stream
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()
        self.losses: list[float] = []
        self.tokens = 0

    def update(self, step: int, loss: float, tokens: int) -> None:
        self.losses.append(loss)
        self.tokens += tokens
        if step % self.every and step != self.steps:
            return
        elapsed = time.perf_counter() - self.start
        recent = float(np.mean(self.losses[-self.every:]))
        eta = elapsed / step * (self.steps - step)
        print(
            f"step {step:5d}/{self.steps}  loss {recent:.4f}  {self.tokens / elapsed:8.0f} tok/s  "
            f"elapsed {_clock(elapsed)}  ETA {_clock(eta)}",
            file=self.stream, flush=True,
        )


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m:d}:{s:02d}"


def train(
    out: Optional[Path],
    steps: int = 5000,
    seed: int = 0,
    batch_size: int = 128,
    lr: float = 3e-3,
    warmup: int = 100,
    weight_decay: float = 0.01,
    clip: float = 1.0,
    masking: str = "count",
    d_model: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    mlp: int = 256,
    rope_theta: float = 100.0,
    log_every: int = 50,
    eval_every: int = 0,
    eval_size: int = 256,
    command: Optional[str] = None,
) -> dict:
    """Train and (when `out` is given) save; returns the run's record (recipe.json)."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    config = model_config(d_model, n_layers, n_heads, mlp, rope_theta)
    model = build_model(config)
    optimizer = optim.AdamW(learning_rate=lr_schedule(lr, steps, warmup), weight_decay=weight_decay)
    loss_and_grad = nn.value_and_grad(model, diffusion_loss)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(inputs, targets, masked, weights):
        loss, grads = loss_and_grad(model, inputs, targets, masked, weights)
        if clip:  # the 1/p weights make rare, very large gradients
            grads, _ = optim.clip_grad_norm(grads, clip)
        optimizer.update(model, grads)
        return loss

    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"demo model: {n_params / 1e6:.2f}M parameters, {steps} steps of {batch_size}, seed {seed}",
          file=sys.stderr, flush=True)
    progress = Progress(steps, log_every)
    losses = []
    for step in range(1, steps + 1):
        batch = training_batch(rng, batch_size)
        inputs, masked, weights = mask_batch(rng, batch.prompts, batch.targets, masking)
        loss = step_fn(mx.array(inputs), mx.array(batch.targets), mx.array(masked), mx.array(weights))
        mx.eval(state, loss)
        losses.append(loss.item())
        progress.update(step, losses[-1], inputs.size)
        if eval_every and step % eval_every == 0 and step < steps:
            print(f"  held-out exact match ({eval_size}): {_accuracy(model, eval_size):.3f}",
                  file=sys.stderr, flush=True)
    wall = time.perf_counter() - progress.start
    cpu = time.process_time() - progress.cpu_start

    record = {
        "command": command,
        "seed": seed,
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "clip": clip,
        "masking": masking,
        "parameters": n_params,
        "train_wall_seconds": round(wall, 1),
        "train_cpu_seconds": round(cpu, 1),  # all threads; > wall when both cores work
        "final_loss": float(np.mean(losses[-log_every:])),
    }
    if out is not None:
        save_checkpoint(model, config, out)
    return {"record": record, "model": model, "losses": losses}


def _accuracy(model: nn.Module, n: int) -> float:
    from .evaluate import evaluate

    return evaluate(model, None, held_out_problems(n)).accuracy  # EOS comes from the config


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mlx_lm_diffusion.demo.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="Checkpoint directory to write")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="Gradient-norm clip (0: off)")
    p.add_argument("--masking", choices=("bernoulli", "count"), default="count",
                   help="Per-position masks with probability t, or exactly ceil(t L) masks")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=256)
    p.add_argument("--rope-theta", type=float, default=100.0,
                   help="RoPE base: small, so that positions a few tokens apart are told apart")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0, help="Held-out check every N steps (0: off)")
    p.add_argument("--eval-size", type=int, default=512, help="Held-out problems for the final metrics")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "python -m mlx_lm_diffusion.demo.train " + shlex.join(argv)
    run = train(
        args.out, steps=args.steps, seed=args.seed, batch_size=args.batch_size, lr=args.lr,
        warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip, masking=args.masking, d_model=args.d_model,
        n_layers=args.n_layers, n_heads=args.n_heads, mlp=args.mlp, rope_theta=args.rope_theta, log_every=args.log_every,
        eval_every=args.eval_every, command=command,
    )
    record = run["record"]
    record.update(final_metrics(args.out, args.eval_size))
    (args.out / "recipe.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


def final_metrics(path: Path, n: int) -> dict:
    """Held-out exact match of the saved checkpoint at the demo defaults and at threshold 0.9."""
    from .. import load
    from .evaluate import evaluate

    model, tokenizer = load(str(path))
    pairs = held_out_problems(n)
    default = evaluate(model, tokenizer, pairs)
    fast = evaluate(model, tokenizer, pairs, threshold=0.9)
    return {
        "held_out_problems": n,
        "default_decoding": {"max_tokens": GEN_LENGTH, "block_length": GEN_LENGTH,
                             "steps": GEN_LENGTH, "strategy": "low_confidence"},
        "held_out_exact_match": round(default.accuracy, 4),
        "held_out_tokens_per_forward": round(default.tokens_per_forward, 3),
        "threshold_0.9_exact_match": round(fast.accuracy, 4),
        "threshold_0.9_tokens_per_forward": round(fast.tokens_per_forward, 3),
    }


if __name__ == "__main__":
    sys.exit(main())
