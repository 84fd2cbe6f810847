"""Constrained decoding: the allowed-token set, stateful left-to-right logits processors
(fed one committed token per call, in order, as outlines' processors require) and
JSON-schema output through llguidance that parses against its schema."""

import json
from pathlib import Path

import jsonschema
import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_repetition_penalty, make_sampler

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.decoders.constraints import masks_only
from mlx_lm_diffusion.testing.block_checkpoints import SDAR_MASK
from mlx_lm_diffusion.testing.checkpoints import EOS_ID, MASK_ID, VOCAB
from model_adapters import adapter_for

PROMPT = [72, 101, 108, 108, 111, 44, 32]
LETTERS = list(range(65, 91))  # "A".."Z" in the byte-level test vocabulary


class InOrder:
    """A stateful processor with outlines' contract: the first call sees the prompt,
    every later call exactly one token more, and a token once fed is never retracted
    (its automaton advances by the last token of each call). It allows only the
    letter (A, B, C, ...) that follows the last one fed, so the output is known."""

    def __init__(self, prompt_len):
        self.fed = None
        self.prompt_len = prompt_len
        self.calls = 0

    def __call__(self, tokens, logits):
        tokens = [int(t) for t in tokens.tolist()]
        assert logits.ndim == 2 and logits.shape[0] == 1  # mlx-lm's call: the next position only
        if self.fed is None:
            assert len(tokens) == self.prompt_len
        else:
            assert tokens[:-1] == self.fed, "fed a token out of order, or a retracted one"
        self.fed, self.calls = tokens, self.calls + 1
        want = LETTERS[(len(tokens) - self.prompt_len) % len(LETTERS)]
        return mx.where(mx.arange(logits.shape[-1])[None] == want, logits, -mx.inf)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"threshold": 0.0},
        {"threshold": 0.5, "cache": "dual"},
        {"strategy": "entropy", "steps": 4},
        {"sampler": make_sampler(1.0), "seed": 3},
    ],
)
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_stateful_processor_is_fed_in_order(family, options, request):
    model, tok = request.getfixturevalue(family)
    proc = InOrder(len(PROMPT))
    out = list(
        mld.stream_generate(model, tok, PROMPT, max_tokens=12, block_length=6, logits_processors=[proc], **options)
    )
    tokens = [r.token for r in out]
    assert tokens == LETTERS[: len(tokens)] and len(tokens) == 12
    assert proc.fed == PROMPT + tokens[:-1]  # every token fed is in the output
    assert MASK_ID not in tokens


def test_parallel_commits_survive_the_processor(llada):
    """All of a block's proposals pass an allow-all stateful processor: with threshold
    0 the block commits in one forward, as without the processor."""
    model, tok = llada

    class AllowAll(InOrder):
        def __call__(self, tokens, logits):
            super().__call__(tokens, logits)
            return logits

    proc = AllowAll(len(PROMPT))
    plain = list(mld.stream_generate(model, tok, PROMPT, max_tokens=16, block_length=8, threshold=0.0))
    run = list(
        mld.stream_generate(model, tok, PROMPT, max_tokens=16, block_length=8, threshold=0.0, logits_processors=[proc])
    )
    assert [r.token for r in run] == [r.token for r in plain]
    assert run[-1].forwards == plain[-1].forwards < len(run)


def test_greedy_commits_are_the_processed_argmax(llada):
    """mlx-lm's repetition penalty (it reads the tokens so far): greedy decoding commits
    at each position the argmax of the processed logits (the logprobs reported), and no
    token repeats within the penalty's reach once the penalty dominates."""
    model, tok = llada
    run = list(
        mld.stream_generate(
            model,
            tok,
            PROMPT,
            max_tokens=10,
            block_length=5,
            threshold=0.2,
            logits_processors=[make_repetition_penalty(1e6, 20)],
        )
    )
    tokens = [r.token for r in run]
    assert len(tokens) == 10 and len(set(tokens)) == 10 and not set(tokens) & set(PROMPT)
    for r in run:
        assert float(r.logprobs[r.token]) == pytest.approx(float(mx.max(r.logprobs)), abs=1e-5)


@pytest.mark.parametrize("processor", [make_repetition_penalty(1e6, 20), "bias"], ids=["penalty", "logit_bias"])
def test_a_sampler_draws_from_the_reweighted_logits(llada, processor):
    """A processor that reweights (mlx-lm's repetition penalty, a logit bias) under a
    sampler: each committed token is the sampler's draw from the processed logits. With
    mlx_lm.server's temperature-0 sampler (an argmax) that is the greedy decode with the
    processor; the unprocessed proposal used to stand wherever the processor allowed it."""
    model, tok = llada
    plain = mld.generate(model, tok, PROMPT, max_tokens=10, block_length=5, threshold=0.2)
    if processor == "bias":  # (against the unprocessed decode's first token)
        processor = make_logits_processors({tok.encode(plain, add_special_tokens=False)[0]: -100.0})[0]
    kw = dict(max_tokens=10, block_length=5, threshold=0.2, logits_processors=[processor])
    greedy = [r.token for r in mld.stream_generate(model, tok, PROMPT, **kw)]
    sampled = list(mld.stream_generate(model, tok, PROMPT, sampler=make_sampler(0.0), **kw))
    assert [r.token for r in sampled] == greedy != tok.encode(plain, add_special_tokens=False)


def test_a_sampler_keeps_parallel_commits_under_a_processor_that_only_masks(llada):
    model, tok = llada

    class AllowAll(InOrder):
        def __call__(self, tokens, logits):
            super().__call__(tokens, logits)
            return logits

    kw = dict(max_tokens=16, block_length=8, threshold=0.0, sampler=make_sampler(0.0))
    plain = list(mld.stream_generate(model, tok, PROMPT, **kw))
    run = list(mld.stream_generate(model, tok, PROMPT, logits_processors=[AllowAll(len(PROMPT))], **kw))
    assert [r.token for r in run] == [r.token for r in plain]
    assert run[-1].forwards == plain[-1].forwards < len(run)


def test_masks_only_tells_removed_ids_from_reweighting():
    logprobs = mx.log(mx.softmax(mx.array([[1.0, 2.0, 0.5, -1.0]]), axis=-1))
    removed = logprobs + mx.array([[0.0, -mx.inf, 0.0, -mx.inf]])
    removed = removed - mx.logsumexp(removed, axis=-1, keepdims=True)
    assert masks_only(logprobs, logprobs) and masks_only(logprobs, removed)
    biased = logprobs + mx.array([[0.0, 0.5, 0.0, 0.0]])
    assert not masks_only(logprobs, biased - mx.logsumexp(biased, axis=-1, keepdims=True))
    assert not masks_only(removed, logprobs)  # (ids allowed again)


def test_block_causal_causal_prefix_and_autoregressive(sdar, nemotron, tmp_path):
    from mlx_lm_diffusion.testing.causal_checkpoints import write_causal

    ar = mld.load(str(write_causal(tmp_path / "ar", "qwen3")), autoregressive=True)
    for (model, tok), mask in ((sdar, SDAR_MASK), (nemotron, 100), (ar, -1)):
        proc = InOrder(len(PROMPT))
        tokens = [r.token for r in mld.stream_generate(model, tok, PROMPT, max_tokens=10, logits_processors=[proc])]
        assert tokens == LETTERS[: len(tokens)] and len(tokens) == 10 and mask not in tokens


def test_processors_with_editing_and_where_they_cannot_be_fed_in_order(llada, gemma):
    """Under processors no committed token is left for an edit to revise (commits only
    extend the fed prefix): editing does not run, the processor's order holds; a
    uniform-noise canvas refuses processors."""
    model, tok = llada
    proc = InOrder(len(PROMPT))
    tokens = [
        r.token
        for r in mld.stream_generate(
            model,
            tok,
            PROMPT,
            max_tokens=8,
            block_length=4,
            threshold=0.5,
            editing_threshold=0.0,
            logits_processors=[proc],
        )
    ]
    assert tokens == LETTERS[:8] and proc.fed == PROMPT + tokens[:-1]
    model, tok = gemma
    with pytest.raises(ValueError, match="allowed_tokens"):
        list(mld.stream_generate(model, tok, PROMPT, max_tokens=4, logits_processors=[InOrder(len(PROMPT))]))


ALLOWED = [97, 98, 99, 100, 32]  # "abcd "


@pytest.mark.parametrize("seed", range(4))
def test_allowed_tokens_hold_in_every_family(llada, dream, sdar, nemotron, gemma, seed):
    cases = [(llada, MASK_ID), (dream, MASK_ID), (sdar, SDAR_MASK), (nemotron, 100), (gemma, None)]
    for (model, tok), mask in cases:
        out = list(
            mld.stream_generate(
                model, tok, PROMPT, max_tokens=12, allowed_tokens=ALLOWED, seed=seed, sampler=make_sampler(1.0)
            )
        )
        tokens = [r.token for r in out]
        eos_ids = adapter_for(model, tok).eos_ids
        assert tokens and all(t in ALLOWED or t in eos_ids for t in tokens)
        assert mask not in tokens


def test_allowed_tokens_bad_sets(llada):
    model, tok = llada
    with pytest.raises(ValueError, match="mask token"):
        mld.generate(model, tok, PROMPT, max_tokens=4, allowed_tokens=[MASK_ID])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        mld.generate(model, tok, PROMPT, max_tokens=4, allowed_tokens=[VOCAB])
    only_eos = list(mld.stream_generate(model, tok, PROMPT, max_tokens=4, allowed_tokens=[]))
    assert [r.token for r in only_eos] == [EOS_ID]  # EOS is always allowed


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_json_schema_outputs_parse_against_the_schema(family, request):
    from mlx_lm_diffusion.output.grammar import json_schema_processor

    model, tok = request.getfixturevalue(family)
    for seed in range(6):
        proc = json_schema_processor(tok, model.vocab_size, SCHEMA)
        out = list(
            mld.stream_generate(
                model,
                tok,
                "JSON: ",
                max_tokens=64,
                block_length=16,
                threshold=0.3,
                sampler=make_sampler(1.0),
                seed=seed,
                logits_processors=[proc],
            )
        )
        assert out[-1].finish_reason == "stop", "the grammar ends the value before max_tokens"
        jsonschema.validate(json.loads("".join(r.text for r in out)), SCHEMA)


def test_json_on_the_demo_model():
    from mlx_lm_diffusion.output.grammar import json_schema_processor

    model, tok = mld.load(str(Path(mld.__file__).parent / "demo" / "model"))
    schema = {"type": "integer", "minimum": 0, "maximum": 999}
    for seed in range(4):
        proc = json_schema_processor(tok, model.vocab_size, schema)
        text = mld.generate(
            model,
            tok,
            f"{100 + seed}+{200 + seed}=",
            max_tokens=5,
            logits_processors=[proc],
            sampler=make_sampler(1.0),
            seed=seed,
        )
        jsonschema.validate(json.loads(text), schema)
    # its answers' <blank> padding has no text: the grammar lets it through, so a greedy
    # constrained answer is the unconstrained one (it was "0": blanks forbidden, then a
    # leading zero ended the integer)
    for prompt, answer in (("357+468=", "825"), ("100+200=", "300"), ("12+5=", "17")):
        for options in ({}, {"threshold": 0.9}):
            proc = json_schema_processor(tok, model.vocab_size, {"type": "integer", "minimum": 0, "maximum": 1998})
            assert mld.generate(model, tok, prompt, max_tokens=5, logits_processors=[proc], **options) == answer


def test_tokens_without_text_never_skip_forced_text():
    """The demo's <blank> has no text, so a grammar lets it through where it leaves a
    choice (blanks before an integer's digits); where the grammar forces one token (the
    '{"sum":' of an object), that token comes first: a blank there let the demo, whose
    plain answer begins with blanks, commit one and write its plain answer after it."""
    import mlx.core as mx

    from mlx_lm_diffusion.output.grammar import json_schema_processor

    model, tok = mld.load(str(Path(mld.__file__).parent / "demo" / "model"))
    prompt = mx.array(tok.encode("357+468=", add_special_tokens=False))
    logits = mx.zeros((1, model.vocab_size))

    def allowed(schema, text=""):
        proc = json_schema_processor(tok, model.vocab_size, schema)
        ids = prompt.tolist()
        out = proc(mx.array(ids), logits)
        for token in tok.encode(text, add_special_tokens=False):
            ids.append(token)
            out = proc(mx.array(ids), logits)
        return {tok.convert_ids_to_tokens(i) for i in range(model.vocab_size) if out[0, i].item() > -1e9}

    assert allowed({"type": "integer"}) == set("-0123456789") | {"<blank>"}
    obj = {
        "type": "object",
        "properties": {"sum": {"type": "integer"}},
        "required": ["sum"],
        "additionalProperties": False,
    }
    assert allowed(obj) == {"{"} and allowed(obj, '{"su') == {"m"}  # forced: no blank
    assert "<blank>" in allowed(obj, '{"sum":')  # a choice: digits, "-" (and padding)


def test_response_formats():
    from mlx_lm_diffusion.output.grammar import response_format_processor

    assert response_format_processor(None, VOCAB, {"type": "text"}) is None
    for bad in (
        {"type": "xml"},
        {"type": "json_schema"},
        "json",
        {"type": "json_schema", "json_schema": {"schema": "{not json"}},
    ):
        with pytest.raises(ValueError):
            response_format_processor(None, VOCAB, bad)


def _outlines_json_processor(model, tok, schema, monkeypatch):
    """outlines' own JSON-schema processor for an mlx-lm model, as its users build it. Only
    its Metal kernel (MLX on Apple GPUs) is swapped for the same bitmask applied with MLX
    ops, so it runs on any MLX backend; its token state (one advance per call) is outlines'."""
    import numpy as np
    import outlines
    import outlines_core.kernels.mlx as kernels
    from outlines.backends.outlines_core import OutlinesCoreBackend

    def apply_token_bitmask(logits, mask):
        bits = np.unpackbits(np.ascontiguousarray(mask).view(np.uint8), bitorder="little")
        allowed = bits.reshape(mask.shape[0], -1)[:, : logits.shape[-1]].astype(bool)
        return mx.where(mx.array(allowed), logits, -mx.inf)

    monkeypatch.setattr(kernels, "apply_token_bitmask", apply_token_bitmask)
    return OutlinesCoreBackend(outlines.from_mlxlm(model, tok)).get_json_schema_logits_processor(
        json.dumps(schema), whitespace_pattern=""
    )  # (compact JSON, as grammar.py asks of llguidance)


# (outlines' regexes do not bound integers by minimum / maximum: the schema keeps to what they enforce)
OUTLINES_SCHEMA = {
    "type": "object",
    "properties": {"a": {"enum": ["x", "yy", 7]}, "b": {"type": "boolean"}, "c": {"type": "string", "maxLength": 3}},
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_the_outlines_processor_that_crashed_works(family, request, monkeypatch):
    pytest.importorskip("outlines")  # (in the `test` extra)
    model, tok = request.getfixturevalue(family)
    block_at_once = _outlines_json_processor(model, tok, OUTLINES_SCHEMA, monkeypatch)
    with pytest.raises(AssertionError):  # what the engine used to call: a whole block of logits
        block_at_once(mx.array(PROMPT), mx.zeros((8, model.vocab_size)))
    for seed, options in enumerate(
        [
            {},
            {"threshold": 0.3},
            {"threshold": 0.3, "sampler": make_sampler(1.0)},
            {"threshold": 0.3, "sampler": make_sampler(1.0)},
        ]
    ):
        proc = _outlines_json_processor(model, tok, OUTLINES_SCHEMA, monkeypatch)
        out = list(
            mld.stream_generate(
                model, tok, "JSON: ", max_tokens=48, block_length=16, seed=seed, logits_processors=[proc], **options
            )
        )
        assert out[-1].finish_reason == "stop"
        jsonschema.validate(json.loads("".join(r.text for r in out)), OUTLINES_SCHEMA)


@pytest.mark.parametrize("strategy", ["low_confidence", "entropy"])
def test_a_block_may_outlast_the_rules_schedule(llada, strategy):
    """2 steps for a block of 8 under a stateful processor (found by the server's fuzz test
    with presence_penalty): past the schedule the walk commits one token per step."""
    model, tok = llada
    proc = InOrder(len(PROMPT))
    out = list(
        mld.stream_generate(
            model, tok, PROMPT, max_tokens=8, block_length=8, steps=2, strategy=strategy, logits_processors=[proc]
        )
    )
    assert [r.token for r in out] == LETTERS[:8] and out[-1].forwards <= 8


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_generate_batch_feeds_each_row_its_own_stateful_processors(family, request):
    """One list of processors per prompt (mlx-lm's BatchGenerator.insert form): each row's
    stateful processor is fed that row's prompt and committed tokens in order, and each
    row's tokens are those of the same prompt decoded alone with its own processor."""
    model, tok = request.getfixturevalue(family)
    prompts = [PROMPT, PROMPT[:3] + [40, 41, 42, 43, 44, 45], [33]]
    procs = [InOrder(len(p)) for p in prompts]
    out = mld.generate_batch(
        model,
        tok,
        prompts,
        max_tokens=[12, 7, 9],
        block_length=6,
        logits_processors=[[p] for p in procs],
        return_token_ids=True,
    )
    for prompt, limit, proc, tokens in zip(prompts, [12, 7, 9], procs, out.token_ids):
        alone = [
            r.token
            for r in mld.stream_generate(
                model, tok, prompt, max_tokens=limit, block_length=6, logits_processors=[InOrder(len(prompt))]
            )
        ]
        assert tokens == alone == LETTERS[:limit]
        assert proc.fed == prompt + tokens[:-1]
    with pytest.raises(ValueError, match="per-prompt lists for 3 prompts"):
        mld.generate_batch(model, tok, prompts, max_tokens=4, logits_processors=[[procs[0]], [procs[1]]])
    with pytest.raises(ValueError, match="not a mix"):
        mld.generate_batch(model, tok, prompts, max_tokens=4, logits_processors=[[procs[0]], procs[1]])
