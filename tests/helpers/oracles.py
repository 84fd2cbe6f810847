"""Independent oracles of the reference decoding loops, written from the algorithms.

Each oracle runs the reference loop literally (whole canvas through the model at
every step, batch 1, numpy/torch for the loop arithmetic) over the same MLX
forward, and counts forwards. One documented deviation is shared with the engine:
the mask token is never proposed (its logit is removed before the softmax).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def _logits(model, x: np.ndarray, mask_id: int) -> np.ndarray:
    logits = np.array(model(mx.array(x))).astype(np.float64)
    logits[..., mask_id] = -np.inf
    return logits


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64-safe form (every oracle and parity test uses this one)."""
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _seeded(prompt, gen_length, suffix, mask_id) -> np.ndarray:
    """The reference's starting canvas: prompt, gen_length masks, then the suffix (an
    infill: the loop then unmasks the middle only, the suffix stays as given)."""
    x = np.full((1, len(prompt) + gen_length + len(suffix)), mask_id, dtype=np.int64)
    x[0, : len(prompt)] = prompt
    x[0, len(prompt) + gen_length :] = suffix
    return x


def llada_generate(model, prompt, *, gen_length, block_length, steps, mask_id, suffix=()):
    """LLaDA's `generate` (remasking="low_confidence", temperature 0, no CFG), with
    `steps` denoising steps per block and a last block that may be shorter; `suffix`:
    the canvas ends with it (masks only in the middle span)."""
    P = len(prompt)
    x = _seeded(prompt, gen_length, suffix, mask_id)
    forwards = 0
    for start in range(P, P + gen_length, block_length):
        end = min(start + block_length, P + gen_length)
        n = int((x[0, start:end] == mask_id).sum())
        quota = [n // steps + (1 if i < n % steps else 0) for i in range(steps)]
        for i in range(steps):
            mask_index = x == mask_id
            logits = _logits(model, x, mask_id)
            forwards += 1
            x0 = logits.argmax(-1)
            x0_p = np.take_along_axis(softmax(logits), x0[..., None], -1)[..., 0]
            x0_p[:, end:] = -np.inf
            x0 = np.where(mask_index, x0, x)
            confidence = np.where(mask_index, x0_p, -np.inf)
            order = np.argsort(-confidence[0], kind="stable")[: quota[i]]
            x[0, order] = x0[0, order]
    return x[0, P:].tolist(), forwards


def dream_generate(model, prompt, *, max_new_tokens, steps, alg, mask_id, eps=1e-3, suffix=()):
    """Dream's `diffusion_generate` (temperature 0, alg in maskgit_plus / topk_margin /
    entropy, alg_temp 0): shifted logits, count int(M * (1 - s / t)); `suffix`: the
    canvas ends with it (masks only in the middle span)."""
    import torch

    P = len(prompt)
    x = _seeded(prompt, max_new_tokens, suffix, mask_id)
    timesteps = torch.linspace(1, eps, steps + 1)
    forwards = 0
    for i in range(steps):
        mask_index = x == mask_id
        logits = _logits(model, x, mask_id)
        forwards += 1
        logits = np.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
        probs = softmax(logits[mask_index])
        x0 = probs.argmax(-1)
        if alg == "maskgit_plus":
            confidence = probs.max(-1)
        elif alg == "topk_margin":
            top = -np.sort(-probs, axis=-1)
            confidence = top[:, 0] - top[:, 1]
        elif alg == "entropy":
            with np.errstate(divide="ignore"):
                confidence = np.sum(probs * np.log(probs + 1e-10), axis=-1)
        else:
            raise ValueError(alg)
        t, s = timesteps[i], timesteps[i + 1]
        num_mask = torch.tensor(float(mask_index.sum())) / 1
        count = int(num_mask * (1 - s / t)) if i < steps - 1 else int(num_mask)
        full = np.full(x.shape, -np.inf)
        full[mask_index] = confidence
        if count > 0:
            order = np.argsort(-full[0], kind="stable")[:count]
            proposal = np.full(x.shape, mask_id)
            proposal[mask_index] = x0
            x[0, order] = proposal[0, order]
    return x[0, P:].tolist(), forwards


def fast_dllm_threshold(model, prompt, *, gen_length, block_length, threshold, mask_id):
    """Fast-dLLM `generate` with a confidence threshold (no cache): per block, commit
    every masked position whose probability is >= threshold, or the single most
    confident one when none passes, until the block is full."""
    P = len(prompt)
    x = np.full((1, P + gen_length), mask_id, dtype=np.int64)
    x[0, :P] = prompt
    forwards = 0
    for start in range(P, P + gen_length, block_length):
        end = min(start + block_length, P + gen_length)
        while (x[0, start:end] == mask_id).any():
            logits = _logits(model, x, mask_id)
            forwards += 1
            probs = softmax(logits[0, start:end])
            x0, p = probs.argmax(-1), probs.max(-1)
            masked = x[0, start:end] == mask_id
            conf = np.where(masked, p, -np.inf)
            chosen = masked & (conf >= threshold)
            if not chosen.any():
                chosen[int(np.argmax(conf))] = True
            x[0, start:end] = np.where(chosen, x0, x[0, start:end])
    return x[0, P:].tolist(), forwards


def threshold_with_editing(
    model, prompt, *, gen_length, block_length, threshold, editing_threshold, max_post_steps, mask_id
):
    """The LLaDA2.1 editing loop (research note's reference, batch 1) over a full-canvas
    model: commit masks with p >= threshold (at least one), then overwrite committed
    block tokens whose new proposal differs with p > editing_threshold; a block ends
    with no mask and no edit, or after max_post_steps passes once it is full."""
    P = len(prompt)
    x = np.full((1, P + gen_length), mask_id, dtype=np.int64)
    x[0, :P] = prompt
    forwards = 0
    for start in range(P, P + gen_length, block_length):
        end = min(start + block_length, P + gen_length)
        post_steps = 0
        while True:
            masked = x[0, start:end] == mask_id
            has_mask = masked.any()
            if not has_mask:
                post_steps += 1
                if post_steps > max_post_steps:
                    break
            probs = softmax(_logits(model, x, mask_id)[0, start:end])
            forwards += 1
            x0, p = probs.argmax(-1), probs.max(-1)
            commit = masked & (p >= threshold)
            if has_mask and not commit.any():
                commit[int(np.argmax(np.where(masked, p, -np.inf)))] = True
            edit = ~masked & (x0 != x[0, start:end]) & (p > editing_threshold)
            x[0, start:end] = np.where(commit | edit, x0, x[0, start:end])
            if not has_mask and not edit.any():
                break
    return x[0, P:].tolist(), forwards


def greedy_ar(pair, ids: list, max_tokens: int) -> list:
    """mlx-lm's own greedy decode (`pair` = (model, tokenizer) loaded by mlx_lm.load): the oracle
    of every decoder that must be greedy autoregressive decoding token for token."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = pair
    return [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(0.0))
    ]


def decoded(pair, ids: list, max_tokens: int, **options) -> tuple:
    """(tokens, forwards) of this package's stream_generate over `pair` = (model, tokenizer)."""
    import mlx_lm_diffusion as mld

    model, tokenizer = pair
    tokens, last = [], None
    for last in mld.stream_generate(model, tokenizer, ids, max_tokens=max_tokens, **options):
        tokens.append(last.token)
    return tokens, last.forwards


def check_converted_copies(path, pair, out, module: str, prompt: str = "abc", max_tokens: int = 12) -> None:
    """A speculative family's checkpoint at `path` converted by mlx_lm_diffusion.convert (float, and
    4-bit under `out`): each copy loads as `module` and decodes, the float one the same tokens."""
    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.cli.convert import convert

    convert(str(path), str(out / "mlx"))
    convert(str(path), str(out / "q4"), quantize=True, q_bits=4)
    ids = pair[1].encode(prompt)
    expected, _ = decoded(pair, ids, max_tokens)
    for name in ("mlx", "q4"):
        copy = mld.load(str(out / name))
        assert type(copy[0]).__module__ == module
        tokens, forwards = decoded(copy, ids, max_tokens)
        assert 0 < len(tokens) <= max_tokens and forwards <= len(tokens) - 1
        if name == "mlx":
            assert tokens == expected


def check_ragged_batch(pair, prompts=("abc", "The quick brown fox jumps", "x y"), limits=(12, 7, 16)) -> None:
    """A row alone equals the row in a ragged batch (generate_batch of prompts of other lengths
    and other max_tokens), its end tokens aside."""
    import mlx_lm_diffusion as mld
    from model_adapters import adapter_for

    model, tokenizer = pair
    batch = mld.generate_batch(model, tokenizer, list(prompts), max_tokens=list(limits), return_token_ids=True)
    eos = adapter_for(model, tokenizer).eos_ids
    for prompt, limit, row in zip(prompts, limits, batch.token_ids):
        alone, _ = decoded(pair, tokenizer.encode(prompt), limit)
        assert row == [t for t in alone if t not in eos], prompt
