"""model_adapters.runtime.vocab_top_k: the two-pass top-k ids give the k largest logits exactly
(the same values as one argpartition over the vocabulary), on chunked and unchunked sizes."""

import mlx.core as mx
import numpy as np
import pytest

from model_adapters.runtime.vocab_top_k import chunk_size, top_k_ids


def test_chunk_size_divides_the_vocabulary_near_sqrt_v_over_k():
    assert chunk_size(262144, 256) == 32  # 8,192 chunk maxima, 8,192 candidates
    assert chunk_size(256000, 256) == 25 and chunk_size(1024, 7) == 8
    assert chunk_size(288, 256) == 1 and chunk_size(1031, 7) == 1  # one partition: small, prime
    assert chunk_size(100, 100) == chunk_size(100, 0) == 1


@pytest.mark.parametrize(
    "vocab, k", [(1024, 7), (1024, 256), (1000, 13), (4096, 1), (1031, 7), (288, 256), (1024, 1023)]
)
def test_top_k_ids_are_the_k_largest(vocab, k):
    rng = np.random.default_rng(vocab + k)
    logits = rng.standard_normal((2, 5, vocab)).astype(np.float32) * 7
    logits[0, 0, -3:] = 50.0 + np.arange(3)  # the best in the last chunk
    logits[1, 2, : vocab // 2] = -np.inf  # half the row masked
    ids = top_k_ids(mx.array(logits), k)
    assert ids.shape == (2, 5, k) and ids.dtype == mx.uint32
    got = np.array(ids)
    assert all(len(set(row)) == k for row in got.reshape(-1, k))  # k distinct ids
    want = np.sort(logits, axis=-1)[..., -k:]
    np.testing.assert_array_equal(np.sort(np.take_along_axis(logits, got, -1), -1), want)
