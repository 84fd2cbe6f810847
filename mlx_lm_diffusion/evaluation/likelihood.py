"""A continuation's log-likelihood under a masked-diffusion model: the ELBO by Monte Carlo.

A masked-diffusion model has no tractable likelihood; what its training minimises is an
upper bound on the negative log-likelihood, and evaluations report the bound's estimate.

`estimate_log_likelihood` reproduces LLaDA's evaluation (ML-GSAI/LLaDA `eval_llada.py`,
`get_log_likelihood` with `_forward_process`): per batch of b samples, the number of
masked continuation positions is stratified (evaluation.noise); each sample masks that
many random continuation positions (the context never), the model predicts the masked
ones, and the sample's loss is the cross-entropy summed over its masked positions
divided by its time p = masked / L. The estimate is minus the average loss over all
samples. Logits are the family's as its decoding sees them (`Adapter.predict`: Dream's
shift applied, the family's attention layout), over the whole vocabulary as the
reference's cross-entropy is; the context is never truncated here (the LM does it).

For block-causal families (evaluation.layout: `aligned`, SDAR and LLaDA2; and `prefix`,
Nemotron-Labs Diffusion) the bound is the block-diffusion one of BD3-LM (Arriola et al.,
"Block Diffusion", ICLR 2025: the NELBO summed over blocks, each block noised while it
attends to the clean blocks before it, the linear schedule's 1/t weight), which SDAR
trains with: every block of the continuation is noised in turn, with its own stratified
draw, over the clean tokens before it (one forward per block and batch), and a sample's
loss is the sum of its blocks' weighted losses. Deviation: BD3-LM draws t continuously;
here each block's masked count is LLaDA's stratified discrete draw, the same estimator.

`greedy_match` is lm-eval's is_greedy under a documented criterion: every continuation
token is the argmax (the mask token excluded, as the engine never proposes it) when it
alone is masked, everything else clean (LLaDA's reference instead decodes the
continuation greedily, one token per step; this asks the same question of each position
in one forward per block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.evaluation.layout import BoundLayout, bound_layout
from mlx_lm_diffusion.evaluation.noise import MaskDraw, single_masks, stratified_masks


@dataclass
class LikelihoodEstimate:
    """The bound's estimate and what it was computed from.

    `losses` (n,): each sample's weighted loss, summed over the blocks; `draws`: per
    Monte Carlo batch, the draw of each block (`blocks`, absolute [start, end)); give
    them back to `estimate_log_likelihood` to recompute the same estimate.
    `standard_error`: the samples' standard deviation over sqrt(n), as if they were
    independent (the stratified times within a batch are negatively correlated, so
    this errs on the large side)."""

    log_likelihood: float
    standard_error: float
    losses: np.ndarray
    blocks: list = field(default_factory=list)
    draws: list = field(default_factory=list)
    forwards: int = 0


def batch_sizes(samples: int, batch_size: int) -> list[int]:
    """The Monte Carlo batches: full batches, then the rest (each is stratified alone)."""
    if samples < 1 or batch_size < 1:
        raise ValueError(f"need at least one Monte Carlo sample and a batch of one, got {samples} and {batch_size}")
    full, rest = divmod(samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def draw_all(
    rng: np.random.Generator, blocks: Sequence[tuple[int, int]], samples: int, batch_size: int
) -> list[list[MaskDraw]]:
    """Every batch's draw for every block, in the order the estimate consumes them."""
    return [[stratified_masks(rng, end - start, b) for start, end in blocks] for b in batch_sizes(samples, batch_size)]


def scored_rows(adapter: Any, tokens: np.ndarray, start: int, end: int, masks: np.ndarray) -> tuple:
    """One forward over rows that hold `tokens[:end]`, block [start, end) masked where
    `masks` (rows, end - start) says, everything before it clean. Returns each block
    position's log-probability of its true token (rows, L) and the argmax (rows, L)."""
    rows = masks.shape[0]
    canvas = np.tile(tokens[:end], (rows, 1))
    canvas[:, start:end] = np.where(masks, adapter.mask_id, canvas[:, start:end])
    prefix = mx.array(np.ascontiguousarray(canvas[:, :start]))
    state = adapter.start(prefix)  # (the clean prefix: a cache where the family keeps one)
    logits = adapter.predict(state, mx.array(canvas), start, end).astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.broadcast_to(mx.array(tokens[start:end])[None, :, None], (rows, end - start, 1))
    picked = mx.take_along_axis(log_probs, targets, axis=-1)[..., 0]
    suppressed = list(getattr(adapter, "suppress_ids", ()))
    if suppressed:  # the engine never proposes them
        logits[..., mx.array(suppressed)] = -mx.inf
    argmax = mx.argmax(logits, axis=-1)
    mx.eval(picked, argmax)
    return np.array(picked), np.array(argmax)


def _tokens(adapter: Any, layout: BoundLayout, context: Sequence[int], continuation: Sequence[int]) -> np.ndarray:
    if layout.needs_context and not context:
        raise ValueError(
            f"{adapter.family} cannot score a first token with nothing before it: give a context "
            "(lm-eval's rolling windows start with a prefix token)"
        )
    tokens = np.array(list(context) + list(continuation), dtype=np.int64)
    if adapter.mask_id in tokens.tolist():
        raise ValueError(f"the text contains the mask token (id {adapter.mask_id}): it cannot be scored")
    return tokens


def estimate_log_likelihood(
    adapter: Any,
    context: Sequence[int],
    continuation: Sequence[int],
    samples: int = 128,
    batch_size: int = 32,
    seed: Any = 0,
    draws: Optional[list] = None,
) -> LikelihoodEstimate:
    """The bound's Monte Carlo estimate of log p(continuation | context): `samples`
    samples in batches of `batch_size` (one forward per batch and block); `seed`: any
    numpy seed (an int, or a sequence of ints); `draws`: the draws to use instead
    (`LikelihoodEstimate.draws` of an earlier call)."""
    layout = bound_layout(adapter)
    tokens = _tokens(adapter, layout, context, continuation)
    blocks = layout.blocks(len(context), len(tokens))
    if not blocks:  # an empty continuation: probability one
        return LikelihoodEstimate(0.0, 0.0, np.zeros(samples), blocks, [], 0)
    if draws is None:
        draws = draw_all(np.random.default_rng(seed), blocks, samples, batch_size)
    losses, forwards = [], 0
    for batch in draws:
        loss = np.zeros(batch[0].samples)
        for (start, end), draw in zip(blocks, batch):
            picked, _ = scored_rows(adapter, tokens, start, end, draw.masks)
            loss -= np.where(draw.masks, picked, 0.0).sum(axis=1) / draw.times
            forwards += 1
        losses.append(loss)
    losses = np.concatenate(losses)
    spread = float(losses.std(ddof=1) / np.sqrt(len(losses))) if len(losses) > 1 else float("nan")
    return LikelihoodEstimate(-float(losses.mean()), spread, losses, blocks, draws, forwards)


def greedy_match(adapter: Any, context: Sequence[int], continuation: Sequence[int], batch_size: int = 32) -> tuple:
    """(whether every continuation token is the argmax when it alone is masked, forwards)."""
    layout = bound_layout(adapter)
    tokens = _tokens(adapter, layout, context, continuation)
    forwards = 0
    for start, end in layout.blocks(len(context), len(tokens)):
        masks = single_masks(end - start).masks
        for lo in range(0, len(masks), batch_size):
            rows = masks[lo : lo + batch_size]
            _, argmax = scored_rows(adapter, tokens, start, end, rows)
            forwards += 1
            if not np.all(argmax[rows] == np.tile(tokens[start:end], (len(rows), 1))[rows]):
                return False, forwards
    return True, forwards
