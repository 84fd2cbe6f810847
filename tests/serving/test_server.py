"""The OpenAI-compatible server, driven with the official `openai` client on 127.0.0.1.

One server per module, started in-process on a free port (port 0) with the tiny
LLaDA checkpoint; one test also starts it as `python -m mlx_lm_diffusion.server`.
Every wait is bounded by a client timeout.
"""

import concurrent.futures
import http.client
import json
import os
import socket
import sys
from pathlib import Path

import mlx_lm.server
import numpy as np
import openai
import pytest
from server_runs import console_server, running_server

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.serving import startup as dserver
from mlx_lm_diffusion.serving.jobs import Job
from mlx_lm_diffusion.serving.openai_requests import merge_options
from mlx_lm_diffusion.testing.checkpoints import EOS_ID, EOT_ID

TIMEOUT = 120  # seconds any single client call may take before the test fails
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(llada_path, tmp_path_factory):
    """(httpd, response generator) of a server on 127.0.0.1:<free port>."""
    import huggingface_hub.constants as hf_constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf") / "hub"))
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", True)
        with running_server(["--model", str(llada_path), "--port", "0", "--max-tokens", str(MAX_TOKENS)]) as served:
            yield served


@pytest.fixture(scope="module")
def port(served):
    return served[0].server_address[1]


@pytest.fixture(scope="module")
def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def chat_ids(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True)


def library(llada, ids, max_tokens=MAX_TOKENS, **options):
    model, tok = llada
    responses = list(mld.stream_generate(model, tok, ids, max_tokens=max_tokens, **options))
    return [r.token for r in responses], responses


def text_of(responses):
    """The text mlx_lm.server sends for these responses (it drops the EOS step's text)."""
    keep = responses[:-1] if responses[-1].finish_reason == "stop" else responses
    return "".join(r.text for r in keep)


def answer_tokens(tok, responses):
    """usage.completion_tokens: the answer's tokens, not its EOS nor tokens without text."""
    keep = responses[:-1] if responses[-1].finish_reason == "stop" else responses
    return sum(tok.decode([r.token]) != "" for r in keep)


def raw(port, method, path, body=None, headers=None):
    """(status, parsed JSON body) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data)
    finally:
        conn.close()


USER = [{"role": "user", "content": "Hello"}]


def test_chat_completion_equals_library(client, llada):
    r = client.chat.completions.create(model="default_model", messages=USER, temperature=0)
    ids = chat_ids(llada[1], USER)
    tokens, responses = library(llada, ids)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text_of(responses)
    assert choice.finish_reason == responses[-1].finish_reason
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == answer_tokens(llada[1], responses)
    assert r.object == "chat.completion"


def test_streaming_chat_sends_committed_tokens(client, llada):
    ids = chat_ids(llada[1], USER)
    _, responses = library(llada, ids)
    chunks = list(
        client.chat.completions.create(
            model="default_model",
            messages=USER,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(content) == text_of(responses)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [responses[-1].finish_reason]
    assert chunks[-1].usage.completion_tokens == answer_tokens(llada[1], responses)


def test_text_completion_equals_library(client, llada):
    model, tok = llada
    r = client.completions.create(model="default_model", prompt="Once upon a time", max_tokens=8)
    _, responses = library(llada, tok.encode("Once upon a time"), max_tokens=8)
    assert r.choices[0].text == text_of(responses)
    assert r.object == "text_completion"
    streamed = client.completions.create(model="default_model", prompt="Once upon a time", max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text_of(responses)


def test_logprobs_and_top_logprobs(client, llada):
    ids = chat_ids(llada[1], USER)
    tokens, responses = library(llada, ids)
    r = client.chat.completions.create(model="default_model", messages=USER, logprobs=True)
    content = r.choices[0].logprobs.content
    assert [c.model_extra["id"] for c in content] == tokens
    for c, resp in zip(content, responses):
        assert c.logprob == pytest.approx(resp.logprobs[resp.token].item(), abs=1e-5)
    r = client.chat.completions.create(model="default_model", messages=USER, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(tokens)
    for c, token in zip(content, tokens):
        top = c.top_logprobs
        assert len(top) == 3
        best = max(t.logprob for t in top)
        # greedy decoding commits the most likely token of its position
        assert [t.model_extra["id"] for t in top if t.logprob == best] == [token]


def test_stop_strings(client, llada):
    full = client.chat.completions.create(model="default_model", messages=USER, max_tokens=16)
    text = full.choices[0].message.content
    stop = next(ch for ch in text[3:] if ch.isascii() and ch.isprintable())
    for stream in (False, True):
        r = client.chat.completions.create(
            model="default_model", messages=USER, max_tokens=16, stop=[stop], stream=stream
        )
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            got, reason = r.choices[0].message.content or "", r.choices[0].finish_reason
        assert reason == "stop"
        assert stop not in got
        assert text.startswith(got)
        assert len(got) < len(text)


def test_temperature_top_p_and_seed(client, llada):
    """Sampling goes through mlx_lm.server's sampler and seed: reproducible per seed,
    and equal to the library decode with the same sampler and seed."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    def sample(seed):
        r = client.chat.completions.create(model="default_model", messages=USER, temperature=1.0, top_p=0.9, seed=seed)
        return r.choices[0].message.content

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    mx.random.seed(7)
    _, responses = library(llada, chat_ids(llada[1], USER), sampler=make_sampler(1.0, top_p=0.9))
    assert first == text_of(responses)
    assert other != first or sample(9) != first  # the seed matters


def test_max_tokens_past_the_context_is_fitted(client, llada):
    r = client.chat.completions.create(
        model="default_model",
        messages=USER,
        max_tokens=100_000,
        logprobs=True,
        extra_body={"block_length": 64, "steps": 1},
        logit_bias={str(EOS_ID): -1e9, str(EOT_ID): -1e9},
    )
    ids = chat_ids(llada[1], USER)
    entries = r.choices[0].logprobs.content  # (one per generated token, those without text too)
    assert len(entries) == llada[0].max_length - len(ids)
    assert r.usage.completion_tokens == sum(llada[1].decode([e.model_extra.get("id", 0)]) != "" for e in entries)
    assert r.choices[0].finish_reason == "length"


def test_per_request_diffusion_fields(client, llada):
    ids = chat_ids(llada[1], USER)
    for fields in (
        {"block_length": 4, "steps": 2},
        {"threshold": 0.5},
        {"strategy": "entropy_bound", "entropy_bound": 1.0},
        {"threshold": 0.5, "editing_threshold": 0.3},
    ):
        r = client.chat.completions.create(model="default_model", messages=USER, extra_body=fields)
        _, responses = library(llada, ids, **fields)
        assert r.choices[0].message.content == text_of(responses), fields


def test_eight_concurrent_clients_match_serial(client):
    prompts = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(8)]

    def ask(messages):
        r = client.chat.completions.create(model="default_model", messages=messages, temperature=0)
        return r.choices[0].message.content

    serial = [ask(m) for m in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, prompts, timeout=8 * TIMEOUT))
    assert together == serial


def test_drafts_are_sse_comments(client, port, llada):
    body = {"messages": USER, "stream": True, "drafts": True, "block_length": 4}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 200
        lines = [line.decode().rstrip("\n") for line in resp]
    finally:
        conn.close()
    drafts = [json.loads(line[len(": draft ") :]) for line in lines if line.startswith(": draft ")]
    ids = chat_ids(llada[1], USER)
    _, responses = library(llada, ids, block_length=4)
    assert [d["forwards"] for d in drafts] == list(range(1, responses[-1].forwards + 1))
    assert all(line == "" or line.startswith((": ", "data: ")) for line in lines)
    # OpenAI clients skip the comments and see the same stream as without drafts
    chunks = client.chat.completions.create(
        model="default_model", messages=USER, stream=True, extra_body={"drafts": True, "block_length": 4}
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text_of(responses)


def test_prompt_cache_reuse_is_exact(client, llada):
    """A follow-up turn decodes exactly what a fresh decode of its whole prompt gives. LLaDA
    attends bidirectionally: no prompt KV is reused, so usage reports 0 cached tokens
    (tests/decoding/test_kv_reuse.py covers the families that reuse theirs)."""
    first = client.chat.completions.create(model="default_model", messages=USER)
    messages = USER + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    second = client.chat.completions.create(model="default_model", messages=messages)
    ids = chat_ids(llada[1], messages)
    _, responses = library(llada, ids)
    assert second.choices[0].message.content == text_of(responses)
    assert second.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model="default_model", messages=messages)
    assert again.choices[0].message.content == second.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_disconnect_mid_stream_frees_the_server(client, port, monkeypatch):
    yielded = []
    dispatch = mlx_lm.server.stream_generate

    def counting(*args, **kwargs):
        yielded.append(0)
        for response in dispatch(*args, **kwargs):
            yielded[-1] += 1
            yield response

    monkeypatch.setattr(mlx_lm.server, "stream_generate", counting)  # served one at a time
    emitted = {}  # batched (mlx_lm_diffusion.serving.scheduler): tokens sent per request
    take = Job.take

    def counting_take(self, step, eos_ids, tokenizer):
        ended = take(self, step, eos_ids, tokenizer)
        emitted[id(self)] = self.emitted
        return ended

    monkeypatch.setattr(Job, "take", counting_take)
    max_tokens = 300
    body = {
        "messages": USER,
        "stream": True,
        "max_tokens": max_tokens,
        "logit_bias": {str(EOS_ID): -1e9, str(EOT_ID): -1e9},  # it cannot stop by itself
    }
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    received = b""
    while b"data: " not in received:  # bounded by the socket timeout
        chunk = sock.recv(4096)
        assert chunk, "server closed the stream before the first token"
        received += chunk
    sock.close()
    r = client.chat.completions.create(model="default_model", messages=USER)
    assert r.choices[0].finish_reason in ("stop", "length")
    yielded = yielded or list(emitted.values())
    assert len(yielded) == 2
    assert yielded[0] < max_tokens  # the abandoned decode stopped early


@pytest.mark.parametrize(
    "body,status",
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (json.dumps({"prompt": "x"}), 400),  # chat request without messages
        (json.dumps({"messages": USER, "max_tokens": 0}), 400),
        (json.dumps({"messages": USER, "steps": 0}), 400),
        (json.dumps({"messages": USER, "block_length": "8"}), 400),
        (json.dumps({"messages": USER, "strategy": "nope"}), 400),
        (json.dumps({"messages": USER, "threshold": 2}), 400),
        (json.dumps({"messages": USER, "editing_threshold": -1}), 400),
        (json.dumps({"messages": USER, "strategy": "low_confidence", "threshold": 0.5}), 400),
        (json.dumps({"messages": USER, "drafts": True}), 400),  # drafts need a stream
        (json.dumps({"messages": USER, "drafts": "yes", "stream": True}), 400),
        (json.dumps({"messages": [{"role": "user", "content": "a <|mdm_mask|> b"}]}), 400),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 600}]}), 400),  # > context
        (json.dumps({"messages": "not a list"}), 400),
        (json.dumps({"model": "no/such-model", "messages": USER}), 404),
        (json.dumps({"model": "/no/such/dir", "messages": USER}), 404),
    ],
)
def test_bad_requests_get_4xx_json(port, body, status):
    got, data = raw(port, "POST", "/v1/chat/completions", body=body)
    assert got == status
    error = data["error"]  # OpenAI's shape
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_bad_requests_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default_model", messages=USER, extra_body={"steps": -1})
    assert "steps" in e.value.body["message"]  # OpenAI's shape: {"error": {"message": ...}}
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no/such-model", messages=USER)


def test_unknown_paths_and_health(port, client, llada_path):
    assert raw(port, "GET", "/nope")[0] == 404
    assert raw(port, "POST", "/v1/nope", body=b"{}")[0] == 404
    assert raw(port, "GET", "/health") == (200, {"status": "ok"})
    ids = [m.id for m in client.models.list().data]
    assert Path(llada_path).resolve().name in ids  # (the directory's name: issue 34)
    # the listed id names the served model: no reload, same answers
    r = client.chat.completions.create(model=Path(llada_path).resolve().name, messages=USER)
    assert (
        r.choices[0].message.content
        == client.chat.completions.create(model="default_model", messages=USER).choices[0].message.content
    )


def test_server_survives_faults(port, client):
    """After every kind of bad request above, the server still answers."""
    raw(port, "POST", "/v1/chat/completions", body=b"{bad")
    r = client.chat.completions.create(model="default_model", messages=USER, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_parse_args_takes_mlx_lm_server_flags():
    args = dserver.parse_args(
        [
            "--model",
            "m",
            "--port",
            "9",
            "--top-k",
            "5",
            "--block-length",
            "8",
            "--strategy",
            "threshold",
            "--threshold",
            "0.7",
        ]
    )
    assert (args.model, args.host, args.port, args.top_k) == ("m", "127.0.0.1", 9, 5)
    assert (args.block_length, args.strategy, args.threshold) == (8, "threshold", 0.7)
    assert args.prompt_cache_size == 10  # an mlx_lm.server default
    with pytest.raises(SystemExit):
        dserver.parse_args(["--model", "m", "--threshold", "2"])
    with pytest.raises(SystemExit):
        dserver.parse_args(["--model", "m", "--no-such-flag"])


def test_python_m_server(llada_path, tmp_path):
    """`python -m mlx_lm_diffusion.server` serves the model (the console script runs the
    same `main`)."""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "mlx_lm_diffusion.server",
        "--model",
        str(llada_path),
        "--max-tokens",
        "4",
        "--block-length",
        "2",
    ]
    with console_server(command, env, tmp_path / "server.log") as port:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        r = c.chat.completions.create(model="default_model", messages=USER)
        assert r.usage.completion_tokens <= 4
        assert r.choices[0].finish_reason in ("stop", "length")


def test_console_scripts_point_at_main():
    import importlib

    import tomllib

    scripts = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ("mlx_lm_diffusion.server", "mlx_lm_diffusion.chat"):
        module, func = scripts[name].split(":")
        assert module == name and callable(getattr(importlib.import_module(module), func))


def test_request_fields_over_server_defaults():
    merge = merge_options
    assert merge({"steps": 4, "threshold": 0.9}, {"block_length": 8}) == {
        "steps": 4,
        "threshold": 0.9,
        "block_length": 8,
    }
    # naming another rule drops the default rule's settings
    assert merge({"steps": 4, "threshold": 0.9}, {"strategy": "low_confidence"}) == {
        "steps": 4,
        "strategy": "low_confidence",
    }
    assert merge({"strategy": "entropy_bound"}, {"threshold": 0.5}) == {"threshold": 0.5}


PROTOCOL_REQUEST = {
    "prompt_tokens": [72, 101, 108, 108, 111],
    "target_length": 13,
    "num_steps": 4,
    "mask_schedule": "cosine",
    "temperature_schedule": [0.0] * 4,
    "top_p": 1.0,
}


def test_protocol_endpoint_matches_the_library(port, llada):
    from mlx_lm_diffusion.api.protocol import run_request, validate_response

    status, body = raw(port, "POST", "/v1/diffusion/generate", json.dumps(PROTOCOL_REQUEST))
    assert status == 200
    validate_response(body)
    alone = run_request(*llada, PROTOCOL_REQUEST)
    # (the endpoint's decode is a scheduler row: its head reads the whole block, the library's
    # only the rows it commits from, so confidences agree to float rounding, tokens exactly)
    assert np.allclose(body.pop("confidence"), alone.pop("confidence"), atol=1e-5)
    assert body == alone


@pytest.mark.parametrize(
    "body,word",
    [
        ("{not json", "JSON"),
        (json.dumps(dict(PROTOCOL_REQUEST, top_p=0)), "top_p"),
        (json.dumps({k: v for k, v in PROTOCOL_REQUEST.items() if k != "num_steps"}), "num_steps"),
        (json.dumps(dict(PROTOCOL_REQUEST, mask_schedule="exp")), "mask_schedule"),
        (json.dumps(dict(PROTOCOL_REQUEST, target_length=2)), "target_length"),
    ],
)
def test_protocol_endpoint_rejects_bad_requests(port, client, body, word):
    status, error = raw(port, "POST", "/v1/diffusion/generate", body)
    assert status == 400 and word in error["error"]["message"]
    assert client.completions.create(model="default_model", prompt="Hi", max_tokens=2).choices  # still serving
