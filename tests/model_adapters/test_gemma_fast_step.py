"""DiffusionGemma's cheaper step (`fast_step`): the whole step on the top-k logits. Checked
against its definition (numpy), against the exact step where k covers the vocabulary
(identical seeded decodes, text and image), and its refusals.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.decoders.uniform_canvas import UniformCanvasDecoder, full_logprobs
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.checkpoints import VOCAB
from mlx_lm_diffusion.testing.gemma_vision_checkpoints import make_image, write_gemma_with_vision
from model_adapters import adapter_for
from model_adapters.base import DecodeSetup

CANVAS = 16


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mld.load(str(write_gemma_with_vision(tmp_path_factory.mktemp("gemma_fast"))))


def test_decode_top_k_is_the_softcapped_top_k_of_the_exact_logits(loaded):
    model, _ = loaded
    cache = model.make_kv_cache()
    model.encode(mx.array([[5, 6, 7, 8]]), cache)
    canvas = mx.array([[3, 9, 27, 81, 243, 17, 1, 2]])
    exact = np.array(model.decode(canvas, cache))
    values, ids = model.decode_top_k(canvas, cache, None, 7)
    values, ids = np.array(values), np.array(ids)
    np.testing.assert_allclose(values, np.take_along_axis(exact, ids, -1), atol=1e-5)
    np.testing.assert_allclose(np.sort(values, -1), np.sort(exact, -1)[..., -7:], atol=1e-5)
    # self-conditioned on (values, ids): the soft embeddings of those k rows
    z = mx.array(values) / 0.7
    got, got_ids = (np.array(a) for a in model.decode_top_k(canvas, cache, (z, mx.array(ids)), 7))
    dense = full_logprobs(z, mx.array(ids), model.vocab_size)  # -inf past the k
    want = np.array(model.decode(canvas, cache, dense))
    np.testing.assert_allclose(got, np.take_along_axis(want, got_ids, -1), atol=1e-4)
    np.testing.assert_allclose(np.sort(got, -1), np.sort(want, -1)[..., -7:], atol=1e-4)


def test_the_top_k_step_matches_its_definition(loaded):
    """argmax, its probability, the entropy and the sample over the k values (renormalised),
    mapped back to token ids; the next self-conditioning is the tempered (values, ids)."""
    model, processor = loaded
    adapter = adapter_for(model, processor)
    decoder = UniformCanvasDecoder(adapter, resolve(DecodeOptions(max_tokens=CANVAS), adapter, 4), False)
    rng = np.random.default_rng(0)
    values = mx.array(rng.standard_normal((2, 5, 7)).astype(np.float32) * 3)
    ids = mx.array(np.stack([rng.permutation(VOCAB)[:7] for _ in range(10)]).reshape(2, 5, 7).astype(np.uint32))
    seen = {}
    adapter.condition = lambda state, sc: seen.update(sc=sc)
    mx.random.seed(3)
    stats, sample, prob, logprobs = decoder._top_k_step(None, (values, ids), 0.5)
    z = np.array(values) / 0.5
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    I = np.array(ids)
    assert (np.array(stats.x0) == np.take_along_axis(I, p.argmax(-1)[..., None], -1)[..., 0]).all()
    np.testing.assert_allclose(np.array(stats.prob), p.max(-1), atol=1e-6)
    np.testing.assert_allclose(np.array(stats.entropy), -(p * np.log(p)).sum(-1), atol=1e-5)
    mx.random.seed(3)
    drawn = np.array(mx.random.categorical(mx.array(z)))
    assert (np.array(sample) == np.take_along_axis(I, drawn[..., None], -1)[..., 0]).all()
    np.testing.assert_allclose(np.array(prob), np.take_along_axis(p, drawn[..., None], -1)[..., 0], atol=1e-6)
    dense = np.array(logprobs)
    assert dense.shape == (2, 5, VOCAB) and np.isinf(dense).sum() == 10 * (VOCAB - 7)
    np.testing.assert_allclose(np.take_along_axis(dense, I, -1), np.log(p), atol=1e-5)
    np.testing.assert_allclose(np.array(seen["sc"][0]), z, atol=1e-6)
    assert seen["sc"][1] is ids


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_image", [False, True])
def test_with_k_the_vocabulary_the_fast_step_is_the_exact_step(loaded, seed, with_image):
    model, processor = loaded
    kw = dict(max_tokens=2 * CANVAS, seed=seed, block_length=CANVAS)
    if with_image:
        kw["image"] = [make_image(40, 24)]
    exact = mld.generate(model, processor, "Look at this", **kw)
    assert exact == mld.generate(model, processor, "Look at this", fast_step=True, self_conditioning_k=VOCAB, **kw)


def test_fast_step_is_opt_in_and_its_refusals(loaded):
    model, processor = loaded
    adapter = adapter_for(model, processor)
    prompt = mx.array([[5, 6, 7, 8]])

    def started(**options):  # (a decode's state holds its k)
        return adapter.start(
            prompt, setup=DecodeSetup(resolve(DecodeOptions(max_tokens=CANVAS, **options), adapter, 4))
        )

    state = started()
    assert state.top_k_step == 0 and state.top_k == 0
    state = started(fast_step=True)
    assert state.top_k_step == state.top_k == 256
    kw = dict(max_tokens=CANVAS, seed=0, block_length=CANVAS)
    small = mld.generate(model, processor, "Hello", fast_step=True, self_conditioning_k=4, **kw)
    assert small != mld.generate(model, processor, "Hello", **kw)
    with pytest.raises(ValueError, match="allowed_tokens does not combine with fast_step"):
        mld.generate(model, processor, "Hello", fast_step=True, allowed_tokens=[5, 6], **kw)


WIDE_VOCAB = 1024  # above k = 256: the top-k goes through its two chunked partitions


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The image checkpoint at a model vocabulary larger than its tokenizer's."""
    return mld.load(str(write_gemma_with_vision(tmp_path_factory.mktemp("gemma_wide"), vocab_size=WIDE_VOCAB)))


def test_the_writer_takes_the_model_vocabulary(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must exceed"):
        write_gemma_with_vision(tmp_path / "narrow", vocab_size=200)
    assert not (tmp_path / "narrow").exists()


def test_at_a_wider_vocabulary_the_top_k_is_the_exact_one_and_k_vocab_is_the_exact_step(wide):
    model, processor = wide
    assert model.vocab_size == WIDE_VOCAB and len(processor.tokenizer) < WIDE_VOCAB
    cache = model.make_kv_cache()
    model.encode(mx.array([[5, 6, 7, 8]]), cache)
    canvas = mx.array([[3, 900, 27, 1000, 243, 17, 1, 2]])
    exact = np.array(model.decode(canvas, cache))
    values, ids = (np.array(a) for a in model.decode_top_k(canvas, cache, None, 256))
    np.testing.assert_allclose(np.sort(values, -1), np.sort(exact, -1)[..., -256:], atol=1e-5)
    np.testing.assert_allclose(values, np.take_along_axis(exact, ids, -1), atol=1e-5)
    kw = dict(max_tokens=CANVAS, seed=1, block_length=CANVAS, image=[make_image(40, 24)])
    got = mld.generate(model, processor, "Look at this", fast_step=True, self_conditioning_k=WIDE_VOCAB, **kw)
    assert got == mld.generate(model, processor, "Look at this", **kw)
