"""vocab_stats.greedy_stats against a float64 numpy softmax, and its compile fallback."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_diffusion.decoders import vocab_stats


def reference(logits: np.ndarray):
    z = logits.astype(np.float64)
    top = z.max(axis=-1, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=-1, keepdims=True)
    p = e / total
    logp = (z - top) - np.log(total)
    entropy = -np.where(p > 0, p * np.where(p > 0, logp, 0.0), 0.0).sum(axis=-1)
    return z.argmax(axis=-1), 1.0 / total[..., 0], entropy, logp


@pytest.mark.parametrize("vocab", [7, 300, 1024])
def test_greedy_stats_match_a_float64_softmax(vocab):
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((2, 5, vocab)) * 6).astype(np.float32)
    logits[..., 3 % vocab] = -np.inf  # a suppressed id: probability 0, adds nothing to the entropy
    logits[0, 0, :] -= 40.0  # large negative shifts: exp underflows for the tail
    x0, prob, entropy, logprobs = (np.array(a) for a in vocab_stats.greedy_stats(mx.array(logits)))
    want = reference(logits)
    np.testing.assert_array_equal(x0, want[0])
    np.testing.assert_allclose(prob, want[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(entropy, want[2], rtol=1e-5, atol=1e-5)
    finite = np.isfinite(want[3])
    np.testing.assert_allclose(logprobs[finite], want[3][finite], rtol=1e-5, atol=1e-5)
    assert np.all(logprobs[~finite] == -np.inf)


def test_exp_on_this_device_agrees_with_mx_exp():
    x = mx.array(np.linspace(-100.0, 0.0, 4001, dtype=np.float32))[None]
    top = mx.zeros((1, 1))
    fn = vocab_stats._exp2_shifted if vocab_stats.slow_cpu_exp() else vocab_stats._exp_shifted
    got, want = np.array(vocab_stats.compiled(fn)(x, top)), np.array(mx.exp(x))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-37)


def test_a_function_that_cannot_compile_runs_uncompiled(monkeypatch):
    def failing_compile(fn):
        def compiled(*args):
            raise RuntimeError("no compiler")
        return compiled

    def terms(a, b):
        return a + b

    monkeypatch.setattr(vocab_stats.mx, "compile", failing_compile)
    monkeypatch.setattr(vocab_stats, "_compiled", {})
    assert vocab_stats.compiled(terms) is terms
