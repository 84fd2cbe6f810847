"""The step-schedule protocol: schema validation, schedules, traces, bad requests, and the
autoregressive-equivalence invariant against mlx-lm's own greedy generate."""

import copy

import jsonschema
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.api.protocol import REQUEST_SCHEMA, prepare_request, run_request, validate_response
from mlx_lm_diffusion.decoding.schedules import masked_after, quotas
from mlx_lm_diffusion.testing.causal_checkpoints import write_causal
from mlx_lm_diffusion.testing.checkpoints import MASK_ID
from model_adapters import adapter_for

BASE = {
    "prompt_tokens": [72, 101, 108, 108, 111],
    "target_length": 17,
    "num_steps": 5,
    "mask_schedule": "linear",
    "temperature_schedule": [0.0] * 5,
    "top_p": 1.0,
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def causal(request, tmp_path_factory):
    path = write_causal(tmp_path_factory.mktemp(request.param), request.param)
    return mld.load(str(path), autoregressive=True)


def test_schedules_sum_to_M_and_end_full():
    for name in ("linear", "cosine", "sigmoid"):
        for total, steps in [(12, 5), (1, 1), (7, 20), (200, 8), (64, 64)]:
            k = quotas(name, total, steps)
            assert sum(k) == total and min(k) >= 0 and len(k) == steps
            assert masked_after(name, total, steps)[-1] == 0
    assert quotas("linear", 64, 64) == [1] * 64  # the AR-equivalence configuration
    assert quotas("linear", 10, 4) == [3, 2, 3, 2]  # floor(10 (1 - (t+1)/4)) = 7, 5, 2, 0
    c = quotas("cosine", 100, 10)
    assert c[0] < c[4]  # cosine starts slow
    s = quotas("sigmoid", 100, 10)
    assert s[0] < s[5] and s[-1] < s[5]  # sigmoid: slow start, slow end


@pytest.mark.parametrize("schedule", ["linear", "cosine", "sigmoid"])
@pytest.mark.parametrize("temperatures,top_p", [([0.0] * 6, 1.0), ([1.0, 0.7, 0.5, 0.0, 2.0, 0.3], 0.9)])
def test_response_validates_and_follows_the_schedule(llada, schedule, temperatures, top_p):
    model, tok = llada
    request = dict(BASE, num_steps=6, mask_schedule=schedule, temperature_schedule=temperatures, top_p=top_p, seed=7)
    response = run_request(model, tok, request)
    validate_response(response)
    P, M = len(BASE["prompt_tokens"]), BASE["target_length"] - len(BASE["prompt_tokens"])
    assert response["final_tokens"][:P] == BASE["prompt_tokens"]
    assert len(response["final_tokens"]) == BASE["target_length"]
    assert MASK_ID not in response["final_tokens"]
    assert len(response["confidence"]) == M
    expected = quotas(schedule, M, 6)
    counts = {s["step"]: len(s["token_indices"]) for s in response["per_step_unmasked"]}
    assert [counts.get(t, 0) for t in range(6)] == expected
    seen = [i for s in response["per_step_unmasked"] for i in s["token_indices"]]
    assert sorted(seen) == list(range(P, P + M))  # absolute positions, each once
    for s in response["per_step_unmasked"]:
        assert [response["final_tokens"][i] for i in s["token_indices"]] == s["unmasked_tokens"]
    full_at_end = sum(expected[:-1]) < M
    assert response["termination_reason"] == ("max_steps_reached" if full_at_end else "fully_unmasked")


def test_sampling_is_reproducible_with_a_seed(llada):
    model, tok = llada
    request = dict(BASE, temperature_schedule=[1.5] * 5, top_p=0.8, seed=11)
    assert run_request(model, tok, request) == run_request(model, tok, request)


def test_confidence_threshold_extension(llada):
    model, tok = llada
    response = run_request(model, tok, dict(BASE, confidence_threshold=1e-6))
    validate_response(response)
    assert response["termination_reason"] == "confidence_threshold_met"
    assert len(response["per_step_unmasked"]) == 1  # everything left was confident enough


def _without(key):
    r = copy.deepcopy(BASE)
    del r[key]
    return r


BAD_REQUESTS = [
    (_without("num_steps"), "num_steps"),
    (_without("top_p"), "top_p"),
    (dict(BASE, num_steps=0, temperature_schedule=[]), "num_steps"),
    (dict(BASE, target_length=5), "target_length"),
    (dict(BASE, target_length=3), "target_length"),
    (dict(BASE, top_p=0), "top_p"),
    (dict(BASE, top_p=1.5), "top_p"),
    (dict(BASE, temperature_schedule=[0.0] * 4), "temperature_schedule"),
    (dict(BASE, mask_schedule="exponential"), "mask_schedule"),
    (dict(BASE, temperature_schedule=[0.0, -1.0, 0.0, 0.0, 0.0]), "temperature_schedule"),
    (dict(BASE, prompt_tokens=[1, MASK_ID]), "mask"),
    ("not an object", "object"),
]


@pytest.mark.parametrize("request_body,word", BAD_REQUESTS)
def test_bad_requests_are_clear_errors(llada, request_body, word):
    model, tok = llada
    with pytest.raises(ValueError, match=word):
        run_request(model, tok, request_body)


def test_spec_top_p_bound_is_corrected():
    """The spec's draft-04 `exclusiveMinimum: true` rejects every top_p under draft-07."""
    spec_form = copy.deepcopy(REQUEST_SCHEMA)
    spec_form["properties"]["top_p"] = {"type": "number", "minimum": 0.0, "exclusiveMinimum": True, "maximum": 1.0}
    literal = jsonschema.Draft7Validator(spec_form)  # the spec as written, not meta-checked
    for top_p in (0.5, 1.0):
        with pytest.raises(jsonschema.ValidationError):
            literal.validate(dict(BASE, top_p=top_p))
        jsonschema.Draft7Validator(REQUEST_SCHEMA).validate(dict(BASE, top_p=top_p))


def _mlx_lm_greedy(model, tok, prompt, max_tokens):
    return [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=max_tokens)]


@pytest.mark.parametrize("prompt", [[72, 101, 108, 108, 111], [5, 9, 200, 31, 7, 64, 250]])
def test_autoregressive_equivalence(causal, prompt):
    """num_steps = M, linear, temperature 0, top_p 1 gives mlx_lm.generate's greedy tokens,
    through the protocol and through generate with block_length 1."""
    model, tok = causal
    M = 24
    reference = _mlx_lm_greedy(model, tok, prompt, M)
    response = run_request(
        model,
        tok,
        {
            "prompt_tokens": prompt,
            "target_length": len(prompt) + M,
            "num_steps": M,
            "mask_schedule": "linear",
            "temperature_schedule": [0.0] * M,
            "top_p": 1.0,
        },
    )
    validate_response(response)
    generated = response["final_tokens"][len(prompt) :]
    assert generated[: len(reference)] == reference  # mlx-lm yields EOS last, if it stops there
    stream = [r.token for r in mld.stream_generate(model, tok, prompt, max_tokens=M, block_length=1)]
    assert stream == reference
    assert all(len(s["token_indices"]) == 1 for s in response["per_step_unmasked"])
    assert [s["token_indices"][0] for s in response["per_step_unmasked"]] == list(
        range(len(prompt), len(prompt) + M)
    )  # left to right, one per step


def test_generate_accepts_schedule(llada):
    model, tok = llada
    out = list(
        mld.stream_generate(
            model, tok, BASE["prompt_tokens"], max_tokens=16, block_length=8, steps=4, schedule="cosine"
        )
    )
    assert out[-1].forwards <= 8
    with pytest.raises(ValueError, match="schedule"):
        mld.generate(model, tok, [72], max_tokens=4, schedule="exp")
    with pytest.raises(ValueError, match="schedule or strategy"):
        mld.generate(model, tok, [72], max_tokens=4, schedule="linear", strategy="low_confidence")


# -- oracles of the spec's loop: one block, the whole generated region


@pytest.fixture(scope="module", params=["sdar", "llada2", "llada2_2"])
def block_causal(request, tmp_path_factory):
    """LLaDA2.2 too: its schedule decides the commits (no edits), over the block-routed forward."""
    from mlx_lm_diffusion.testing.block_checkpoints import write_llada2, write_llada2_2, write_sdar

    writer = {"sdar": write_sdar, "llada2": write_llada2, "llada2_2": write_llada2_2}[request.param]
    return mld.load(str(writer(tmp_path_factory.mktemp(request.param))))


def protocol_oracle(model, tok, prompt, target_length, num_steps, schedule, attention=None, shift=False):
    """The spec's loop, greedy, written from it: every step one forward over the whole
    canvas with the model's own block-causal attention (attention blocks from position 0;
    or `attention`; `shift`: position i is predicted at i - 1, Dream's), the k_t most
    confident masked positions committed with their argmax (never a suppressed id).
    Returns (final tokens, per step the positions committed)."""
    from mlx_arsenal.attention import block_causal_mask

    from model_adapters import adapter_for

    adapter = adapter_for(model, tok)
    x = np.array(prompt + [adapter.mask_id] * (target_length - len(prompt)))
    if attention is None:
        attention = block_causal_mask(target_length, model.args.block_size)
    trace = []
    for k in quotas(schedule, target_length - len(prompt), num_steps):
        masked = np.flatnonzero(x == adapter.mask_id)
        logits = np.array(model(mx.array(x[None]), mask=attention)[0].astype(mx.float32), dtype=np.float64)
        logits = (logits[masked - 1] if shift else logits[masked]).copy()
        logits[:, sorted(adapter.suppress_ids)] = -np.inf
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        chosen = np.argsort(-probs.max(-1), kind="stable")[:k]
        x[masked[chosen]] = probs.argmax(-1)[chosen]
        trace.append(sorted(masked[chosen].tolist()))
    return x.tolist(), trace


def assert_follows_the_oracle(model, tok, prompt_length, target_length, num_steps, schedule, **oracle) -> list:
    """A greedy request's response equals protocol_oracle's loop (tokens, and the positions
    each step commits); returns those positions per step."""
    prompt = list(range(72, 72 + prompt_length))
    response = run_request(
        model,
        tok,
        {
            "prompt_tokens": prompt,
            "target_length": target_length,
            "num_steps": num_steps,
            "mask_schedule": schedule,
            "temperature_schedule": [0.0] * num_steps,
            "top_p": 1.0,
        },
    )
    validate_response(response)
    tokens, trace = protocol_oracle(model, tok, prompt, target_length, num_steps, schedule, **oracle)
    assert response["final_tokens"] == tokens
    assert len(response["confidence"]) == target_length - prompt_length
    steps = {s["step"]: sorted(s["token_indices"]) for s in response["per_step_unmasked"]}
    assert [steps.get(t, []) for t in range(num_steps)] == trace
    return trace


@pytest.mark.parametrize(
    "prompt_length,target_length,num_steps,schedule",
    [(5, 17, 4, "linear"), (3, 24, 6, "cosine"), (4, 8, 4, "linear"), (8, 9, 1, "sigmoid")],
)
def test_block_causal_families_follow_the_schedule(block_causal, prompt_length, target_length, num_steps, schedule):
    """SDAR and LLaDA2 (blocks on absolute positions) decode the whole generated region as
    one block: exactly target_length tokens, k_t commits per step, the oracle's tokens."""
    assert_follows_the_oracle(*block_causal, prompt_length, target_length, num_steps, schedule)


@pytest.mark.parametrize("prompt_length,target_length,num_steps,schedule", [(5, 17, 4, "linear"), (4, 8, 4, "cosine")])
def test_nemotron_follows_the_schedule(nemotron, prompt_length, target_length, num_steps, schedule):
    """Nemotron's decode seeds each block's first token from the causal pass; under the
    protocol the schedule covers every position, so the block forward (the prompt causal,
    the generated region bidirectional over it) predicts the first one too: k_t commits
    per step, the oracle's tokens."""
    allowed = np.tril(np.ones((target_length, target_length), dtype=bool))
    allowed[prompt_length:] = True  # (the generated region sees the prompt and itself)
    trace = assert_follows_the_oracle(
        *nemotron, prompt_length, target_length, num_steps, schedule, attention=mx.array(allowed)
    )
    assert [len(t) for t in trace] == quotas(schedule, target_length - prompt_length, num_steps)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bidirectional_families_follow_the_oracle(family, request):
    """LLaDA and Dream (bidirectional; Dream's logits shifted by one) against the same
    oracle of the spec's loop, attention over the whole canvas."""
    model, tok = request.getfixturevalue(family)
    for prompt_length, target_length, num_steps, schedule in ((5, 17, 4, "linear"), (3, 12, 5, "cosine")):
        everything = mx.ones((target_length, target_length), dtype=mx.bool_)
        assert_follows_the_oracle(
            model, tok, prompt_length, target_length, num_steps, schedule, attention=everything, shift=family == "dream"
        )


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "nemotron", "gemma"])
def test_a_target_past_the_context_is_a_clear_error(family, request):
    """The engine caps a decode at the model's context; the protocol fills target_length, so a
    canvas that cannot fit is refused up front (it was a numpy broadcast error)."""
    model, tok = request.getfixturevalue(family)
    room = adapter_for(model, tok).max_length
    steps = dict(num_steps=2, temperature_schedule=[0.0] * 2)
    fits = prepare_request(model, tok, dict(BASE, target_length=room, **steps))
    assert fits.start.shape[1] == room
    with pytest.raises(ValueError, match=rf"target_length \({room + 1}\) exceeds .* context of {room} tokens"):
        prepare_request(model, tok, dict(BASE, target_length=room + 1, **steps))


def test_a_block_past_the_context_blames_the_block(gemma):
    """DiffusionGemma decodes whole canvases of block_length: one that cannot fit after the
    prompt is the block's fault, not the prompt's."""
    model, tok = gemma
    room = adapter_for(model, tok).max_length
    with pytest.raises(ValueError, match=rf"a block of {room} tokens does not fit the {room - 5} tokens"):
        mld.generate(model, tok, BASE["prompt_tokens"], max_tokens=8, block_length=room)


AR_FILLER = [
    dict(block_length=8, steps=4),  # two positions per step
    dict(block_length=8, strategy="random"),  # a random position, not the next
    dict(block_length=8, strategy="threshold", threshold=1e-9),  # a uniform position passes
    dict(block_length=8, strategy="entropy_bound", entropy_bound=0.5),  # a certain first lets the next pass
]


@pytest.mark.parametrize("options", AR_FILLER)
def test_the_ar_adapter_refuses_rules_that_commit_past_the_next_token(causal, options):
    """Only the next position has a prediction; every later one is uniform, so these rules
    wrote token 0 filler (the first two commits of 8 at steps 4: [131, 0, 48, 0, ...])."""
    model, tok = causal
    with pytest.raises(ValueError, match="predicts one token per forward"):
        mld.generate(model, tok, BASE["prompt_tokens"], max_tokens=8, **options)


def test_the_ar_adapter_refuses_editing_and_multi_token_schedules(causal):
    model, tok = causal
    with pytest.raises(ValueError, match="editing_threshold does not apply"):
        mld.generate(model, tok, BASE["prompt_tokens"], max_tokens=8, block_length=8, editing_threshold=0.5)
    with pytest.raises(ValueError, match="predicts one token per forward"):  # 12 positions in 5 steps
        run_request(model, tok, BASE)


@pytest.mark.parametrize(
    "options", [dict(block_length=8, steps=8), dict(block_length=8, strategy="threshold", threshold=0.9), dict(steps=3)]
)
def test_the_ar_adapter_keeps_rules_that_commit_the_next_token(causal, options):
    model, tok = causal
    reference = _mlx_lm_greedy(model, tok, BASE["prompt_tokens"], 8)
    tokens = [r.token for r in mld.stream_generate(model, tok, BASE["prompt_tokens"], max_tokens=8, **options)]
    assert tokens == reference[: len(tokens)] and len(tokens) == len(reference)


def test_the_ar_check_leaves_the_protocols_rule_untouched(causal):
    """commits_next_only runs the rule over a made-up block: on a copy (the protocol's rule
    records each step's commits and whether its threshold was met)."""
    model, tok = causal
    M = 12
    request = dict(
        BASE,
        target_length=len(BASE["prompt_tokens"]) + M,
        num_steps=M,
        temperature_schedule=[0.0] * M,
        confidence_threshold=0.5,
    )
    decode = prepare_request(model, tok, request)
    assert decode.rule.commits == {} and not decode.rule.threshold_met
