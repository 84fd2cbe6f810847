"""The head over the positions a step reads (mlx_lm_diffusion.decoding.decoders.gathered_rows):
every family and commit rule decodes the same tokens, with the same forward counts and
the same per-token log-probs, whether a step gathers the rows it reads before the output
layer or runs the head over its whole block; the gather really happens (fewer rows, in
bucket sizes), and the padding slots of a bucket never reach a commit.

The exactness against the references is test_decode_parity.py's (and each family's own
tests), which run with the gather on, as every decode does.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.api.protocol import run_request
from mlx_lm_diffusion.decoding.decoders.gathered_rows import bucket, read_positions, spread, take_rows
from mlx_lm_diffusion.decoding.decoders.masked_block import MaskedBlockDecoder
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.causal_checkpoints import write_causal
from model_adapters import adapter_for
from model_adapters.base import DecodeSetup

PROMPT = [72, 101, 108, 108, 111, 5, 17]
BUCKETS = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64}


class Spy:
    """Wraps an adapter's predict_rows: records each call's (K, block width) and, with
    `spike`, overwrites the logits of every padding slot (a slot past the row's masks)
    with a certain proposal of token `spike`: were a padding value ever committed, that
    token would show up."""

    def __init__(self, adapter, spike=None):
        self.calls, self.spike = [], spike
        self.inner = adapter.predict_rows
        adapter.predict_rows = self

    def __call__(self, state, canvas, start, end, rows):
        logits = self.inner(state, canvas, start, end, rows)
        self.calls.append((rows.shape[1], end - start))
        if self.spike is not None:
            masks = mx.sum(canvas[:, start:end] == self.mask_id, axis=1, keepdims=True)
            padding = mx.arange(rows.shape[1])[None, :] >= masks  # read positions come first
            certain = mx.full(logits.shape[-1:], -1e4, logits.dtype)
            certain[self.spike] = 1e4
            logits = mx.where(padding[..., None], certain, logits)
        return logits


def decode(model, tok, gather, spike=None, prompt=PROMPT, **options):
    """(tokens, forwards, log-probs of every emitted token, predict_rows calls)."""
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()
    spy = Spy(adapter, spike)
    spy.mask_id = adapter.mask_id
    resolved = resolve(DecodeOptions(**options), adapter, len(prompt))
    kept, last = {}, None
    for last in Engine(adapter, resolved, gather_rows=gather).run(mx.array([prompt])):
        start, end = last.block
        if last.block_logprobs is not None:
            for position in range(start, end):
                kept[position] = np.array(last.block_logprobs[0, position - start])
    tokens = last.canvas[0, len(prompt) :].tolist()
    return tokens, last.forwards, kept, spy.calls


def assert_same_decode(model, tok, expect_gather=True, **options):
    tokens, forwards, kept, calls = decode(model, tok, True, **options)
    ref_tokens, ref_forwards, ref_kept, ref_calls = decode(model, tok, False, **options)
    assert tokens == ref_tokens
    assert forwards == ref_forwards
    assert ref_calls == []
    assert kept.keys() == ref_kept.keys()
    for position, logprobs in kept.items():
        np.testing.assert_allclose(logprobs, ref_kept[position], atol=1e-4)
    if expect_gather:
        assert calls, "no step gathered its rows"
        assert all(k < width and (k in BUCKETS or k == width) for k, width in calls), calls
    return tokens, calls


# -- the bucket and the gather themselves


def test_buckets_are_few_and_cover_the_count():
    assert [bucket(n, 64) for n in range(1, 13)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12]
    assert bucket(13, 64) == 16 and bucket(17, 64) == 24 and bucket(33, 64) == 48 and bucket(49, 64) == 64
    assert bucket(20, 20) == 20 and bucket(17, 20) == 20  # never past the block
    sizes = {bucket(n, 512) for n in range(1, 513)}
    assert len(sizes) <= 18


def test_read_positions_come_first_and_padding_is_distinct():
    read = mx.array(
        [[False, True, False, True, True, False, False, False], [True, False, False, False, False, False, False, True]]
    )
    rows = read_positions(read, 4)
    assert rows.tolist() == [[1, 3, 4, 0], [0, 7, 1, 2]]
    values = mx.array([[10.0, 11.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0]])
    out = spread(values, rows, mx.zeros((2, 8)))
    assert out.tolist() == [[13, 10, 0, 11, 12, 0, 0, 0], [20, 22, 23, 0, 0, 0, 0, 21]]
    assert take_rows(out, rows).tolist() == values.tolist()


# -- LLaDA and Dream: every commit rule, with and without Fast-dLLM's caches

LLADA_RULES = [
    dict(strategy="low_confidence", steps=8),
    dict(strategy="low_confidence", steps=3),
    dict(strategy="random", steps=4, seed=3),
    dict(threshold=0.3, block_length=12),
    dict(threshold=0.9),
    dict(strategy="factor", factor=1.5),
    dict(strategy="entropy_bound", entropy_bound=0.5),
    dict(strategy="entropy_bounded", entropy_bound=0.8),
    dict(strategy="low_confidence_dynamic", threshold=0.5, steps=4),
    dict(strategy="low_confidence_static", steps=4),
]


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
@pytest.mark.parametrize("rule", LLADA_RULES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
def test_llada_rules_and_caches(llada, rule, cache):
    model, tok = llada
    assert_same_decode(model, tok, **{**dict(max_tokens=24, block_length=8, cache=cache), **rule})


DREAM_RULES = [
    dict(strategy="entropy", steps=12),
    dict(strategy="maskgit_plus", steps=8),
    dict(strategy="topk_margin", steps=12),
    dict(strategy="maskgit_plus", steps=6, alg_temp=0.5, seed=1),
    dict(strategy="origin", steps=6, seed=2),
    dict(threshold=0.5),
]


@pytest.mark.parametrize("rule", DREAM_RULES, ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()))
def test_dream_whole_canvas_rules(dream, rule):
    model, tok = dream
    assert_same_decode(model, tok, max_tokens=20, **rule)


@pytest.mark.parametrize("cache", ["prefix", "dual"])
@pytest.mark.parametrize(
    "rule",
    [dict(strategy="entropy", steps=4), dict(threshold=0.5), dict(strategy="topk_margin", steps=8)],
    ids=lambda r: "-".join(f"{k}={v}" for k, v in r.items()),
)
def test_dream_caches_with_the_shift(dream, rule, cache):
    """Dream's block-first position is predicted from the hidden state kept at the
    block's first forward: gathered or not, the same logits reach it."""
    model, tok = dream
    assert_same_decode(model, tok, max_tokens=24, block_length=8, cache=cache, **rule)


@pytest.mark.parametrize(
    "family, options",
    [
        ("llada", dict(max_tokens=16, block_length=8, steps=16)),  # one commit a step: 8, 7, ..., 1 masks
        ("dream", dict(max_tokens=12, steps=12)),  # the whole canvas, Dream's counts
    ],
)
def test_statistics_cover_the_rows_read_only(request, monkeypatch, family, options):
    """A step whose bucket of masks is the block's width (7 masks of 8: bucket 8) runs the
    head over the whole block, but the passes over the vocabulary (greedy_parts) cover the
    masked rows only, as at every smaller bucket: each step's statistics have exactly as
    many rows as the block had masks before it."""
    from mlx_lm_diffusion.decoding.decoders import masked_block

    rows, real = [], masked_block.greedy_parts
    monkeypatch.setattr(masked_block, "greedy_parts", lambda logits: rows.append(logits.shape[1]) or real(logits))
    adapter = adapter_for(*request.getfixturevalue(family))
    adapter.eos_ids = frozenset()
    resolved = resolve(DecodeOptions(**options), adapter, len(PROMPT))
    masks, before = [], None
    for step in Engine(adapter, resolved).run(mx.array([PROMPT])):
        start, end = step.block
        if step.ran_forward:
            masks.append(end - start if step.step == 0 else before)
        before = int((step.canvas[0, start:end] == adapter.mask_id).sum())
    assert rows == masks
    width = options.get("block_length", options["max_tokens"])
    assert any(m < width and bucket(m, width) == width for m in masks), masks  # (the case is exercised)


def test_sampled_proposals_are_not_gathered(llada):
    """A sampler draws per position: gathering would change the draw's shape and its
    random stream, so those steps run the whole block (same tokens, no gather)."""
    from mlx_lm.sample_utils import make_sampler

    model, tok = llada
    options = dict(max_tokens=16, block_length=8, steps=4, seed=5, sampler=make_sampler(temp=0.8))
    tokens, calls = assert_same_decode(model, tok, expect_gather=False, **options)
    assert calls == []


def test_processors_and_editing_read_the_whole_block(llada):
    model, tok = llada
    processors = [lambda tokens, logits: logits]
    _, calls = assert_same_decode(
        model, tok, expect_gather=False, max_tokens=16, block_length=8, threshold=0.5, logits_processors=processors
    )
    assert calls == []
    _, calls = assert_same_decode(
        model, tok, expect_gather=False, max_tokens=16, block_length=8, threshold=0.5, editing_threshold=0.3
    )
    assert calls == []


@pytest.mark.parametrize(
    "rule", [dict(strategy="low_confidence", steps=5), dict(threshold=0.4), dict(strategy="entropy", steps=9)]
)
def test_padding_never_reaches_a_commit(llada, dream, rule):
    """Padding slots get a certain proposal of token 7: the tokens do not change."""
    for family, (model, tok) in (("llada", llada), ("dream", dream)):
        if family == "llada" and rule.get("strategy") == "entropy":
            continue  # (Dream's algorithm)
        options = dict(max_tokens=18, block_length=9, **rule)
        reference = decode(model, tok, False, **options)[0]
        tokens, _, _, calls = decode(model, tok, True, spike=7, **options)
        assert tokens == reference
        assert any(k > 1 for k, _ in calls)  # there was padding to poison


# -- block-causal, causal-prefix and autoregressive families


@pytest.mark.parametrize(
    "rule",
    [
        dict(strategy="low_confidence_dynamic", threshold=0.5, steps=8),
        dict(strategy="low_confidence_static", steps=4),
        dict(strategy="entropy_bounded", entropy_bound=0.6),
    ],
    ids=["dynamic", "static", "entropy_bounded"],
)
def test_sdar_block_windows(sdar, rule):
    model, tok = sdar
    assert_same_decode(model, tok, max_tokens=24, block_length=8, **rule)


def test_llada2_threshold_and_editing(llada2):
    model, tok = llada2
    assert_same_decode(model, tok, max_tokens=40, block_length=32, threshold=0.95, steps=32)
    # LLaDA2.1 editing reads committed rows too: nothing is gathered, same tokens
    assert_same_decode(
        model, tok, expect_gather=False, max_tokens=40, block_length=32, threshold=0.7, editing_threshold=0.5
    )


@pytest.mark.parametrize("causal_context", [True, False])
@pytest.mark.parametrize(
    "rule", [dict(threshold=0.5), dict(strategy="low_confidence", steps=4)], ids=["threshold", "quota"]
)
def test_nemotron_blocks(nemotron, rule, causal_context):
    model, tok = nemotron
    assert_same_decode(model, tok, max_tokens=24, block_length=8, causal_context=causal_context, **rule)


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    return mld.load(str(write_causal(tmp_path_factory.mktemp("llama"), "llama")), autoregressive=True)


def test_ar_adapter_gathers_its_logits(causal):
    """The ar adapter exposes no hidden states (block_hidden None): predict_rows gathers
    predict's rows, and AR-equivalent decoding is unchanged."""
    model, tok = causal
    assert_same_decode(model, tok, max_tokens=12, block_length=6, steps=6, strategy="low_confidence")


# -- the protocol's schedules (run_request builds its own Engine)


@pytest.mark.parametrize("schedule", ["linear", "cosine", "sigmoid"])
@pytest.mark.parametrize("temperatures", [[0.0] * 6, [1.0, 0.0, 0.5, 0.0, 0.0, 0.0]], ids=["greedy", "mixed"])
def test_protocol_schedules(llada, causal, monkeypatch, schedule, temperatures):
    request = {
        "prompt_tokens": PROMPT,
        "target_length": 23,
        "num_steps": 6,
        "mask_schedule": schedule,
        "temperature_schedule": temperatures,
        "top_p": 1.0,
        "seed": 4,
    }
    # (the ar adapter unmasks one token per step: linear, a step per generated position)
    steps = 23 - len(PROMPT)
    one_per_step = dict(
        request, num_steps=steps, temperature_schedule=(temperatures * steps)[:steps], mask_schedule="linear"
    )
    for (model, tok), request in ((llada, request), (causal, one_per_step)):
        gathered = []
        real = MaskedBlockDecoder._rows_read
        monkeypatch.setattr(
            MaskedBlockDecoder, "_rows_read", lambda self, *a: gathered.append(real(self, *a)) or gathered[-1]
        )
        on = run_request(model, tok, dict(request))
        monkeypatch.setattr(MaskedBlockDecoder, "_rows_read", lambda self, *a: None)
        off = run_request(model, tok, dict(request))
        monkeypatch.undo()
        # (the confidences agree to float32 rounding: the head's matmul over K rows or the
        # block's rounds its last bits differently)
        np.testing.assert_allclose(on.pop("confidence"), off.pop("confidence"), atol=1e-5)
        assert on == off
        assert any(rows is not None for rows in gathered)


@pytest.mark.parametrize("cache", [None, "prefix", "dual"])
def test_predict_rows_is_predict_at_those_rows(dream, cache):
    """The head over gathered hidden states gives predict's logits at those positions,
    Dream's shift included (the block's first position from the kept hidden state)."""
    model, tok = dream
    adapter = adapter_for(model, tok)
    setup = DecodeSetup(resolve(DecodeOptions(max_tokens=16, block_length=8, cache=cache), adapter, 5))
    canvas = mx.array([PROMPT[:5] + [adapter.mask_id] * 16])
    whole, gathered = adapter.start(canvas[:, :5], setup=setup), adapter.start(canvas[:, :5], setup=setup)
    rows = mx.array([[0, 3, 5, 6]])
    for _ in range(2):  # the block's first forward, then (a token committed) a cached step
        full = adapter.predict(whole, canvas, 5, 13)
        some = adapter.predict_rows(gathered, canvas, 5, 13, rows)
        np.testing.assert_allclose(np.array(some), np.array(take_rows(full, rows)), atol=1e-4)
        canvas[0, 6] = 42
