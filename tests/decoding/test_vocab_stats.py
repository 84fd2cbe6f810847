"""vocab_stats.greedy_stats against a float64 numpy softmax, on both of its paths."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_diffusion.decoding.decoders import vocab_stats


def reference(logits: np.ndarray):
    z = logits.astype(np.float64)
    top = z.max(axis=-1, keepdims=True)
    e = np.exp(z - top)
    total = e.sum(axis=-1, keepdims=True)
    p = e / total
    logp = (z - top) - np.log(total)
    entropy = -np.where(p > 0, p * np.where(p > 0, logp, 0.0), 0.0).sum(axis=-1)
    return z.argmax(axis=-1), 1.0 / total[..., 0], entropy, logp


@pytest.mark.parametrize("vocab", [7, 300, vocab_stats.LARGE_VOCAB, 5000])
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


def test_both_paths_agree():
    """The large-vocabulary path (the argmax's logit, exp by `cpu_exp` on an x86 CPU)
    gives the plain path's values to float rounding."""
    rng = np.random.default_rng(1)
    logits = mx.array((rng.standard_normal((3, 4, vocab_stats.LARGE_VOCAB)) * 5).astype(np.float32))
    large = vocab_stats.greedy_stats(logits)
    shifted = logits - mx.max(logits, axis=-1, keepdims=True)
    e = mx.exp(shifted)
    total = mx.sum(e, axis=-1)
    np.testing.assert_array_equal(np.array(large[0]), np.array(mx.argmax(logits, axis=-1)))
    np.testing.assert_allclose(np.array(large[1]), np.array(1.0 / total), rtol=1e-6)


def unchunked_parts(logits: mx.array):
    """The large-vocabulary statistics as one pass each over every row (the formulation
    before the chunks and the clamp): exp as bare MLX computes it on this machine."""
    x0 = mx.argmax(logits, axis=-1)
    shifted = logits - mx.take_along_axis(logits, x0[..., None], axis=-1)
    e = vocab_stats._fast_exp(shifted)
    total = mx.sum(e, axis=-1, keepdims=True)
    entropy = mx.log(total)[..., 0] - mx.sum(mx.where(e > 0, e * shifted, 0.0), axis=-1) / total[..., 0]
    return x0.astype(mx.int32), 1.0 / total[..., 0], entropy


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_chunked_passes_are_bit_identical(rows, monkeypatch):
    """Over chunks of rows (here a chunk is 2 rows, so 17 rows make 9 chunks, the last
    one short) and with the clamped entropy terms, the statistics are the one-pass ones
    bit for bit, -inf logits (suppressed ids) and underflowing tails included."""
    vocab = vocab_stats.LARGE_VOCAB
    monkeypatch.setattr(vocab_stats, "CHUNK_LOGITS", 2 * vocab)
    rng = np.random.default_rng(rows)
    logits = (rng.standard_normal((2, rows, vocab)) * 8).astype(np.float32)
    logits[:, :, 5] = -np.inf
    logits[0, 0, : vocab // 2] = -np.inf
    logits[1, -1, :] -= 200.0  # (a shifted tail far below exp's underflow)
    logits = mx.array(logits)
    got = vocab_stats.greedy_parts(logits)[:3]
    for have, want in zip(got, unchunked_parts(logits)):
        assert have.shape == want.shape and have.dtype == want.dtype
        assert np.array_equal(np.array(have), np.array(want)), "not bit-identical"
    assert np.isfinite(np.array(got[2])).all()


def test_cpu_exp_is_exp_to_float_rounding():
    """vocab_stats.cpu_exp (Cephes' expf in MLX operations) against float64 exp: within
    2e-7 relative wherever exp is a normal float32, exactly 0 from -127 ln 2 down (-inf
    included), and the entropy's clamped term of a -inf logit is 0, not nan; compiled and
    fused as the statistics run it, the same bits."""
    x = np.concatenate([np.linspace(-104.0, 88.0, 100_001), [-np.inf, -88.0, -87.0, 0.0, -1e-8, 1e-8]]).astype(
        np.float32
    )
    got = np.array(vocab_stats.cpu_exp(mx.array(x))).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    normal = want >= np.finfo(np.float32).tiny
    assert np.max(np.abs(got[normal] - want[normal]) / want[normal]) < 2e-7
    assert np.all(got[x <= -127.0 / vocab_stats.LOG2E] == 0.0)
    assert np.all(got[~normal] <= 2 * np.finfo(np.float32).tiny)
    e, weighted = (np.array(a) for a in vocab_stats._cpu_exp_terms(mx.array(x)))
    assert e[x == -np.inf][0] == 0.0 and weighted[x == -np.inf][0] == 0.0
    assert np.array_equal(e, np.array(vocab_stats.cpu_exp(mx.array(x))))
