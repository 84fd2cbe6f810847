"""A step's statistics over the vocabulary (proposal, probability, entropy, log-probs) in
as few passes over (positions x vocabulary) as the step reads.

On the CPU these passes, not the model, are what the engine adds to a step at a real
vocabulary: MLX's CPU elementwise kernels and reductions run on one thread while the
head's matmul uses every core, and on x86-64 MLX's own `exp` is a polynomial evaluated
with `std::fma`, which the wheel's baseline build (no FMA instructions) turns into a
library call per term: measured here, `mx.exp` costs ~16 ns per element against ~8 ns
for `mx.power(2, x * log2(e))` (libm's powf) and ~0.6 ns for a subtraction. So:

- the probability at the argmax comes from the argmax's own logit (a gather) instead of
  a separate max pass;
- exp is `2 ** (x * log2 e)` on an x86-64 CPU (the same base-2 reduction MLX's exp does:
  results agree with `mx.exp` to about 1e-7 relative), `mx.exp` elsewhere (a GPU, ARM);
- the subtraction of the max, the exponential and the entropy's and log-probs'
  elementwise terms are `mx.compile`d where that works, so each is one kernel reading the
  logits once; everything stays lazy, so what no rule reads (the entropy, the log-probs
  when none are kept) is never computed.

A compile that fails (no C++ compiler for MLX's CPU JIT) falls back to the same
functions uncompiled: `compiled` probes each once on a tiny input before using it.
"""

from __future__ import annotations

import platform
from typing import Callable

import mlx.core as mx

LOG2E = 1.4426950408889634  # (what MLX's exp multiplies by before its base-2 reduction)
_X86 = platform.machine().lower() in ("x86_64", "amd64")


def slow_cpu_exp() -> bool:
    """Whether arrays land on an x86-64 CPU, where `mx.exp` is the slow library path."""
    return _X86 and mx.default_device() == mx.cpu


def _exp2_shifted(logits: mx.array, top: mx.array) -> mx.array:
    return mx.power(mx.array(2.0, logits.dtype), (logits - top) * LOG2E)


def _exp_shifted(logits: mx.array, top: mx.array) -> mx.array:
    return mx.exp(logits - top)


def _entropy_terms(e: mx.array, logits: mx.array, top: mx.array) -> mx.array:
    # (e = 0 where a logit is -inf: a suppressed id adds nothing, not 0 * -inf)
    return mx.where(e > 0, e * (logits - top), 0.0)


def _log_probs(logits: mx.array, top: mx.array, log_total: mx.array) -> mx.array:
    return (logits - top) - log_total


_compiled: dict = {}


def compiled(fn: Callable) -> Callable:
    """`mx.compile(fn)` once it has evaluated a tiny input; `fn` itself if compiling fails."""
    if fn not in _compiled:
        try:
            candidate = mx.compile(fn)
            x = mx.zeros((1, 2))
            probe = [x] * (fn.__code__.co_argcount)
            mx.eval(candidate(*probe))
            _compiled[fn] = candidate
        except Exception:  # (e.g. no compiler for MLX's CPU JIT): the same ops, unfused
            _compiled[fn] = fn
    return _compiled[fn]


def greedy_stats(logits: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(x0, prob, entropy, logprobs) of processed logits (..., V): the argmax proposal,
    its temperature-1 probability, the softmax's entropy and the log-softmax, from one
    argmax and one exponential pass (z = logits - max, e = exp(z), S = sum(e):
    prob = 1 / S, H = log S - sum(e z) / S, log-probs = z - log S). Lazy: the entropy and
    the log-probs cost nothing unless read."""
    x0 = mx.argmax(logits, axis=-1)
    top = mx.take_along_axis(logits, x0[..., None], axis=-1)  # (the max: the argmax's logit)
    e = compiled(_exp2_shifted if slow_cpu_exp() else _exp_shifted)(logits, top)
    total = mx.sum(e, axis=-1, keepdims=True)
    log_total = mx.log(total)
    prob = 1.0 / total[..., 0]
    entropy = log_total[..., 0] - mx.sum(compiled(_entropy_terms)(e, logits, top), axis=-1) / total[..., 0]
    return x0.astype(mx.int32), prob, entropy, compiled(_log_probs)(logits, top, log_total)


__all__ = ["greedy_stats", "compiled", "slow_cpu_exp", "LOG2E"]
