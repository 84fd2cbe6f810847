"""A step's statistics over the vocabulary (proposal, probability, entropy, log-probs) in
as few and as cheap passes over (positions x vocabulary) as the step reads.

On the CPU these passes, not the model, are what the engine adds to a step at a real
vocabulary: MLX's CPU elementwise kernels and reductions run on one thread while the
head's matmul uses every core, and on x86-64 MLX's own `exp` is a polynomial evaluated
with `std::fma`, which the wheel's baseline build (no FMA instructions) turns into a
library call per term: measured here, `mx.exp` costs ~16 ns per element against ~8 ns
for `mx.power(2, x * log2(e))` (libm's powf) and ~0.6 ns for a subtraction. So, from a
vocabulary of `LARGE_VOCAB` up:

- the probability at the argmax comes from the argmax's own logit (a gather) instead of
  a separate max pass;
- exp is `2 ** (x * log2 e)` on an x86-64 CPU (the same base-2 reduction MLX's exp does:
  results agree with `mx.exp` to about 1e-7 relative), `mx.exp` elsewhere (a GPU, ARM).
- the exp and the sums run over chunks of rows (`CHUNK_LOGITS` logits each), so that a
  step that reads many rows (Dream's whole canvas: every still-masked row) keeps its
  temporaries in the core's cache instead of streaming (rows x V) arrays through memory;
- the entropy's terms are `e * max(shifted, lowest float)` (two passes; a `where` over
  `e > 0` was three), the same values bit for bit.

Below it the passes are cheap and a step's cost is the number of operations it
dispatches: the plain formulation (max, exp) is kept. `mx.compile` of the elementwise
terms was measured and bought nothing here (a broadcast operand makes its CPU kernel
strided; at a small vocabulary the compiled call costs more than it fuses), so nothing is
compiled. Everything stays lazy: what no rule reads (the entropy, the log-probs when none
are kept) is never computed.
"""

from __future__ import annotations

import platform

import mlx.core as mx
import numpy as np

from .gathered_rows import take_rows

LOG2E = 1.4426950408889634  # (what MLX's exp multiplies by before its base-2 reduction)
LARGE_VOCAB = 4096  # from here the passes over the vocabulary dominate a step's added cost
# (large vocabularies) the logits of rows one chunk of exp and sums covers: 1 MiB of float32
CHUNK_LOGITS = 1 << 18
LOWEST = float(np.finfo(np.float32).min)  # the lowest finite float32
_X86 = platform.machine().lower() in ("x86_64", "amd64")


def slow_cpu_exp() -> bool:
    """Whether arrays land on an x86-64 CPU, where `mx.exp` is the slow library path."""
    return _X86 and mx.default_device() == mx.cpu


def greedy_stats(logits: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(x0, prob, entropy, logprobs) of processed logits (..., V): the argmax proposal,
    its temperature-1 probability, the softmax's entropy and the log-softmax, from one
    shared max / exp / sum (z = logits - max, e = exp(z), S = sum(e): prob = 1 / S,
    H = log S - sum(e z) / S, log-probs = z - log S). Lazy: the entropy and the log-probs
    cost nothing unless read."""
    x0, prob, entropy, shifted, log_total = greedy_parts(logits)
    return x0, prob, entropy, shifted - log_total


def greedy_parts(logits: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array, mx.array]:
    """`greedy_stats` with its log-probs in two parts, (shifted (..., V), log_total (..., 1)):
    log-probs = shifted - log_total. A reader of a few positions' log-probs subtracts at
    those only (`logprob_rows`) instead of over every position's vocabulary."""
    x0 = mx.argmax(logits, axis=-1)
    if logits.shape[-1] >= LARGE_VOCAB:
        top = mx.take_along_axis(logits, x0[..., None], axis=-1)  # (the max: the argmax's logit)
        shifted = logits - top
        total, weighted = _chunked_sums(shifted)
    else:
        shifted = logits - mx.max(logits, axis=-1, keepdims=True)
        total, weighted = _exp_sums(shifted, mx.exp(shifted))
    log_total = mx.log(total)
    prob = 1.0 / total[..., 0]
    entropy = log_total[..., 0] - weighted / total[..., 0]
    return x0.astype(mx.int32), prob, entropy, shifted, log_total


def _exp_sums(shifted: mx.array, e: mx.array) -> tuple[mx.array, mx.array]:
    """(sum(e) (..., 1), sum(e * shifted) (...,)) with e = exp(shifted). Where a logit
    is -inf (a suppressed id) e is 0 and the term must be 0, not 0 * -inf: `shifted` is
    clamped to the lowest finite float, which changes no term with e > 0 (their shifted
    is finite) and makes the others (-)0, so the sum is the one `where(e > 0, e * shifted,
    0)` gives, bit for bit, in two passes instead of three."""
    clamped = mx.maximum(shifted, mx.array(LOWEST, shifted.dtype))
    return mx.sum(e, axis=-1, keepdims=True), mx.sum(e * clamped, axis=-1)


def _chunked_sums(shifted: mx.array) -> tuple[mx.array, mx.array]:
    """`_exp_sums` at a large vocabulary, over chunks of CHUNK_LOGITS logits (whole rows):
    the exp, the products and their sums of one chunk stay in the core's cache instead
    of each being a (rows x V) array written to memory and read back (at a 32k
    vocabulary and 128 rows, each is 16 MiB; measured, the passes then cost ~1.5x more
    per logit than over a few rows). Every term is per row, so the results are the
    unchunked ones bit for bit."""
    V = shifted.shape[-1]
    flat = shifted.reshape(-1, V)
    step = max(1, CHUNK_LOGITS // V)
    sums = [_exp_sums(part, _fast_exp(part)) for part in (flat[i : i + step] for i in range(0, flat.shape[0], step))]
    total = sums[0][0] if len(sums) == 1 else mx.concatenate([t for t, _ in sums], axis=0)
    weighted = sums[0][1] if len(sums) == 1 else mx.concatenate([w for _, w in sums], axis=0)
    return total.reshape(*shifted.shape[:-1], 1), weighted.reshape(shifted.shape[:-1])


def _fast_exp(shifted: mx.array) -> mx.array:
    if slow_cpu_exp():
        return mx.power(mx.array(2.0, shifted.dtype), shifted * LOG2E)
    return mx.exp(shifted)


def logprob_rows(shifted: mx.array, log_total: mx.array, slots: mx.array) -> mx.array:
    """(B, k, V) the log-probs `shifted - log_total` (B, R, V) at the row slots (B, k):
    the same subtraction, element for element, over k rows instead of R."""
    return take_rows(shifted, slots) - take_rows(log_total, slots)


__all__ = ["greedy_stats", "greedy_parts", "logprob_rows", "slow_cpu_exp", "LOG2E", "LARGE_VOCAB"]
