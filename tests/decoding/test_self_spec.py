"""Nemotron-Labs Diffusion self-speculation (`self_spec`, mlx_lm_diffusion.decoding.decoders.speculative).

Checked against an independent oracle (greedy autoregressive decoding written here: one full
causal forward per token, no cache), against the engine's own autoregressive decode (block
length 1), and against mlx-vlm 0.7.10's `linear_spec_generate` on the same checkpoints
(tokens, and its forward count less its prompt pass). Three checkpoints: random weights
(drafts almost never accepted), and two made predictable (mlx_lm_diffusion/testing/nemotron_gemma_checkpoints.py):
drafts accepted in part (every window's trimming is exercised) and whole. Then the cache
(exactly a cold causal prefill of the accepted tokens), streaming, the forward bound, the
doors (batch, CLI, server, protocol) and the options it refuses.
"""

import contextlib
import io
import json

import mlx.core as mx
import numpy as np
import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, forward_bound, resolve
from mlx_lm_diffusion.testing.checkpoints import EOS_ID
from mlx_lm_diffusion.testing.engine_runs import engine_decode, record_batch_sizes
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import NEMOTRON_MASK_ID as MASK_ID
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_nemotron, write_speculable_nemotron
from model_adapters import adapter_for

PROMPTS = [[72, 101, 108, 108, 111, 44, 32], [5, 17, 99, 200, 31, 7, 64, 250, 12], [33]]
LONGEST = 40
WRITERS = {
    "random": lambda path: write_nemotron(path),
    "partial": lambda path: write_speculable_nemotron(path),
    "whole": lambda path: write_speculable_nemotron(path, attractors=(40,), strength=3.0),
    "eos": lambda path: write_speculable_nemotron(path, attractors=(40, 41, EOS_ID)),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("self_spec")
    return {kind: write(root / kind) for kind, write in WRITERS.items()}


@pytest.fixture(scope="module")
def models(paths):
    return {kind: mld.load(str(path)) for kind, path in paths.items()}


def mlx_vlm_model(path):
    """mlx-vlm's Nemotron-Labs Diffusion language model on the same checkpoint."""
    from mlx_vlm.models import nemotron_labs_diffusion as ref

    model = ref.Model(ref.ModelConfig.from_dict(json.loads((path / "config.json").read_text())))
    model.load_weights(list(model.sanitize(mx.load(str(path / "model.safetensors"))).items()), strict=True)
    return model.language_model


def greedy_oracle(model, prompt, max_tokens, eos=()):
    """Greedy autoregressive decoding, literally: a full causal forward per token, the
    argmax of the last position (never the mask token), stopping after an EOS."""
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = np.array(model(mx.array([ids]), mask="causal")[0, -1]).astype(np.float64)
        logits[MASK_ID] = -np.inf
        ids.append(int(np.argmax(logits)))
        if ids[-1] in eos:
            break
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def oracle(models):
    return {
        (kind, i): greedy_oracle(models[kind][0], p, LONGEST)
        for kind in ("random", "partial", "whole")
        for i, p in enumerate(PROMPTS)
    }


# ---------------------------------------------------------------------------- tokens


@pytest.mark.parametrize("kind", ["random", "partial", "whole"])
def test_tokens_are_autoregressive_greedy(models, oracle, kind):
    model, tok = models[kind]
    for i, prompt in enumerate(PROMPTS):
        expected = oracle[(kind, i)]
        assert engine_decode(model, tok, prompt, max_tokens=LONGEST, block_length=1)[0] == expected
        for max_tokens in (1, 2, 9, LONGEST):
            for block_length in (2, 5, 32):
                tokens, forwards = engine_decode(
                    model, tok, prompt, max_tokens=max_tokens, block_length=block_length, self_spec=True
                )
                assert tokens == expected[:max_tokens], (prompt, max_tokens, block_length)
                assert forwards <= 2 * (max_tokens - 1)


def test_drafts_are_accepted_where_the_model_agrees(models):
    """Tokens per forward: about 1/2 with random weights (the bonus token only), more once
    drafts are accepted; whole windows accepted give many tokens per forward."""
    per_forward = {
        kind: LONGEST / engine_decode(*models[kind], PROMPTS[0], max_tokens=LONGEST, block_length=32, self_spec=True)[1]
        for kind in ("random", "partial", "whole")
    }
    assert per_forward["random"] < 0.6 < per_forward["partial"] < per_forward["whole"]
    assert per_forward["whole"] > 2


@pytest.mark.parametrize("kind", ["random", "partial", "whole"])
def test_matches_mlx_vlm_linear_spec_generate(paths, models, kind):
    """The tokens of mlx-vlm's linear_spec_generate and its forward count, less its prompt
    pass (counted there, not here): the same windows, drafts and verifies."""
    model, tok = models[kind]
    reference = mlx_vlm_model(paths[kind])
    # (random weights: every window is a new shape for mlx-vlm's kernels, slow to build)
    block_lengths = (2, 32) if kind == "random" else (2, 8, 32, 64)
    for prompt in PROMPTS[:2] if kind == "random" else PROMPTS:
        for block_length in block_lengths:
            out, nfe = reference.linear_spec_generate(
                mx.array([prompt]), max_new_tokens=LONGEST, block_length=block_length, eos_token_id=-1
            )
            tokens, forwards = engine_decode(
                model, tok, prompt, max_tokens=LONGEST, block_length=block_length, self_spec=True
            )
            assert tokens == out[0, len(prompt) :].tolist(), (prompt, block_length)
            assert forwards == nfe - 1


def test_eos_stops_as_autoregressive_decoding_does(paths, models):
    model, tok = models["eos"]
    reference = mlx_vlm_model(paths["eos"])
    for prompt in PROMPTS:
        ar = [r.token for r in mld.stream_generate(model, tok, prompt, max_tokens=LONGEST, block_length=1)]
        spec = list(mld.stream_generate(model, tok, prompt, max_tokens=LONGEST, self_spec=True))
        assert [r.token for r in spec] == ar == greedy_oracle(model, prompt, LONGEST, eos={EOS_ID})
        assert ar[-1] == EOS_ID and spec[-1].finish_reason == "stop"
        out, _ = reference.linear_spec_generate(
            mx.array([prompt]), max_new_tokens=LONGEST, block_length=32, eos_token_id=EOS_ID
        )
        assert out[0, len(prompt) :].tolist() == ar


def test_allowed_tokens_apply_as_in_autoregressive_decoding(models):
    model, tok = models["partial"]
    allowed = list(range(30, 48)) + [5, 7]
    for prompt in PROMPTS:
        ar = engine_decode(model, tok, prompt, max_tokens=24, block_length=1, allowed_tokens=allowed)[0]
        spec = engine_decode(model, tok, prompt, max_tokens=24, block_length=8, allowed_tokens=allowed, self_spec=True)[
            0
        ]
        assert spec == ar and set(spec) <= set(allowed) | {EOS_ID}


# ---------------------------------------------------------------------------- cache and forwards


def test_cache_is_a_cold_causal_prefill_of_the_accepted_tokens(models):
    """After the decode the cache holds the prompt and every token but the last, each
    accepted window's keys and values kept and the rejected drafts' trimmed: exactly what
    one causal forward over those tokens stores."""
    model, tok = models["partial"]
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()
    prompt = PROMPTS[1]
    resolved = resolve(DecodeOptions(max_tokens=30, block_length=16, self_spec=True), adapter, len(prompt))
    engine = Engine(adapter, resolved)
    last = None
    for last in engine.run(mx.array([prompt])):
        pass
    ids = last.canvas[:, : len(prompt) + 30]
    cache = engine.state.cache
    assert cache[0].offset == ids.shape[1] - 1
    cold = model.make_kv_cache()
    model.backbone(mx.array(ids[:, :-1]), "causal", cold)
    for ours, theirs in zip(cache, cold):
        n = theirs.offset
        assert float(mx.abs(ours.keys[..., :n, :] - theirs.keys[..., :n, :]).max()) <= 1e-5
        assert float(mx.abs(ours.values[..., :n, :] - theirs.values[..., :n, :]).max()) <= 1e-5


def test_forward_bound_and_count(models):
    model, tok = models["whole"]
    adapter = adapter_for(model, tok)
    for max_tokens in (1, 7, 30):
        resolved = resolve(DecodeOptions(max_tokens=max_tokens, self_spec=True), adapter, 5)
        assert forward_bound(resolved, adapter, 5) == 2 * (max_tokens - 1)
    # the seed, then windows accepted whole, each doubling: 8 (1 + 7 drafted), 16, and the
    # 15 tokens left; 2 forwards a window
    _, forwards = engine_decode(model, tok, PROMPTS[0], max_tokens=LONGEST, block_length=32, self_spec=True)
    assert forwards == 2 * 3


# ---------------------------------------------------------------------------- streaming


def test_stream_one_event_per_forward_tokens_left_to_right(models):
    model, tok = models["partial"]
    prompt = PROMPTS[0]
    P = len(prompt)
    steps = []
    responses = list(
        mld.stream_generate(
            model, tok, prompt, max_tokens=30, block_length=16, self_spec=True, draft_callback=steps.append
        )
    )
    assert [s.forwards for s in steps] == list(range(1, responses[-1].forwards + 1))
    tokens = [r.token for r in responses]
    assert tokens == [r.token for r in mld.stream_generate(model, tok, prompt, max_tokens=30, block_length=1)]
    assert [r.generation_tokens for r in responses] == list(range(1, len(tokens) + 1))
    drafted = 0
    for s in steps:
        final = int(s.final[0])
        assert s.canvas[0, P : P + final].tolist() == tokens[:final]
        if s.forwards % 2 and s.canvas[0, P + final] != MASK_ID:  # a draft step shows its draft
            drafted += 1
    assert drafted > 0
    for r in responses:  # greedy: each token is its verify pass's argmax
        assert abs(float(mx.exp(r.logprobs).sum()) - 1) < 1e-4
        assert int(mx.argmax(r.logprobs)) == r.token


# ---------------------------------------------------------------------------- the doors


def test_batch_rows_match_single_prompts(models):
    model, tok = models["partial"]
    kw = dict(max_tokens=20, block_length=8, self_spec=True, return_token_ids=True)
    rows = mld.generate_batch(model, tok, PROMPTS, **kw).token_ids
    assert rows == [mld.generate_batch(model, tok, [p], **kw).token_ids[0] for p in PROMPTS]
    assert rows == [
        [r.token for r in mld.stream_generate(model, tok, p, max_tokens=20, block_length=1)] for p in PROMPTS
    ]


@pytest.mark.parametrize("kind", ["random", "partial", "whole"])
def test_batch_rows_share_their_verify_passes(models, oracle, kind, monkeypatch):
    """A batch's rows verify their drafts in one causal forward (batched.causal_verify_batch):
    each row still gives the autoregressive greedy tokens and its own forward count."""
    import model_adapters.runtime.batched as batched

    model, tok = models[kind]
    shared = record_batch_sizes(monkeypatch, batched, "causal_verify_batch")
    kw = dict(max_tokens=LONGEST, block_length=16, self_spec=True, return_token_ids=True)
    out = mld.generate_batch(model, tok, PROMPTS, **kw)
    assert out.token_ids == [oracle[kind, i] for i in range(len(PROMPTS))]
    assert max(shared) == len(PROMPTS)  # (every row verifying in one call at some step)
    alone = [mld.generate_batch(model, tok, [p], **kw).forwards[0] for p in PROMPTS]
    assert out.forwards == alone


def test_batched_verify_is_each_rows_verify(models):
    """causal_verify_batch on rows of very different cache lengths and window widths (a short
    row padded past its own tokens) gives each row the logits and cache of its own verify."""
    from mlx_lm_diffusion.decoding.decoders.base import Verify
    from model_adapters.runtime.batched import causal_verify_batch

    model, tok = models["random"]
    adapter = adapter_for(model, tok)
    rng = np.random.default_rng(0)
    rows = [(40, 32), (3, 8), (17, 1), (1, 16)]  # (prompt length, window width)
    prompts = [mx.array(rng.integers(30, 250, (1, n)).astype(np.int32)) for n, _ in rows]
    windows = [mx.array(rng.integers(30, 250, (1, w)).astype(np.int32)) for _, w in rows]
    batched = [adapter.start(p) for p in prompts]
    alone = [adapter.start(p) for p in prompts]
    got = causal_verify_batch(adapter, [Verify(s, w, 0, w.shape[1]) for s, w in zip(batched, windows)])
    for row, (state, window, logits) in enumerate(zip(alone, windows, got)):
        want = adapter.verify(state, window)
        assert logits.shape == want.shape
        np.testing.assert_allclose(np.array(logits), np.array(want), atol=2e-4, err_msg=f"row {row}")
        for a, b in zip(batched[row].cache, state.cache):
            assert a.offset == b.offset
            np.testing.assert_allclose(
                np.array(a.keys[..., : a.offset, :]), np.array(b.keys[..., : b.offset, :]), atol=2e-4
            )
            np.testing.assert_allclose(
                np.array(a.values[..., : a.offset, :]), np.array(b.values[..., : b.offset, :]), atol=2e-4
            )


def _cli(path, *flags):
    import importlib

    cli = importlib.import_module("mlx_lm_diffusion.cli.generate")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["--model", str(path), "--prompt", "Hi", "--max-tokens", "12", *flags])
    return rc, out.getvalue(), err.getvalue()


def test_cli_flag(paths):
    rc, out, err = _cli(paths["partial"], "--self-spec")
    assert rc == 0, err
    rc1, out1, _ = _cli(paths["partial"], "--block-length", "1")
    assert out.split("=" * 10)[1] == out1.split("=" * 10)[1]  # the same text
    rc, _, err = _cli(paths["partial"], "--self-spec", "--temp", "0.7")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "self_spec" in lines[0], err


@pytest.mark.parametrize("flags", [[], ["--no-batch"]], ids=["batched", "serial"])
def test_server_json_field(paths, models, tmp_path, flags):
    import huggingface_hub.constants as hf_constants
    import openai
    from server_runs import running_server

    model, tok = models["partial"]
    messages = [{"role": "user", "content": "Hello"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    expected = "".join(r.text for r in mld.stream_generate(model, tok, ids, max_tokens=16, block_length=1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        with running_server(["--model", str(paths["partial"]), "--port", "0", *flags]) as (httpd, _):
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="unused", max_retries=0, timeout=120
            )
            ask = dict(model="default_model", messages=messages, max_tokens=16, temperature=0.0)
            r = client.chat.completions.create(**ask, extra_body={"self_spec": True})
            assert r.choices[0].message.content == expected
            chunks = client.chat.completions.create(**ask, stream=True, extra_body={"self_spec": True})
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
            with pytest.raises(openai.BadRequestError, match="self_spec"):
                client.chat.completions.create(**{**ask, "temperature": 0.7}, extra_body={"self_spec": True})
            with pytest.raises(openai.BadRequestError, match="self_spec"):
                client.chat.completions.create(**ask, extra_body={"self_spec": True, "threshold": 0.9})


def test_protocol_refuses_it(models):
    from mlx_lm_diffusion.api.protocol import REQUEST_SCHEMA, run_request

    assert REQUEST_SCHEMA["properties"]["self_spec"]["type"] == "boolean"
    request = dict(
        prompt_tokens=PROMPTS[0],
        target_length=15,
        num_steps=4,
        mask_schedule="cosine",
        temperature_schedule=[0.0] * 4,
        top_p=1.0,
        self_spec=True,
    )
    with pytest.raises(ValueError, match="self_spec"):
        run_request(*models["partial"], request)


def test_named_option_everywhere():
    import argparse

    from mlx_lm_diffusion.decoding.options import add_arguments, check_fields, named_options, schema

    assert "self_spec" in named_options() and schema()["self_spec"].json_schema()["type"] == "boolean"
    assert check_fields({"self_spec": True}) == {"self_spec": True}
    assert add_arguments(argparse.ArgumentParser()).parse_args(["--self-spec"]).self_spec is True


@pytest.mark.parametrize(
    "options,word",
    [
        (dict(sampler=lambda logprobs: mx.argmax(logprobs, axis=-1)), "sampler"),
        (dict(temperature_schedule=(0.5,) * 4, steps=4), "steps"),
        (dict(threshold=0.9), "threshold"),
        (dict(strategy="low_confidence"), "strategy"),
        (dict(steps=4), "steps"),
        (dict(editing_threshold=0.5), "editing_threshold"),
        (dict(logits_processors=[lambda tokens, logits: logits]), "logits_processors"),
        (dict(block_length=1), "block_length >= 2"),
        (dict(causal_context=False), "causal_context"),
        (dict(suffix="later"), "suffix|after"),
    ],
)
def test_refused_options(models, options, word):
    model, tok = models["partial"]
    with pytest.raises(ValueError, match=word):
        mld.generate(model, tok, PROMPTS[0], max_tokens=8, self_spec=True, **options)


def test_refused_elsewhere(llada, models):
    with pytest.raises(ValueError, match="self_spec does not apply"):
        mld.generate(*llada, PROMPTS[0], max_tokens=4, self_spec=True)
    with pytest.raises(ValueError, match="self_spec must be True or False"):
        mld.generate(*models["partial"], PROMPTS[0], max_tokens=4, self_spec="yes")


def test_a_batched_row_refused_only_by_its_sampler_is_a_400(models):
    """A served request's Decode is built with mlx_lm.server's sampler and processors, which
    the decoding fields do not show: self_spec under temperature > 0 (or a logit_bias)
    refused there is the client's error, a 400 RequestError, not a 500."""
    import mlx_lm.server as mlx_server

    from mlx_lm_diffusion.serving import jobs
    from mlx_lm_diffusion.serving.errors import RequestError

    model, tokenizer = models["random"]

    def args(temperature, logit_bias=None):
        return mlx_server.GenerationArguments(
            model=None,
            sampling=mlx_server.SamplingArguments(temperature, 1.0, 0, 0.0, 0.0, 0.0),
            logits=mlx_server.LogitsProcessorArguments(logit_bias, 0.0, 20, 0.0, 20, 0.0, 20),
            stop_words=[],
            max_tokens=8,
            num_draft_tokens=0,
            logprobs=False,
            top_logprobs=0,
            seed=0,
            chat_template_kwargs=None,
        )

    prompt = PROMPTS[0]
    greedy = jobs.request_decode(model, tokenizer, prompt, args(0.0), {"self_spec": True}).options
    assert greedy.family["self_spec"] and greedy.sampler is None
    for refused in (args(0.7), args(0.0, {5: 1.0})):
        with pytest.raises(RequestError, match="self_spec") as error:
            jobs.request_decode(model, tokenizer, prompt, refused, {"self_spec": True})
        assert error.value.status == 400


def test_a_checkpoint_commit_rule_does_not_refuse_self_spec(paths, models, tmp_path):
    """A generation_config.json that sets the diffusion decode's rule and steps (as the demo's
    does) is the checkpoint's default for that decode: self_spec does not read it and
    decodes as without the file; a caller who names a rule with self_spec is still refused."""
    import shutil

    path = tmp_path / "with_config"
    shutil.copytree(paths["partial"], path)
    (path / "generation_config.json").write_text(
        json.dumps(
            {"block_length": 16, "steps": 16, "strategy": "low_confidence", "threshold": None, "max_new_tokens": 24}
        )
    )
    model, tokenizer = mld.load(str(path))
    assert dict(model.generation_defaults) == {
        "block_length": 16,
        "steps": 16,
        "strategy": "low_confidence",
        "max_tokens": 24,
    }
    base_model, base_tokenizer = models["partial"]
    for prompt in PROMPTS:
        got = [(r.token, r.forwards) for r in mld.stream_generate(model, tokenizer, prompt, self_spec=True)]
        want = [
            (r.token, r.forwards)
            for r in mld.stream_generate(
                base_model, base_tokenizer, prompt, self_spec=True, block_length=16, max_tokens=24
            )
        ]
        assert got == want and len(got) == 24
    with pytest.raises(ValueError, match="strategy does not apply to self_spec"):
        mld.generate(model, tokenizer, PROMPTS[0], self_spec=True, strategy="low_confidence")


def test_mlx_lms_greedy_sampler_is_greedy_decoding(models):
    """make_sampler(temp=0.0), what mlx-lm's callers pass by default, is the argmax self_spec
    decodes by (it was refused as a sampler); elsewhere it is the decoders' own argmax."""
    from mlx_lm.sample_utils import make_sampler

    model, tok = models["partial"]
    assert mld.generate(
        model, tok, PROMPTS[0], max_tokens=8, self_spec=True, sampler=make_sampler(0.0)
    ) == mld.generate(model, tok, PROMPTS[0], max_tokens=8, self_spec=True)
    assert resolve(DecodeOptions(max_tokens=8, sampler=make_sampler(0.0)), adapter_for(model, tok), 5).sampler is None
