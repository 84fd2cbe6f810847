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
- exp on an x86-64 CPU is `cpu_exp`, a polynomial in MLX's own multiplies and adds,
  compiled with the terms that use it (`_exp_terms`: one fused kernel): 5-7 ns per logit
  against ~10 for `mx.power(2, x * log2 e)` (libm's powf, what it replaced) and ~16 for
  `mx.exp`, and closer to exp (8e-8 relative against powf's 1.8e-6); `mx.exp` elsewhere
  (a GPU, ARM).
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
from functools import partial
from typing import Callable

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.decoders.gathered_rows import take_rows

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
        total, weighted = _term_sums(*_exp_terms(shifted))
    log_total = mx.log(total)
    prob = 1.0 / total[..., 0]
    entropy = log_total[..., 0] - weighted / total[..., 0]
    return x0.astype(mx.int32), prob, entropy, shifted, log_total


def _exp_terms(shifted: mx.array, exp: Callable[[mx.array], mx.array] = mx.exp) -> tuple[mx.array, mx.array]:
    """(e, e * clamped) with e = exp(shifted): the terms whose sums are sum(e) and
    sum(e * shifted). Where a logit is -inf (a suppressed id) e is 0 and the term must be
    0, not 0 * -inf: `shifted` is clamped to the lowest finite float, which changes no
    term with e > 0 (their shifted is finite) and makes the others (-)0, so the sum is
    the one `where(e > 0, e * shifted, 0)` gives, bit for bit, in two passes instead of
    three."""
    e = exp(shifted)
    return e, e * mx.maximum(shifted, mx.array(LOWEST, shifted.dtype))


def _term_sums(e: mx.array, weighted_terms: mx.array) -> tuple[mx.array, mx.array]:
    """(sum(e) (..., 1), sum(e * shifted) (...,)) of `_exp_terms`."""
    return mx.sum(e, axis=-1, keepdims=True), mx.sum(weighted_terms, axis=-1)


def _chunked_sums(shifted: mx.array) -> tuple[mx.array, mx.array]:
    """`_term_sums` at a large vocabulary, over chunks of CHUNK_LOGITS logits (whole rows):
    the exp, the products and their sums of one chunk stay in the core's cache instead
    of each being a (rows x V) array written to memory and read back (at a 32k
    vocabulary and 128 rows, each is 16 MiB; measured, the passes then cost ~1.5x more
    per logit than over a few rows). Every term is per row, so the results are the
    unchunked ones bit for bit."""
    V = shifted.shape[-1]
    flat = shifted.reshape(-1, V)
    step = max(1, CHUNK_LOGITS // V)
    terms = _cpu_exp_terms if slow_cpu_exp() else _exp_terms
    sums = [_term_sums(*terms(part)) for part in (flat[i : i + step] for i in range(0, flat.shape[0], step))]
    total = sums[0][0] if len(sums) == 1 else mx.concatenate([t for t, _ in sums], axis=0)
    weighted = sums[0][1] if len(sums) == 1 else mx.concatenate([w for _, w in sums], axis=0)
    return total.reshape(*shifted.shape[:-1], 1), weighted.reshape(shifted.shape[:-1])


def _fast_exp(shifted: mx.array) -> mx.array:
    """The exp of the large-vocabulary path, unfused (`_cpu_exp_terms` fuses it)."""
    return cpu_exp(shifted) if slow_cpu_exp() else mx.exp(shifted)


# exp(x) = 2**n exp(r): n = round(x log2 e), r = x - n ln 2 with ln 2 in two parts (Cody and
# Waite's reduction: n ln2_hi is exact, so r keeps its low bits); exp(r) on |r| <= ln 2 / 2
# by the degree-7 polynomial of Cephes' expf (S. L. Moshier), 1 + r + r^2 P(r)
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_EXPF_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_ROUND = 12582912.0  # 1.5 * 2**23: float32 x + _ROUND - _ROUND rounds |x| < 2**22 to an integer


def cpu_exp(x: mx.array) -> mx.array:
    """exp of float32 `x` in MLX multiplies and adds, for an x86-64 CPU (see the module
    docstring), after Cephes' expf: Cody-Waite reduction to r = x - n ln 2, its
    polynomial for exp(r), 2**n built in the exponent bits. Within 1e-7 relative of exp
    where exp(x) is a normal float; 0 below -127 ln 2 (x = -inf included: 2**-127 is built
    as 0, so e * anything finite is 0, as the entropy's clamped terms need), where exp
    flushes (about 1e-38) instead of returning subnormals. Inputs are at most 0 here (logits
    less their maximum); above 88.7 exp overflows and so does this."""
    x = mx.maximum(x, -127.0 / LOG2E)
    n = (x * LOG2E + _ROUND) - _ROUND
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = mx.array(_EXPF_P[0], x.dtype)
    for c in _EXPF_P[1:]:
        p = p * r + c
    p = p * r * r + r + 1.0
    two_n = ((n.astype(mx.int32) + 127) * (1 << 23)).view(mx.float32)
    return p * two_n


# the terms of a chunk with `cpu_exp`, fused into one kernel (uncompiled, the polynomial's
# dozen passes over the chunk would cost more than the powf it replaced)
_cpu_exp_terms = mx.compile(partial(_exp_terms, exp=cpu_exp))


def logprob_rows(shifted: mx.array, log_total: mx.array, slots: mx.array) -> mx.array:
    """(B, k, V) the log-probs `shifted - log_total` (B, R, V) at the row slots (B, k):
    the same subtraction, element for element, over k rows instead of R."""
    return take_rows(shifted, slots) - take_rows(log_total, slots)


__all__ = ["cpu_exp", "greedy_stats", "greedy_parts", "logprob_rows", "slow_cpu_exp", "LOG2E", "LARGE_VOCAB"]
