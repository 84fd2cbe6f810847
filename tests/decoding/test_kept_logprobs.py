"""Each emitted token's log-prob vector (mlx-lm's GenerationResponse.logprobs) is the
log-softmax of the forward of the step that committed it (decoders.kept_logprobs).

The oracle: every step's canvas is recorded (draft_callback); a position committed at a
step is one that was a mask before it and a token after (with editing: the last step
that changed its token); the expected vector is the float64 log-softmax of an
independent whole-canvas forward of the canvas before that step (the model called
directly, the mask id removed, Dream's logits shifted by one). A vector kept from
another step, another position or another row would differ.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.decoders.kept_logprobs import KeptLogprobs
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from model_adapters import adapter_for

PROMPT = [72, 101, 108, 108, 111, 5, 17]


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def reference_logprobs(model, canvas: np.ndarray, mask_id: int, shift: bool) -> np.ndarray:
    """(L, V) float64 log-probs each canvas position is predicted with."""
    logits = np.array(model(mx.array(canvas[None]))).astype(np.float64)[0]
    logits[:, mask_id] = -np.inf  # (the engine never proposes the mask token)
    if shift:  # Dream: position i is predicted at i - 1
        logits = np.concatenate([logits[:1], logits[:-1]], axis=0)
    return log_softmax64(logits)


def expected_vectors(model, drafts: list, start: np.ndarray, mask_id: int, shift: bool) -> dict:
    """{position: log-prob vector at the step that last wrote its token}."""
    expected, before = {}, start
    for after in drafts:
        written = np.nonzero(after != before)[0]
        if written.size:
            reference = reference_logprobs(model, before, mask_id, shift)
            for position in written.tolist():
                expected[position] = reference[position]
        before = after
    return expected


CASES = [
    ("llada", dict(block_length=8, steps=16)),  # one commit per step
    ("llada", dict(block_length=8, steps=4)),  # two per step (a known count > 1)
    ("llada", dict(block_length=8, threshold=0.3)),  # counts the commits decide
    ("llada", dict(block_length=8, threshold=0.3, editing_threshold=0.2, max_post_steps=4)),
    ("dream", dict(steps=8)),  # the whole canvas, maskgit_plus
    ("dream", dict(block_length=8, steps=16)),
    ("dream", dict(block_length=8, threshold=0.3)),
]


@pytest.mark.parametrize("family,options", CASES, ids=[f"{f}-{o}" for f, o in CASES])
def test_each_token_keeps_the_log_probs_of_the_step_that_committed_it(family, options, request):
    loaded = request.getfixturevalue(family)
    model = loaded[0]
    shift = adapter_for(*loaded).family.lower().startswith("dream")
    drafts = []
    responses = list(
        mld.stream_generate(
            *loaded, PROMPT, max_tokens=16, draft_callback=lambda s: drafts.append(s.canvas[0].copy()), **options
        )
    )
    mask_id = adapter_for(*loaded).mask_id
    start = np.array(PROMPT + [mask_id] * (len(drafts[0]) - len(PROMPT)))
    expected = expected_vectors(model, drafts, start, mask_id, shift)
    assert len(responses) >= 8
    for i, r in enumerate(responses):
        position = len(PROMPT) + i
        assert r.token == drafts[-1][position]
        got = np.array(r.logprobs, dtype=np.float64)
        np.testing.assert_allclose(got, expected[position], atol=2e-5, rtol=0)
        assert int(np.argmax(got)) == r.token  # greedy: the kept vector proposed the token


def kept_steps(loaded, **options):
    adapter = adapter_for(*loaded)
    resolved = resolve(DecodeOptions(max_tokens=16, **options), adapter, len(PROMPT))
    return list(Engine(adapter, resolved).run(mx.array([PROMPT])))


def test_a_step_keeps_the_rows_it_committed_only(llada):
    """One commit per step: one row of V per record (after the block's first step, which
    commits one too), never the block's width."""
    steps = kept_steps(llada, block_length=8, steps=16)
    records = steps[-1].kept.records
    assert isinstance(steps[-1].kept, KeptLogprobs)
    assert len(records) == 8  # the last block's eight steps
    assert all(r.logprobs.shape[1] == 1 for r in records)
    # two per step: rows in a bucket of two, both committed
    records = kept_steps(llada, block_length=8, steps=4)[-1].kept.records
    assert [r.logprobs.shape[1] for r in records] == [2, 2, 2, 2]
    assert all(bool(mx.all(r.valid)) for r in records)


def test_dense_block_logprobs_match_the_per_token_vectors(llada):
    """Step.block_logprobs (the whole block, built from the records) holds each committed
    position's vector and zeros at the masks still open."""
    for step in kept_steps(llada, block_length=8, threshold=0.3):
        dense = np.array(step.block_logprobs)
        start, end = step.block
        for position in range(start, end):
            row = np.array(step.logprobs(0, position))
            np.testing.assert_array_equal(dense[0, position - start], row)
            if step.canvas[0, position] == adapter_for(*llada).mask_id:
                assert not row.any()
        values = step.token_logprobs(0, start, end)
        for position, value in values.items():
            assert value == pytest.approx(float(dense[0, position - start, step.canvas[0, position]]), abs=0)


@pytest.mark.parametrize(
    "options", [dict(block_length=8, steps=16), dict(block_length=8, threshold=0.3)], ids=["quota", "threshold"]
)
def test_a_batch_keeps_each_rows_log_probs(llada, options):
    """A running batch (its rows' commits fused: fused_commit) records each row's commits
    as a lone decode does: every token's log-prob equals the lone decode's vector at it."""
    from mlx_lm_diffusion.api.batch_generate import generate_batch

    model, tok = llada
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:]]
    batch = generate_batch(model, tok, prompts, max_tokens=12, return_logprobs=True, return_token_ids=True, **options)
    for prompt, tokens, values in zip(prompts, batch.token_ids, batch.logprobs):
        alone = list(mld.stream_generate(model, tok, prompt, max_tokens=12, **options))
        assert tokens == [r.token for r in alone][: len(tokens)]
        assert len(values) == len(tokens) > 0
        for value, r in zip(values, alone):
            assert value == pytest.approx(float(r.logprobs[r.token]), abs=1e-5)
