"""Each diffusion family's training objective, as a loss for mlx-lm's trainer.

mlx-lm's trainer calls `loss(model, batch, lengths)` with `batch` (B, L) token ids
padded with zeros and `lengths` (B, 2) = (offset, length): positions [offset, length)
are trained (offset > 0 with --mask-prompt: the prompt), positions from `length` on are
padding. The loss returns (mean loss, trained tokens). Padding is kept out of the
attention (no query attends to a key at or after its row's length), so a row is trained
as if it stood alone.

Three objectives, after the attention each family is trained with
(mlx_lm_diffusion.evaluation.layout reads it from the adapter, as the likelihood does):

- `canvas` (LLaDA 1.x/1.5, Dream): the masked-diffusion loss of LLaDA's SFT
  (ML-GSAI/LLaDA GUIDELINES.md, "SFT"): t ~ U(0, 1), p = (1 - eps) t + eps with eps =
  1e-3, each trained token masked with probability p (the prompt never), cross-entropy
  on the masked tokens divided by p. With --mask-prompt the loss of a row is normalized
  by its answer length and the rows are averaged (the reference's SFT normalization);
  without it every token of `text` data is maskable and the sum is divided by the number
  of trained tokens (the reference's pre-training loss: the sum over B * L tokens
  divided by B * L, its rows having no padding). Dream predicts token i at position
  i - 1 (its logit shift), so its position 0 is context, never trained.
- `aligned` (SDAR / TraDo, LLaDA2.x: block-causal attention on absolute blocks of the
  config's block_size) and `prefix` (Nemotron-Labs Diffusion: a block attends
  bidirectionally to itself over a causally encoded prefix, blocks of its block length
  from the end of the prompt): the block-diffusion loss of BD3-LM (Arriola et al.,
  "Block Diffusion", ICLR 2025), which SDAR trains with: the NELBO is a sum over blocks,
  each noised while it attends to the clean blocks before it. Reproduced in its simple,
  unbiased form, not BD3-LM's doubled sequence (the adapters' RoPE positions cannot
  give a noisy copy the clean copy's positions): each row draws ONE of its trained
  blocks uniformly, masks it with probability p (the blocks before it stay clean; the
  block-causal attention keeps the positions after it from mattering), and its masked
  cross-entropy over p is multiplied by the number of trained blocks (so that its
  expectation is the sum over blocks). Normalized as the canvas loss.
- `ar` (Nemotron-Labs Diffusion's autoregressive mode, --objective ar): causal
  attention, next-token cross-entropy averaged over the trained tokens (mlx-lm's own
  loss; Nemotron's causal passes propose each block's first token at decoding).

With --mask-prompt (supervised fine-tuning: completions and chat data) the padding is
LLaDA's SFT padding instead (GUIDELINES.md: "|EOS| tokens at the end of short pairs ...
treated as a normal token", masked and predicted, counted in the answer length): every
position after a row's end holds EOS and is trained, so the model learns to fill the
rest of a canvas with EOS, as the decoders need (they fill max_tokens positions and stop
at EOS). The same applies to the block families (each block after the answer is
trained to be EOS); for `text` data (pre-training) padding stays out of the loss.

The noise (`Noise`: each row's time, each position's uniform draw, each row's block
draw) is drawn inside the loss (mlx.random, which mlx-lm's compiled step carries) unless
given, so a test can give it and recompute the loss independently. In evaluation mode
(the trainer's validation and --test) the loss is instead the masked-diffusion ELBO
estimate of evaluation.likelihood with fixed seeds (training.validation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_lm_diffusion.evaluation.layout import BoundLayout, bound_layout

EPS = 1e-3  # LLaDA's eps: the smallest masking probability
OBJECTIVES = ("diffusion", "ar")


@dataclass(frozen=True)
class Noise:
    """One batch's noise: `times` (B,) each row's masking probability p in [eps, 1];
    `draws` (B, L) uniform in [0, 1): a trained position is masked where draw < p;
    `blocks` (B,) uniform in [0, 1): which trained block a row noises (block objectives)."""

    times: mx.array
    draws: mx.array
    blocks: mx.array


def draw_noise(shape: tuple) -> Noise:
    """Noise for a batch of `shape` (B, L): t ~ U(0, 1), p = (1 - eps) t + eps."""
    rows, length = shape
    times = (1 - EPS) * mx.random.uniform(shape=(rows,)) + EPS
    return Noise(times, mx.random.uniform(shape=(rows, length)), mx.random.uniform(shape=(rows,)))


class Objective:
    """The loss of one family (`layout`, from its adapter) for mlx-lm's trainer.

    `normalize`: "answer" (each row's loss over its trained tokens, rows averaged: SFT)
    or "tokens" (the sum over all trained tokens: pre-training). `validation`: called in
    evaluation mode instead (training.validation.ElboValidation), or None to use the
    training loss there too."""

    def __init__(
        self,
        mask_id: int,
        layout: BoundLayout,
        normalize: str = "tokens",
        autoregressive: bool = False,
        shift: int = 0,
        validation: Any = None,
        pad_id: Optional[int] = None,
    ):
        if normalize not in ("answer", "tokens"):
            raise ValueError(f"normalize must be 'answer' or 'tokens', got {normalize!r}")
        self.mask_id = int(mask_id)
        self.layout = layout
        self.normalize = normalize
        self.autoregressive = autoregressive
        self.shift = 1 if autoregressive else shift
        # the first position that can be trained: one with a token before it when the
        # logits of position i come from row i - 1 (Dream, AR) or the prefix must hold one
        self.first = 1 if (self.shift or layout.needs_context) else 0
        self.validation = validation
        self.pad_id = pad_id  # None: padding stays out of the loss and the attention

    def __call__(self, model: nn.Module, batch: mx.array, lengths: mx.array, noise: Optional[Noise] = None) -> tuple:
        if self.pad_id is not None:
            batch, lengths = self.padded(batch, lengths)
        if not model.training and noise is None and self.validation is not None:
            return self.validation(batch, lengths)
        if self.autoregressive:
            return self.next_token_loss(model, batch, lengths)
        return self.diffusion_loss(model, batch, lengths, noise if noise is not None else draw_noise(batch.shape))

    def padded(self, batch: mx.array, lengths: mx.array) -> tuple:
        """LLaDA's SFT padding: every row's positions after its end hold `pad_id` (EOS)
        and are trained."""
        width = batch.shape[1]
        tail = mx.arange(width)[None, :] >= lengths[:, 1:]
        ends = mx.full(lengths[:, 1:].shape, width, dtype=lengths.dtype)
        return mx.where(tail, self.pad_id, batch), mx.concatenate([lengths[:, :1], ends], axis=1)

    def _region(self, batch: mx.array, lengths: mx.array) -> tuple:
        positions = mx.arange(batch.shape[1])[None, :]
        start = mx.maximum(lengths[:, :1], self.first)
        end = lengths[:, 1:]
        return positions, start, end, (positions >= start) & (positions < end)

    def diffusion_loss(self, model: nn.Module, batch: mx.array, lengths: mx.array, noise: Noise) -> tuple:
        positions, start, end, trained = self._region(batch, lengths)
        p = noise.times[:, None]
        lo, hi, blocks = self.block_of(start, end, noise.blocks[:, None])
        masked = trained & (positions >= lo) & (positions < hi) & (noise.draws < p)
        inputs = mx.where(masked, self.mask_id, batch)
        logits = model(inputs, mask=self.attention(batch.shape[1], end, lo, hi))
        ce = self._cross_entropy(logits, batch)
        per_row = (ce * masked).sum(axis=1) / p[:, 0] * blocks[:, 0]
        return self._normalized(per_row, trained.sum(axis=1))

    def next_token_loss(self, model: nn.Module, batch: mx.array, lengths: mx.array) -> tuple:
        _, _, end, trained = self._region(batch, lengths)
        logits = model(batch, mask=self.attention(batch.shape[1], end, None, None))
        ce = self._cross_entropy(logits, batch) * trained
        count = trained.sum()
        return ce.sum() / mx.maximum(count, 1), count

    def block_of(self, start: mx.array, end: mx.array, draw: mx.array) -> tuple:
        """Each row's noised positions [lo, hi) and its number of trained blocks (B, 1)."""
        layout = self.layout
        if layout.kind == "canvas" or layout.block is None:
            return start, end, mx.ones_like(start)
        size = layout.block
        if layout.kind == "aligned":  # attention blocks on absolute positions
            first, last = start // size, (mx.maximum(end, start + 1) - 1) // size
            count = last - first + 1
            index = mx.minimum(first + (draw * count).astype(mx.int32), last)
            return mx.maximum(index * size, start), mx.minimum((index + 1) * size, end), count
        count = mx.maximum((end - start + size - 1) // size, 1)  # blocks from the end of the prompt
        lo = start + mx.minimum((draw * count).astype(mx.int32), count - 1) * size
        return lo, mx.minimum(lo + size, end), count

    def attention(self, length: int, end: mx.array, lo: Optional[mx.array], hi: Optional[mx.array]) -> mx.array:
        """Boolean (B, 1, L, L), True where a query attends to a key: the family's
        training attention, never to a key at or after its row's end (padding)."""
        q = mx.arange(length)[None, :, None]
        k = mx.arange(length)[None, None, :]
        keep = k < end[:, :, None]  # (B, 1, L) over keys
        if self.autoregressive:
            keep = keep & (k <= q)
        elif self.layout.kind == "aligned":
            size = self.layout.block
            keep = keep & (k // size <= q // size)
        elif self.layout.kind == "prefix":  # causal prefix, the noised block over it and itself
            keep = keep & mx.where(q < lo[:, :, None], k <= q, k < hi[:, :, None])
        return mx.broadcast_to(keep, (end.shape[0], length, length))[:, None]

    def _cross_entropy(self, logits: mx.array, targets: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        if self.shift:  # position i read from row i - 1 (position 0 is never trained)
            logits = mx.concatenate([logits[:, :1], logits[:, :-1]], axis=1)
        return nn.losses.cross_entropy(logits, targets)

    def _normalized(self, per_row: mx.array, counts: mx.array) -> tuple:
        total = counts.sum()
        if self.normalize == "answer":
            return (per_row / mx.maximum(counts, 1)).mean(), total
        return per_row.sum() / mx.maximum(total, 1), total


def objective_for(
    adapter: Any,
    objective: str = "diffusion",
    normalize: str = "tokens",
    validation: Any = None,
    pad_id: Optional[int] = None,
) -> Objective:
    """The family's objective from its adapter (ValueError: one it cannot train with);
    `pad_id` (EOS, for supervised fine-tuning): LLaDA's SFT padding, trained."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose from {', '.join(OBJECTIVES)}")
    layout = bound_layout(adapter)  # (refuses uniform-noise and autoregressive adapters)
    if objective == "ar":
        if layout.kind != "prefix":
            raise ValueError(
                f"{adapter.family} has no autoregressive mode to train: --objective ar is Nemotron-Labs Diffusion's"
            )
        return Objective(adapter.mask_id, layout, normalize, autoregressive=True)
    if layout.kind == "prefix":  # Nemotron: the block size it was trained with, over the decoding default
        layout = BoundLayout("prefix", int(getattr(adapter.model.args, "block_size", layout.block)), True)
    return Objective(
        adapter.mask_id,
        layout,
        normalize,
        shift=int(getattr(adapter, "shift", 0)),
        validation=validation,
        pad_id=pad_id,
    )
