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

from .gathered_rows import take_rows

LOG2E = 1.4426950408889634  # (what MLX's exp multiplies by before its base-2 reduction)
LARGE_VOCAB = 4096  # from here the passes over the vocabulary dominate a step's added cost
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
        e = mx.power(mx.array(2.0, shifted.dtype), shifted * LOG2E) if slow_cpu_exp() else mx.exp(shifted)
    else:
        shifted = logits - mx.max(logits, axis=-1, keepdims=True)
        e = mx.exp(shifted)
    total = mx.sum(e, axis=-1, keepdims=True)
    log_total = mx.log(total)
    prob = 1.0 / total[..., 0]
    # (e = 0 where a logit is -inf: a suppressed id adds nothing, not 0 * -inf)
    entropy = log_total[..., 0] - mx.sum(mx.where(e > 0, e * shifted, 0.0), axis=-1) / total[..., 0]
    return x0.astype(mx.int32), prob, entropy, shifted, log_total


def logprob_rows(shifted: mx.array, log_total: mx.array, slots: mx.array) -> mx.array:
    """(B, k, V) the log-probs `shifted - log_total` (B, R, V) at the row slots (B, k):
    the same subtraction, element for element, over k rows instead of R."""
    return take_rows(shifted, slots) - take_rows(log_total, slots)


__all__ = ["greedy_stats", "greedy_parts", "logprob_rows", "slow_cpu_exp", "LOG2E", "LARGE_VOCAB"]
