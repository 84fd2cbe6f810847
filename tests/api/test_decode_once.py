"""A request is resolved once and handed down (issue 52.1): one Python `generate` and one
server chat request (batched and serial) each build one adapter and resolve their
options once (mlx_lm_diffusion.api.decode.build_decode); before, a server request built
five adapters and resolved its options three times. The batch doors (`generate_batch`,
evaluation's `generate_until`) build one adapter and each row with build_decode, and a
step-schedule protocol request's decode holds build_decode's Decode."""

import collections
import sys

import pytest
from protocol_requests import greedy_linear
from server_runs import demo_server, post_json

import mlx_lm_diffusion as mld
import model_adapters.base as adapter_base
from mlx_lm_diffusion.api import decode as decode_module
from mlx_lm_diffusion.api.protocol import run_request
from mlx_lm_diffusion.decoding import options as options_module
from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.evaluation.generation import generate_until


@pytest.fixture
def counts(monkeypatch):
    """Counts of adapters built and option resolutions, wherever `resolve` was imported."""
    counted = collections.Counter()
    build, resolve = adapter_base.Adapter.__init__, options_module.resolve

    def counting_build(self, *args, **kwargs):
        counted["adapters"] += 1
        build(self, *args, **kwargs)

    def counting_resolve(*args, **kwargs):
        counted["resolutions"] += 1
        return resolve(*args, **kwargs)

    monkeypatch.setattr(adapter_base.Adapter, "__init__", counting_build)
    for name, module in list(sys.modules.items()):
        if name.startswith(("mlx_lm_diffusion", "model_adapters")) and getattr(module, "resolve", None) is resolve:
            monkeypatch.setattr(module, "resolve", counting_resolve)
    return counted


@pytest.fixture
def built(monkeypatch):
    """Counts of requests built by build_decode, wherever it was imported."""
    counted = collections.Counter()
    build = decode_module.build_decode

    def counting_build_decode(*args, **kwargs):
        counted["decodes"] += 1
        return build(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm_diffusion") and getattr(module, "build_decode", None) is build:
            monkeypatch.setattr(module, "build_decode", counting_build_decode)
    return counted


def test_a_python_generate_builds_one_adapter_and_resolves_once(counts):
    model, tokenizer = mld.load(str(DEMO_MODEL_PATH))
    counts.clear()
    assert mld.generate(model, tokenizer, "357+468=", max_tokens=8)
    assert counts == {"adapters": 1, "resolutions": 1}


@pytest.mark.parametrize("mode", ["batched", "serial"])
def test_a_server_chat_request_builds_one_adapter_and_resolves_once(counts, mode):
    with demo_server(mode) as (httpd, _):
        port = httpd.server_address[1]
        chat = {"messages": [{"role": "user", "content": "357+468="}], "max_tokens": 8}
        assert post_json(port, "/v1/chat/completions", chat)[0] == 200  # (a batch's lane and adapter exist now)
        counts.clear()
        status, answer = post_json(port, "/v1/chat/completions", chat)
        assert status == 200 and answer["choices"][0]["message"]["content"]
        assert counts == {"adapters": 1, "resolutions": 1}


PROMPTS = ("357+468=", "12+30=")


def test_a_batch_builds_one_adapter_and_resolves_once_per_row(counts, built):
    """generate_batch builds each row with build_decode over the batch's one adapter."""
    model, tokenizer = mld.load(str(DEMO_MODEL_PATH))
    counts.clear()
    out = mld.generate_batch(model, tokenizer, list(PROMPTS), max_tokens=8, return_token_ids=True)
    assert counts == {"adapters": 1, "resolutions": len(PROMPTS)} and built == {"decodes": len(PROMPTS)}
    assert all(out.token_ids)  # (each row equals its prompt decoded alone: tests/api/test_doors.py)


def test_an_evaluation_builds_one_adapter_and_resolves_once_per_request(counts, built):
    """evaluation's generate_until (lm-eval's requests) builds each row with build_decode over
    one adapter, and each row's answer is its prompt's `generate` alone (greedy)."""
    model, tokenizer = mld.load(str(DEMO_MODEL_PATH))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    counts.clear()
    run = generate_until(model, tokenizer, prompts, [8, 6], [[], []], {}, batch_size=2)
    assert counts == {"adapters": 1, "resolutions": len(PROMPTS)} and built == {"decodes": len(PROMPTS)}
    for prompt, limit, generation in zip(prompts, (8, 6), run.generations):
        alone = list(mld.stream_generate(model, tokenizer, prompt, max_tokens=limit))
        assert generation.tokens == [r.token for r in alone]
        assert generation.text == "".join(r.text for r in alone) and generation.text
        assert generation.forwards == alone[-1].forwards


def test_a_protocol_request_builds_one_adapter_and_resolves_once(counts, built):
    """The step-schedule protocol's decode holds a Decode from build_decode (its options
    resolved by the same function as every other door's)."""
    model, tokenizer = mld.load(str(DEMO_MODEL_PATH))
    prompt = tokenizer.encode("357+468=")
    request = greedy_linear(prompt)
    counts.clear()
    response = run_request(model, tokenizer, request)
    assert counts == {"adapters": 1, "resolutions": 1} and built == {"decodes": 1}
    assert response["final_tokens"][: len(prompt)] == prompt and response["termination_reason"]
