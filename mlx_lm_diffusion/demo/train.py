"""Train the demo model: a small LLaDA-architecture model on `a+b=` addition.

    python -m mlx_lm_diffusion.demo.train --out DIR [--steps N] [--seed S] ...

Masked-diffusion objective as in LLaDA's SFT: per sequence a mask ratio t ~ U(0, 1),
generated positions (answer, EOS and the EOS padding to the end of the canvas; an
infill's middle; never the prompt nor an infill's suffix) masked at that ratio,
cross-entropy on the masked positions (`mask_batch` has the masking variants and the
weights). Every step draws a form of the task, an operand sampler and a generated
length (`step_plan`; problems.FORMS, SAMPLERS, GEN_LENGTHS) and as many rows as fit a
token budget. Problems are generated on the fly from a seeded stream that never yields
a held-out pair. Training is deterministic for a seed: the same command gives the same
loss curve.

The checkpoint is written in the Hugging Face LLaDA layout (`model.transformer.*`,
config model_type "llada") with a character-level tokenizer, so `load()` reads it
like any other LLaDA checkpoint; recipe.json beside it records the command, seed,
configuration, wall time and final metrics; generation_config.json carries the model's
decoding defaults (block_length, steps per block, strategy, max_new_tokens) and
tokenizer_config.json a chat template that renders the last user message as is, so a
chat prompt equals the raw prompt "357+468=".
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

from mlx_lm_diffusion.demo.evaluate import SETS, evaluate, metrics
from mlx_lm_diffusion.demo.problems import (
    CONTEXT,
    FILL_CONTEXT,
    FORM_WEIGHTS,
    FORMS,
    GEN_LENGTH,
    GEN_LENGTHS,
    GEN_WEIGHTS,
    JSON_ANSWER,
    JSON_PROMPT_MAX,
    MIDDLES,
    PROMPT_MAX,
    SAMPLER_WEIGHTS,
    SAMPLERS,
    canvas_batch,
)
from mlx_lm_diffusion.demo.vocab import EOS_ID, MASK_ID, VOCAB_SIZE, write_tokenizer
from mlx_lm_diffusion.flags import one_line_errors
from model_adapters.families import llada

MASK_EPS = 1e-3  # LLaDA's minimum mask probability


# The decoding defaults written to generation_config.json (DecodeOptions field names;
# steps are denoising steps per block; max_new_tokens is the length when none is asked).
# Blocks of 8 (the 5 answer slots and EOS fit the first), one token per step; with EOS in
# the final prefix the decode stops, so a long max_tokens costs no extra forwards.
GENERATION_DEFAULTS = {"block_length": 8, "steps": 8, "strategy": "low_confidence", "max_new_tokens": 32}


def model_config(
    d_model: int, n_layers: int, n_heads: int, mlp: int, rope_theta: float = 10000.0, max_len: int = CONTEXT
) -> dict:
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


def mask_batch(
    rng: np.random.Generator,
    batch,
    masking: str = "count",
    suffix: float = 0.5,
    suffix_span: int = 16,
    pad_weight: int = 32,
):
    """Noised inputs (B, T), targets (B, T) and per-position loss weights (B, T).

    Only generated positions (after each row's prompt) are masked. t is uniform per
    sequence, stratified over the batch (MDLM's low-discrepancy sampler). "bernoulli"
    (LLaDA): each generated position is masked with probability p = (1 - eps) t + eps.
    "count": exactly k = max(1, ceil(t L)) of the L generated positions are masked: no
    row without a mask, no rare row with a huge weight. With probability `suffix` a row
    is instead masked as a semi-autoregressive decode sees it: every position from a cut
    c (uniform in 0..suffix_span) on is masked, and ceil(t c) of those before it.

    Weights: a row's masked positions share weight 1 (the loss is the mean cross-entropy
    over them; for "count" that is LLaDA's 1/t weighting over L), except that the EOS
    padding after the answer's own EOS counts for at most `pad_weight` positions in all,
    so that a long canvas does not drown the digits in padding."""
    tokens, P = batch.tokens, batch.prompt_len
    B, T = tokens.shape
    pos = np.arange(T)[None, :] - P[:, None]  # position in the generated region (< 0: prompt)
    L = batch.gen_len.astype(np.float64)
    gen = (pos >= 0) & (pos < batch.gen_len[:, None])  # (an infill's suffix after it: never masked)
    t = rng.permutation((rng.random() + np.arange(B) / B) % 1.0)
    keys = np.where(gen, rng.random((B, T)), np.inf)
    if masking == "count":
        k = np.maximum(1, np.ceil(t * L)).astype(np.int64)
        ranks = keys.argsort(axis=1).argsort(axis=1)
        masked = ranks < k[:, None]
    elif masking == "bernoulli":
        p = (1 - MASK_EPS) * t + MASK_EPS
        masked = gen & (keys < p[:, None])
    else:
        raise ValueError(f"masking must be 'bernoulli' or 'count', got {masking!r}")
    if suffix > 0:
        cut = rng.integers(0, suffix_span + 1, size=B)
        before = gen & (pos < cut[:, None])
        kb = np.ceil(t * np.minimum(cut, L)).astype(np.int64)
        ranks_b = np.where(before, keys, np.inf).argsort(axis=1).argsort(axis=1)
        semi = (gen & (pos >= cut[:, None])) | (before & (ranks_b < kb[:, None]))
        semi |= gen & (pos == L.astype(np.int64)[:, None] - 1)  # never an empty mask
        masked = np.where((rng.random(B) < suffix)[:, None], semi, masked)
    padding = gen & (pos >= batch.answer_len[:, None])
    n_pad = np.maximum(1, (masked & padding).sum(axis=1))
    w = np.where(padding, np.minimum(1.0, pad_weight / n_pad)[:, None], 1.0) * masked
    w = w / np.maximum(w.sum(axis=1, keepdims=True), 1e-9) / B
    inputs = np.where(masked, MASK_ID, tokens).astype(np.int32)
    return inputs, tokens, w.astype(np.float32)


def diffusion_loss(model: nn.Module, inputs, targets, weights) -> mx.array:
    """Masked-diffusion loss: cross-entropy at the masked positions, weighted (see mask_batch)."""
    ce = nn.losses.cross_entropy(model(inputs), targets, reduction="none")
    return mx.sum(ce * weights)


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
                out[hf_prefix + name[len(mlx_prefix) :]] = value
                break
        else:
            raise KeyError(f"no Hugging Face name for {name}")
    return out


def save_checkpoint(model: nn.Module, config: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), hf_weights(model), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {**GENERATION_DEFAULTS, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "mask_token_id": MASK_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(out, model_max_length=config["max_sequence_length"])


def expanded_weights(weights: dict, after: Sequence[int], fresh: nn.Module) -> dict:
    """A checkpoint's weights (Hugging Face names) with a new block inserted after each of
    the blocks `after` names (LLaMA Pro's block expansion, Wu et al. 2024): the new blocks
    take `fresh`'s random weights with their residual outputs (attn_out, ff_out) zeroed,
    so the grown model computes exactly what the checkpoint computes, and training starts
    from it with more depth."""
    prefix = "model.transformer.blocks."
    old = sorted({int(k[len(prefix) :].split(".")[0]) for k in weights if k.startswith(prefix)})
    if not set(after) <= set(old):
        raise ValueError(f"--insert-blocks {list(after)}: the checkpoint has blocks {old[0]}-{old[-1]}")
    source: list = []  # per block of the grown model: the checkpoint's block, or None (new)
    for i in old:
        source += [i] + [None] * list(after).count(i)
    new = hf_weights(fresh)
    if len(source) != len({k.split(".")[3] for k in new if k.startswith(prefix)}):
        raise ValueError(f"--n-layers must be the checkpoint's {len(old)} blocks plus the {len(after)} inserted")
    out = {k: v for k, v in weights.items() if not k.startswith(prefix)}
    for k, v in new.items():
        if not k.startswith(prefix):
            continue
        j, name = k[len(prefix) :].split(".", 1)
        i = source[int(j)]
        if i is not None:
            out[k] = weights[f"{prefix}{i}.{name}"]
        else:
            out[k] = mx.zeros_like(v) if name in ("attn_out.weight", "ff_out.weight") else v
    return out


def lr_schedule(lr: float, steps: int, warmup: int):
    warmup = max(1, min(warmup, steps // 2))
    return optim.join_schedules(
        [optim.linear_schedule(lr / warmup, lr, warmup), optim.cosine_decay(lr, max(steps - warmup, 1), lr * 0.05)],
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
        recent = float(np.mean(self.losses[-self.every :]))
        eta = elapsed / step * (self.steps - step)
        print(
            f"step {step:5d}/{self.steps}  loss {recent:.4f}  {self.tokens / elapsed:8.0f} tok/s  "
            f"elapsed {_clock(elapsed)}  ETA {_clock(eta)}",
            file=self.stream,
            flush=True,
        )


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m:d}:{s:02d}"


def _draw(rng: np.random.Generator, values, weights, size: int) -> np.ndarray:
    p = np.asarray(weights, np.float64)
    if len(values) == 0 or p.sum() == 0:  # (a form never drawn)
        return np.zeros(size, np.int64)
    return rng.choice(np.asarray(values), size=size, p=p / p.sum())


def step_plan(
    rng: np.random.Generator,
    steps: int,
    gen_lengths=GEN_LENGTHS,
    gen_weights=GEN_WEIGHTS,
    form_weights=FORM_WEIGHTS,
    sampler_weights=SAMPLER_WEIGHTS,
    middles: Sequence[int] = MIDDLES,
) -> list:
    """(form, sampler, generated length) of every step, fixed by the seed. A json step
    takes a length that holds its answer (and fits the context); an infill step a middle
    of one of `middles` slots (default MIDDLES: 4 to 16), uniformly."""
    if len(gen_lengths) != len(gen_weights):
        raise ValueError("gen_lengths and gen_weights must have the same length")
    if not 0 < len(sampler_weights) <= len(SAMPLERS):
        raise ValueError(f"sampler_weights: 1 to {len(SAMPLERS)} weights ({', '.join(SAMPLERS)})")
    # (the samplers left out weigh 0: the four-weight commands of the stages before
    # sum_lengths draw the very stream they drew)
    sampler_weights = [*sampler_weights, *[0.0] * (len(SAMPLERS) - len(sampler_weights))]
    forms = _draw(rng, FORMS, form_weights, steps)
    samplers = _draw(rng, SAMPLERS, sampler_weights, steps)
    plain = [g for g in gen_lengths if g + PROMPT_MAX <= CONTEXT]
    json = [g for g in gen_lengths if g == FILL_CONTEXT or (JSON_ANSWER < g and g + JSON_PROMPT_MAX <= CONTEXT)]
    gens = {
        "plain": _draw(rng, plain, [w for g, w in zip(gen_lengths, gen_weights) if g in plain], steps),
        "json": _draw(rng, json, [w for g, w in zip(gen_lengths, gen_weights) if g in json], steps),
        # (an index draw: the default gives the very stream the stages before --middles drew)
        "infill": np.asarray(middles)[rng.integers(0, len(middles), size=steps)],
    }
    return [(str(f), str(s), int(gens[f][i])) for i, (f, s) in enumerate(zip(forms, samplers))]


def train(
    out: Optional[Path],
    steps: int = 3000,
    seed: int = 0,
    batch_tokens: int = 2048,
    lr: float = 3e-3,
    warmup: int = 100,
    weight_decay: float = 0.01,
    clip: float = 1.0,
    masking: str = "count",
    suffix: float = 0.5,
    pad_weight: int = 32,
    d_model: int = 64,
    n_layers: int = 4,
    n_heads: int = 4,
    mlp: int = 256,
    rope_theta: float = 500.0,
    gen_lengths: Sequence[int] = GEN_LENGTHS,
    gen_weights: Sequence[float] = GEN_WEIGHTS,
    form_weights: Sequence[float] = FORM_WEIGHTS,
    sampler_weights: Sequence[float] = SAMPLER_WEIGHTS,
    middles: Sequence[int] = MIDDLES,
    log_every: int = 50,
    eval_every: int = 0,
    eval_size: int = 256,
    init: Optional[Path] = None,
    insert_blocks: Sequence[int] = (),
    command: Optional[str] = None,
) -> dict:
    """Train and (when `out` is given) save; returns the run's record (recipe.json).

    Each step draws a form, a sampler and a generated length (`step_plan`) and
    batch_tokens // T rows (at least 8) on canvases of T positions."""
    if insert_blocks and init is None:
        raise ValueError("--insert-blocks grows the --init checkpoint: give --init")
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    config = model_config(d_model, n_layers, n_heads, mlp, rope_theta)
    model = build_model(config)
    if init is not None:  # continue from a checkpoint of the same shape, or grown (a next stage)
        weights = mx.load(str(Path(init) / "model.safetensors"))
        if insert_blocks:  # a deeper model that starts as the checkpoint's function
            weights = expanded_weights(weights, insert_blocks, model)
        model.load_weights(list(model.sanitize(weights).items()))
        mx.eval(model.parameters())
    optimizer = optim.AdamW(learning_rate=lr_schedule(lr, steps, warmup), weight_decay=weight_decay)
    loss_and_grad = nn.value_and_grad(model, diffusion_loss)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(inputs, targets, weights):
        loss, grads = loss_and_grad(model, inputs, targets, weights)
        if clip:
            grads, _ = optim.clip_grad_norm(grads, clip)
        optimizer.update(model, grads)
        return loss

    plan = step_plan(rng, steps, gen_lengths, gen_weights, form_weights, sampler_weights, middles)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(
        f"demo model: {n_params / 1e6:.2f}M parameters, {steps} steps of ~{batch_tokens} tokens, seed {seed}",
        file=sys.stderr,
        flush=True,
    )
    progress = Progress(steps, log_every)
    losses = []
    for step in range(1, steps + 1):
        form, sampler, gen = plan[step - 1]
        # (about: for the row count; FILL_CONTEXT fills the context)
        T = CONTEXT if gen == FILL_CONTEXT else (JSON_PROMPT_MAX if form == "json" else PROMPT_MAX) + gen
        batch = canvas_batch(rng, max(8, batch_tokens // T), gen, form, sampler)
        inputs, targets, weights = mask_batch(rng, batch, masking, suffix=suffix, pad_weight=pad_weight)
        loss = step_fn(mx.array(inputs), mx.array(targets), mx.array(weights))
        mx.eval(state, loss)
        losses.append(loss.item())
        progress.update(step, losses[-1], inputs.size)
        if eval_every and step % eval_every == 0 and step < steps:
            if out is not None:  # a snapshot to look at (and to fall back on) while training runs
                save_checkpoint(model, config, out / "snapshots" / f"step{step}")
            for name, n in (
                ("held-out", 5),
                ("held-out", GEN_LENGTH),
                ("held-out", 512),
                ("carry chains", GEN_LENGTH),
                ("json", 16),
                ("json", 512),
                ("infill", 4),
                ("infill", 8),
            ):  # 512: capped to the context
                exact, slots = _accuracy(model, eval_size, n, name)
                print(
                    f"  {name} exact match ({eval_size}, max_tokens {n}): {exact:.3f}  per answer slot: "
                    + " ".join(f"{x:.2f}" for x in slots),
                    file=sys.stderr,
                    flush=True,
                )
    wall = time.perf_counter() - progress.start
    cpu = time.process_time() - progress.cpu_start

    record = {
        "command": command,
        "init": None if init is None else str(init),
        "insert_blocks": [int(i) for i in insert_blocks],
        "seed": seed,
        "steps": steps,
        "batch_tokens": batch_tokens,
        "gen_lengths": [int(g) for g in gen_lengths],
        "gen_weights": [float(w) for w in gen_weights],
        "form_weights": [float(w) for w in form_weights],
        "sampler_weights": [float(w) for w in sampler_weights],
        "middles": [int(m) for m in middles],
        "lr": lr,
        "warmup": warmup,
        "weight_decay": weight_decay,
        "clip": clip,
        "masking": masking,
        "suffix": suffix,
        "pad_weight": pad_weight,
        "parameters": n_params,
        "train_wall_seconds": round(wall, 1),
        "train_cpu_seconds": round(cpu, 1),  # all threads; > wall when both cores work
        "final_loss": float(np.mean(losses[-log_every:])) if losses else None,  # (--steps 0: none)
    }
    if out is not None:
        save_checkpoint(model, config, out)
    return {"record": record, "model": model, "losses": losses}


def _accuracy(model: nn.Module, n: int, max_tokens: int = GEN_LENGTH, problems: str = "held-out") -> tuple:
    """Exact match and per-slot accuracy on a set of `evaluate.SETS` at the demo's default decoding."""
    # EOS comes from the config; the decoding as generation_config.json will say
    pairs, form = SETS[problems](n)
    r = evaluate(
        model,
        None,
        pairs,
        max_tokens=max_tokens,
        form=form,
        block_length=GENERATION_DEFAULTS["block_length"],
        steps=GENERATION_DEFAULTS["steps"],
    )
    return r.accuracy, r.slot_accuracy


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = one_line_errors(
        argparse.ArgumentParser(prog="python -m mlx_lm_diffusion.demo.train", description=__doc__.split("\n\n")[0])
    )
    p.add_argument("--out", type=Path, required=True, help="Checkpoint directory to write")
    p.add_argument(
        "--steps",
        type=int,
        default=3000,
        help="Training steps (0: write the --init checkpoint, grown by --insert-blocks, untrained)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=2048,
        help="Tokens per step: batch_tokens // canvas length rows (at least 8)",
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0, help="Gradient-norm clip (0: off)")
    p.add_argument(
        "--masking",
        choices=("bernoulli", "count"),
        default="count",
        help="Per-position masks with probability t, or exactly ceil(t L) masks",
    )
    p.add_argument(
        "--suffix", type=float, default=0.5, help="Share of rows masked as a block decode sees them: all from a cut on"
    )
    p.add_argument(
        "--pad-weight", type=int, default=32, help="The EOS padding of a row counts for at most this many positions"
    )
    p.add_argument(
        "--gen-lengths",
        type=int,
        nargs="+",
        default=list(GEN_LENGTHS),
        help="Generated lengths of the training canvases (after the prompt; 0: the rest of the context)",
    )
    p.add_argument(
        "--gen-weights",
        type=float,
        nargs="+",
        default=list(GEN_WEIGHTS),
        help="How often each generated length is drawn (relative)",
    )
    p.add_argument(
        "--form-weights",
        type=float,
        nargs=3,
        default=list(FORM_WEIGHTS),
        help="How often each form (plain, json, infill) is drawn (relative)",
    )
    p.add_argument(
        "--sampler-weights",
        type=float,
        nargs="+",
        default=list(SAMPLER_WEIGHTS),
        help="How often each operand sampler (%s) is drawn (relative; those left out: 0)" % ", ".join(SAMPLERS),
    )
    p.add_argument(
        "--middles",
        type=int,
        nargs="+",
        default=list(MIDDLES),
        help="Middle lengths of the infill form's canvases, drawn uniformly",
    )
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=256)
    p.add_argument(
        "--rope-theta",
        type=float,
        default=500.0,
        help="RoPE base: small, so that positions a few tokens apart are told apart, "
        "yet the slowest rotation spans the whole context",
    )
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=0, help="Held-out check every N steps (0: off)")
    p.add_argument("--eval-size", type=int, default=512, help="Held-out problems for the final metrics")
    p.add_argument("--init", type=Path, help="Start from this checkpoint's weights (same shape)")
    p.add_argument(
        "--insert-blocks",
        type=int,
        nargs="+",
        default=[],
        metavar="AFTER",
        help="With --init: a new block after each of these blocks of the checkpoint, its residual "
        "output zeroed (the same function, more depth); --n-layers counts them",
    )
    p.add_argument("--no-final-metrics", action="store_true", help="Skip the final held-out evaluation")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = "python -m mlx_lm_diffusion.demo.train " + shlex.join(argv)
    run = train(
        args.out,
        steps=args.steps,
        seed=args.seed,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        clip=args.clip,
        masking=args.masking,
        suffix=args.suffix,
        pad_weight=args.pad_weight,
        gen_lengths=args.gen_lengths,
        gen_weights=args.gen_weights,
        form_weights=args.form_weights,
        sampler_weights=args.sampler_weights,
        middles=args.middles,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        mlp=args.mlp,
        rope_theta=args.rope_theta,
        log_every=args.log_every,
        eval_every=args.eval_every,
        init=args.init,
        insert_blocks=args.insert_blocks,
        command=command,
    )
    record = run["record"]
    if not args.no_final_metrics:
        record.update(final_metrics(args.out, args.eval_size))
    (args.out / "recipe.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


def final_metrics(path: Path, n: int) -> dict:
    """Held-out exact match of the saved checkpoint at its defaults and at threshold 0.9,
    at max_tokens 8, 64 and 512 (`evaluate.metrics`)."""
    return metrics(path, n)


if __name__ == "__main__":
    sys.exit(main())
