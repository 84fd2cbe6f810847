"""The server against a hostile or careless client (issue 13 parts 1, 4, 5, 6, 7; issue
12 part 6): every bad request gets a clean OpenAI-shaped 4xx, the server stays up and
the next request gets the right answer.

One in-process server per module on 127.0.0.1 (tiny LLaDA checkpoint, short read
timeout, a small connection cap, one extra allowed model); the signal tests start
`python -m mlx_lm_diffusion.server` as a subprocess. Every socket has a timeout.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx_lm.server
import openai
import pytest
from server_runs import running_server

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.serving import openai_requests
from mlx_lm_diffusion.serving import startup as dserver
from mlx_lm_diffusion.serving.errors import Cancelled
from mlx_lm_diffusion.serving.openai_requests import SEED_MAX, request_seed
from mlx_lm_diffusion.serving.routes import PROTOCOL_PATH
from mlx_lm_diffusion.testing.checkpoints import EOS_ID, EOT_ID, write_llada

TIMEOUT = 60
READ_TIMEOUT = 1.0
MAX_CONNECTIONS = 16
USER = [{"role": "user", "content": "Hello"}]
NO_STOP = {str(EOS_ID): -1e9, str(EOT_ID): -1e9}  # a decode that cannot end by itself


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def trap():
    """A local listener standing for the Hub and for image hosts: must receive nothing."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.settimeout(0.2)
    yield sock
    sock.close()


def assert_untouched(trap):
    with pytest.raises((socket.timeout, TimeoutError)):
        conn, _ = trap.accept()
        conn.close()


@pytest.fixture(scope="module")
def served(llada_path, dream_path, trap, tmp_path_factory):
    import huggingface_hub.constants as hf_constants

    endpoint = f"http://127.0.0.1:{trap.getsockname()[1]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf") / "hub"))
        mp.setattr(hf_constants, "HF_HUB_OFFLINE", False)  # the Hub "reachable": the trap
        mp.setattr(hf_constants, "ENDPOINT", endpoint)
        mp.setenv("HF_ENDPOINT", endpoint)
        with running_server(
            [
                "--model",
                str(llada_path),
                "--port",
                "0",
                "--max-tokens",
                "12",
                "--read-timeout",
                str(READ_TIMEOUT),
                "--max-connections",
                str(MAX_CONNECTIONS),
                "--allowed-models",
                str(dream_path),
            ]
        ) as served:
            yield served


@pytest.fixture(scope="module")
def port(served):
    return served[0].server_address[1]


@pytest.fixture(scope="module")
def client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def reference(client):
    """The served model's greedy answer to USER, for "the next request is right"."""
    return answer(client)


def answer(client, **kwargs):
    r = client.chat.completions.create(model="default_model", messages=USER, temperature=0, **kwargs)
    return r.choices[0].message.content


def exchange(port, data: bytes, timeout: float = TIMEOUT):
    """(status, headers, body bytes) of raw bytes sent to the server."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_response(sock)


def read_response(sock):
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
    return status, headers, body


def post(port, body, path="/v1/chat/completions", headers=None):
    """(status, parsed JSON) of one POST."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def request_bytes(body: bytes, headers: str = None, path="/v1/chat/completions") -> bytes:
    if headers is None:
        headers = f"Content-Length: {len(body)}\r\n"
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}\r\n"
    ).encode() + body


def assert_openai_error(data, status=None):
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("server_error" if status and status >= 500 else "invalid_request_error")
    return error


# ----------------------------------------------------------------------------- part 1: bodies

GOOD = json.dumps({"messages": USER, "max_tokens": 4}).encode()


@pytest.mark.parametrize(
    "data,status",
    [
        (request_bytes(GOOD, headers=""), 411),  # no Content-Length
        (request_bytes(GOOD, headers="Transfer-Encoding: chunked\r\n"), 411),
        (request_bytes(GOOD, headers="Content-Length: -5\r\n"), 400),
        (request_bytes(GOOD, headers="Content-Length: abc\r\n"), 400),
        (request_bytes(GOOD, headers="Content-Length: 1e3\r\n"), 400),
        (request_bytes(GOOD, headers="Content-Length: 4\r\nContent-Length: 5\r\n"), 400),
        (request_bytes(b"", headers="Content-Length: 1000000000000\r\n"), 413),
        (request_bytes(b"{" * 1024, headers="Content-Length: 10000001\r\n"), 413),  # over 10 MB
        (request_bytes(b'{"messages": "\xff\xfe"}'), 400),  # not UTF-8
        (request_bytes(b"[" * 100_000 + b"]" * 100_000), 400),  # nested 10^5 deep
        (
            request_bytes(
                json.dumps(
                    {
                        "messages": USER,
                        "x": [
                            [
                                [
                                    [
                                        [
                                            [
                                                [
                                                    [
                                                        [
                                                            [
                                                                [
                                                                    [
                                                                        [
                                                                            [
                                                                                [
                                                                                    [
                                                                                        [
                                                                                            [
                                                                                                [
                                                                                                    [
                                                                                                        [
                                                                                                            [
                                                                                                                [
                                                                                                                    [
                                                                                                                        [
                                                                                                                            [
                                                                                                                                [
                                                                                                                                    [
                                                                                                                                        [
                                                                                                                                            [
                                                                                                                                                [
                                                                                                                                                    [
                                                                                                                                                        [
                                                                                                                                                            [
                                                                                                                                                                [
                                                                                                                                                                    [
                                                                                                                                                                        [
                                                                                                                                                                            [
                                                                                                                                                                                [
                                                                                                                                                                                    [
                                                                                                                                                                                        [
                                                                                                                                                                                            [
                                                                                                                                                                                                [
                                                                                                                                                                                                    [
                                                                                                                                                                                                        [
                                                                                                                                                                                                            [
                                                                                                                                                                                                                [
                                                                                                                                                                                                                    [
                                                                                                                                                                                                                        [
                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                                                        []
                                                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                ]
                                                                                                                                                                                                            ]
                                                                                                                                                                                                        ]
                                                                                                                                                                                                    ]
                                                                                                                                                                                                ]
                                                                                                                                                                                            ]
                                                                                                                                                                                        ]
                                                                                                                                                                                    ]
                                                                                                                                                                                ]
                                                                                                                                                                            ]
                                                                                                                                                                        ]
                                                                                                                                                                    ]
                                                                                                                                                                ]
                                                                                                                                                            ]
                                                                                                                                                        ]
                                                                                                                                                    ]
                                                                                                                                                ]
                                                                                                                                            ]
                                                                                                                                        ]
                                                                                                                                    ]
                                                                                                                                ]
                                                                                                                            ]
                                                                                                                        ]
                                                                                                                    ]
                                                                                                                ]
                                                                                                            ]
                                                                                                        ]
                                                                                                    ]
                                                                                                ]
                                                                                            ]
                                                                                        ]
                                                                                    ]
                                                                                ]
                                                                            ]
                                                                        ]
                                                                    ]
                                                                ]
                                                            ]
                                                        ]
                                                    ]
                                                ]
                                            ]
                                        ]
                                    ]
                                ]
                            ]
                        ],
                    }
                ).encode()
            ),
            400,
        ),
        (request_bytes(b'{"messages": [], "temperature": NaN}'), 400),
        (request_bytes(b'{"messages": [], "temperature": 1e400}'), 400),
        (request_bytes(b'"a string"'), 400),
        (request_bytes(b"null"), 400),  # (once answered with a closed connection: found by the fuzz test)
        (request_bytes(b"null", path="/v1/diffusion/generate"), 400),
    ],
    ids=[
        "no-length",
        "chunked",
        "negative",
        "non-numeric",
        "float",
        "two-lengths",
        "1e12",
        "over-10MB",
        "non-utf8",
        "deep-1e5",
        "deep-70",
        "NaN",
        "1e400",
        "not-an-object",
        "null",
        "null-protocol",
    ],
)
def test_malformed_bodies_get_a_clean_4xx(port, client, reference, data, status):
    got, headers, body = exchange(port, data)
    assert got == status
    assert headers["content-type"] == "application/json"
    assert_openai_error(json.loads(body))
    assert answer(client) == reference  # still serving, same answer


@pytest.mark.parametrize(
    "data,status",
    [
        (b"GET / HTTP/x.y\r\n\r\n", 400),  # http.server's own errors
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"PUT /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 405),
        (b"BREW /pot HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 501),
        (b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 404),
    ],
)
def test_protocol_level_errors_are_json(port, data, status):
    got, headers, body = exchange(port, data)
    assert got == status and headers["content-type"] == "application/json"
    assert_openai_error(json.loads(body), got)


def test_body_limit_flag_default_and_override():
    assert dserver.parse_args(["--model", "m"]).max_body_bytes == 10_000_000
    assert dserver.parse_args(["--model", "m", "--max-body-bytes", "1MB"]).max_body_bytes == 1_000_000


BAD_FIELDS = [
    ("seed", -1),
    ("seed", 2**64),
    ("seed", "7"),
    ("seed", True),
    ("seed", 1.5),
    ("temperature", 1e30),
    ("temperature", -1e30),
    ("temperature", "0.5"),
    ("temperature", -0.1),
    ("top_p", 1e30),
    ("top_p", -1e30),
    ("min_p", 1e30),
    ("min_p", -1e30),
    ("repetition_penalty", 1e30),
    ("presence_penalty", -1e30),
    ("presence_penalty", 1e30),
    ("frequency_penalty", 1e30),
    ("frequency_penalty", -1e30),
    ("xtc_probability", 1e30),
    ("repetition_context_size", 10**12),
    ("top_logprobs", True),
    ("top_logprobs", "3"),
    ("top_logprobs", 1.5),
    ("top_logprobs", 100),
    ("stream_options", "yes"),
    ("stream_options", []),
    ("stream_options", {"include_usage": "yes"}),
    ("max_tokens", True),
    ("max_tokens", 2.5),
    ("top_k", True),
    ("stop", 5),
    ("stop", [1]),
    # token ids against the served model's vocabulary (288): past it was a segfault or a 500
    ("top_k", 288),
    ("top_k", 10**6),
    ("logit_bias", {"288": 1}),
    ("logit_bias", {"100000": 5}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"x": 1}),
    ("chat_template_kwargs", []),
    ("chat_template_kwargs", {"chat_template": "{% for i in range(9**9) %}{% endfor %}"}),
    ("model", 5),
    ("draft_model", "/tmp"),
    ("adapters", "/tmp"),
    ("num_draft_tokens", 3),
]


@pytest.mark.parametrize("name,value", BAD_FIELDS, ids=[f"{n}={v!r}"[:40] for n, v in BAD_FIELDS])
def test_bad_fields_get_a_400_naming_the_field(port, name, value):
    status, data = post(port, {"messages": USER, "stream": name == "stream_options", name: value})
    assert status == 400
    error = assert_openai_error(data)
    if name != "model":
        assert error["param"] == name


def test_fields_at_their_bounds_are_served(client, reference):
    assert answer(client, seed=2**64 - 1) == reference
    assert answer(client, extra_body={"top_k": 287}) == reference
    assert answer(client, logit_bias={"0": -1.0, "287": -1.0})  # (a processor: decoded in order)
    assert answer(client, seed=0, presence_penalty=0.0, top_p=1, extra_body={"min_p": 0}) == reference
    # a stream_options without include_usage (mlx_lm.server indexes it unchecked)
    chunks = list(
        client.chat.completions.create(
            model="default_model", messages=USER, temperature=0, stream=True, stream_options={}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference


# ----------------------------------------------------------------------------- part 2: bounded work


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": USER, "schedule": "linear", "steps": 100_000}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 12, "block_length": 1, "steps": 2_000}),
        (
            "/v1/diffusion/generate",
            {
                "prompt_tokens": [72, 101],
                "target_length": 6,
                "num_steps": 100_000,
                "mask_schedule": "cosine",
                "temperature_schedule": [0.0] * 100_000,
                "top_p": 1.0,
            },
        ),
    ],
)
def test_requests_over_the_forward_budget_get_a_400_before_anything_runs(
    port, client, reference, path, body, monkeypatch
):
    from mlx_lm_diffusion.decoding import engine

    ran = []
    monkeypatch.setattr(engine.Engine, "run", lambda *a, **k: ran.append(1) or iter(()))
    status, data = post(port, body, path=path)
    monkeypatch.undo()
    assert status == 400 and not ran
    assert f"allows {dserver.DEFAULT_MAX_FORWARDS} per request" in assert_openai_error(data)["message"]
    assert answer(client) == reference


def test_max_forwards_flag(port, served, client, reference, monkeypatch):
    assert dserver.parse_args(["--model", "m"]).max_forwards == dserver.DEFAULT_MAX_FORWARDS
    assert dserver.parse_args(["--model", "m", "--max-forwards", "64"]).max_forwards == 64
    monkeypatch.setattr(served[1].cli_args, "max_forwards", 4)
    status, data = post(port, {"messages": USER, "max_tokens": 12, "block_length": 4, "steps": 4})
    assert status == 400 and "up to 12 model forwards" in assert_openai_error(data)["message"]
    monkeypatch.setattr(served[1].cli_args, "max_forwards", 12)  # at the limit: served
    status, data = post(port, {"messages": USER, "max_tokens": 12, "block_length": 4, "steps": 4})
    assert status == 200


def test_protocol_decode_stops_when_cancelled(llada):
    from mlx_lm_diffusion.api.protocol import run_request

    seen = []

    def on_step(step):
        seen.append(step.forwards)
        if len(seen) == 2:
            raise Cancelled()

    request = {
        "prompt_tokens": [72, 101],
        "target_length": 12,
        "num_steps": 8,
        "mask_schedule": "cosine",
        "temperature_schedule": [0.0] * 8,
        "top_p": 1.0,
    }
    with pytest.raises(Cancelled):
        run_request(*llada, request, on_step=on_step)
    assert seen == [1, 2]


def test_client_chat_templates_only_when_the_operator_allows(port, served, monkeypatch):
    body = {
        "messages": USER,
        "max_tokens": 2,
        "chat_template_kwargs": {"chat_template": "{{ messages[0]['content'] }}"},
    }
    assert post(port, body)[0] == 400
    assert dserver.parse_args(["--model", "m", "--allow-client-chat-templates"]).allow_client_chat_templates
    monkeypatch.setattr(served[1].cli_args, "allow_client_chat_templates", True, raising=False)
    assert post(port, body)[0] == 200


def test_the_openai_client_sees_the_reason(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default_model", messages=USER, temperature=1e30)
    assert "temperature" in e.value.message and e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="someone/else", messages=USER)
    assert e.value.code == "model_not_found" and "someone/else" in e.value.message


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "serial"])
def test_unseeded_requests_draw_from_their_own_key(served, client, monkeypatch, batched):
    """Part 3, isolation: a request that names no seed gets one of its own (drawn on the
    HTTP thread), so its draws never depend on MLX's global random state, which another
    request, a failed compile or a caller may have left anywhere."""
    import mlx.core as mx

    if not batched:
        monkeypatch.setattr(served[1], "scheduler", None)

    def sampled(**kwargs):
        r = client.chat.completions.create(
            model="default_model",
            messages=USER,
            temperature=1.0,
            max_tokens=12,
            extra_body={"logit_bias": NO_STOP},
            **kwargs,
        )
        return r.choices[0].message.content

    monkeypatch.setattr(openai_requests, "request_seed", lambda: 1234)
    first = sampled()
    mx.random.seed(99)  # the global state moved (as another request's draws move it)
    mx.random.uniform(shape=(7,))
    assert sampled() == first
    assert sampled(seed=1234) == first
    assert sampled(seed=4321) != first  # (the check can fail: seeds do change this decode)
    monkeypatch.setattr(openai_requests, "request_seed", lambda: 4321)
    assert sampled() == sampled(seed=4321)
    protocol = {
        "prompt_tokens": [72, 101, 108],
        "target_length": 12,
        "num_steps": 4,
        "mask_schedule": "linear",
        "temperature_schedule": [1.0] * 4,
        "top_p": 1.0,
    }
    status, _, data = exchange(
        port=served[0].server_address[1], data=request_bytes(json.dumps(protocol).encode(), path=PROTOCOL_PATH)
    )
    status_seeded, _, data_seeded = exchange(
        port=served[0].server_address[1],
        data=request_bytes(json.dumps({**protocol, "seed": 4321}).encode(), path=PROTOCOL_PATH),
    )
    assert status == status_seeded == 200 and json.loads(data) == json.loads(data_seeded)


def test_request_seeds_are_fresh_and_in_range():
    seeds = {request_seed() for _ in range(64)}
    assert len(seeds) == 64 and all(0 <= s <= SEED_MAX for s in seeds)


def _failing_after(n):
    """mlx_lm.server's stream_generate, failing after `n` responses."""
    dispatch = mlx_lm.server.stream_generate

    def failing(*args, **kwargs):
        for i, response in enumerate(dispatch(*args, **kwargs)):
            if i == n:
                raise RuntimeError("the decode broke")
            yield response

    return failing


def test_error_after_stream_began_is_an_sse_event(client, port, reference, served, monkeypatch):
    monkeypatch.setattr(served[1], "scheduler", None)  # the serial path (batched: test_scheduler)
    monkeypatch.setattr(mlx_lm.server, "stream_generate", _failing_after(2))
    body = json.dumps({"messages": USER, "stream": True, "logit_bias": NO_STOP}).encode()
    status, headers, data = exchange(port, request_bytes(body))
    assert status == 200 and headers["content-type"] == "text/event-stream"
    events = [line[len("data: ") :] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = assert_openai_error(json.loads(events[-2]), 500)
    assert "the decode broke" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])
    with pytest.raises(openai.APIError, match="the decode broke"):
        list(client.chat.completions.create(model="default_model", messages=USER, stream=True, logit_bias=NO_STOP))
    # not streaming: a status and a JSON body, never a 200 cut short
    status, data = post(port, {"messages": USER, "logit_bias": NO_STOP})
    assert status == 500 and "the decode broke" in assert_openai_error(data, 500)["message"]
    monkeypatch.undo()
    assert answer(client) == reference


def test_responses_are_strict_json_even_with_non_finite_numbers(port, client, reference, served, monkeypatch):
    import dataclasses

    import mlx.core as mx

    dispatch = mlx_lm.server.stream_generate

    def poisoned(*args, **kwargs):  # NaN and -inf log-probabilities, as a broken sampler gives
        for i, r in enumerate(dispatch(*args, **kwargs)):
            fill = float("nan") if i % 2 else -float("inf")
            yield dataclasses.replace(r, logprobs=mx.full(r.logprobs.shape, fill))

    monkeypatch.setattr(served[1], "scheduler", None)  # the serial path, where the poison goes in
    monkeypatch.setattr(mlx_lm.server, "stream_generate", poisoned)

    def strict(raw):
        return json.loads(raw, parse_constant=lambda name: pytest.fail(f"{name} in a response"))

    body = json.dumps({"messages": USER, "logprobs": True, "top_logprobs": 2}).encode()
    status, _, data = exchange(port, request_bytes(body))
    assert status == 200
    content = strict(data)["choices"][0]["logprobs"]["content"]
    assert {c["logprob"] for c in content} <= {None, -9999.0}
    monkeypatch.undo()
    assert answer(client) == reference


# ----------------------------------------------------------------------------- part 5: what a client may touch


@pytest.fixture(scope="module")
def opened():
    """Files and directories opened or listed while `opened.watching` is set."""
    events = []
    state = {"on": False}

    def hook(event, args):
        if state["on"] and event in ("open", "os.listdir", "os.scandir") and args:
            events.append((event, str(args[0])))

    sys.addaudithook(hook)
    return events, state


@pytest.fixture(scope="module")
def loadable(tmp_path_factory):
    return write_llada(tmp_path_factory.mktemp("loadable"), seed=5)  # a real checkpoint, not allowed


@pytest.mark.parametrize("name", ["OTHER", "/etc", ".", "", "..", "owner/name", "/no/such/dir", "~"])
def test_unknown_models_are_404_without_touching_anything(
    served, port, client, reference, trap, opened, loadable, name
):
    name = str(loadable) if name == "OTHER" else name
    events, state = opened
    key = served[1].model_provider.model_key
    events.clear()
    state["on"] = True
    try:
        status, data = post(port, {"model": name, "messages": USER})
    finally:
        state["on"] = False
    assert status == 404
    assert assert_openai_error(data)["code"] == "model_not_found"
    assert not [e for e in events if e[1].startswith(str(loadable)) or e[1] in ("/etc", ".", "..")]
    assert_untouched(trap)  # no Hub
    assert served[1].model_provider.model_key == key  # the served model stays loaded
    assert answer(client) == reference
    status, data = post(
        port,
        {
            "prompt_tokens": [72, 101],
            "target_length": 6,
            "num_steps": 2,
            "mask_schedule": "cosine",
            "temperature_schedule": [0.0, 0.0],
            "top_p": 1.0,
        },
        path="/v1/diffusion/generate",
    )
    assert status == 200  # the protocol route still has its model


def test_allowed_models_are_served(served, client, dream_path, dream, reference, llada_path):
    r = client.chat.completions.create(model=str(dream_path), messages=USER, temperature=0)
    ids = dream[1].apply_chat_template(USER, add_generation_prompt=True)
    responses = list(mld.stream_generate(*dream, ids, max_tokens=12))
    keep = responses[:-1] if responses[-1].finish_reason == "stop" else responses
    assert r.choices[0].message.content == "".join(x.text for x in keep)
    assert answer(client) == reference  # back to --model
    listed = [m.id for m in client.models.list().data]  # (directory names: a client sends them back)
    assert listed == [Path(llada_path).resolve().name, Path(dream_path).resolve().name]
    assert (
        client.chat.completions.create(model=listed[1], messages=USER, temperature=0).choices[0].message.content
        == r.choices[0].message.content
    )
    port = client.base_url.port
    for wanted, status in (
        (str(Path(dream_path).resolve()), 200),
        (listed[1], 200),
        ("default_model", 200),
        ("someone/else", 404),
    ):
        got, headers, body = exchange(port, f"GET /v1/models/{wanted} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        assert got == status
        if status == 200:
            assert json.loads(body)["id"] in listed


def test_image_urls_are_never_fetched(port, trap):
    url = f"http://127.0.0.1:{trap.getsockname()[1]}/cat.png"
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    status, data = post(port, {"messages": messages})
    error = assert_openai_error(data)
    assert status == 400 and "data: URLs" in error["message"] and error["param"] == "messages"
    assert_untouched(trap)


def test_cors_is_off_by_default(port, served, monkeypatch):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200 and resp.getheader("Access-Control-Allow-Origin") is None
    for method in ("POST", "OPTIONS"):
        status, headers, body = exchange(
            port,
            (
                f"{method} /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\n"
                f"Content-Length: {len(GOOD)}\r\n\r\n"
            ).encode()
            + GOOD,
        )
        assert status == 403 and "access-control-allow-origin" not in headers
        assert_openai_error(json.loads(body))
    assert dserver.parse_args(["--model", "m"]).allowed_origins == []
    args = dserver.parse_args(["--model", "m", "--allowed-origins", "http://app.test"])
    monkeypatch.setattr(served[1].cli_args, "allowed_origins", args.allowed_origins)
    status, headers, _ = exchange(
        port, ("OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://app.test\r\n\r\n").encode()
    )
    assert status == 204 and headers["access-control-allow-origin"] == "http://app.test"
    status, headers, body = exchange(
        port,
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://app.test\r\n"
            f"Content-Length: {len(GOOD)}\r\n\r\n"
        ).encode()
        + GOOD,
    )
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.test"


@pytest.mark.parametrize(
    "host,ok",
    [
        ("127.0.0.1:{port}", True),
        ("localhost:{port}", True),
        ("[::1]:{port}", True),
        ("localhost", True),
        ("attacker.example:{port}", False),
        ("rebind.attacker.example", False),
        ("127.0.0.1.nip.io", False),
    ],
)
def test_host_header_is_checked(port, host, ok):
    host = host.format(port=port)
    status, _, body = exchange(port, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    assert status == (200 if ok else 403)
    if not ok:
        assert "allowed-hosts" in assert_openai_error(json.loads(body))["message"]


def test_allowed_hosts_flag(port, served, monkeypatch):
    args = dserver.parse_args(["--model", "m", "--allowed-hosts", "api.example.com,other.test"])
    assert args.allowed_hosts == ["api.example.com", "other.test"]
    monkeypatch.setattr(served[1].cli_args, "allowed_hosts", args.allowed_hosts)
    for host, status in (("api.example.com", 200), ("API.example.com:443", 200), ("evil.example.com", 403)):
        got = exchange(port, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())[0]
        assert got == status, host


def test_logged_bodies_are_truncated_and_escaped(port, caplog):
    forged = b'{"x": "\n2026-01-01 00:00:00 - INFO - forged line\n' + b"y" * 100_000 + b"\xff"
    with caplog.at_level("INFO"):
        status, _, _ = exchange(port, request_bytes(forged))
    assert status == 400
    logged = [r.getMessage() for r in caplog.records if "forged" in r.getMessage()]
    assert logged, "the bad body is logged"
    for message in logged:
        assert "\n" not in message and len(message) < 1000


# ----------------------------------------------------------------------------- part 4: connections


def test_backlog_and_burst_of_connections(served, port):
    assert served[0].request_queue_size >= 128
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS + 32):  # all complete their TCP handshake, none is reset
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT))
    finally:
        for s in socks:
            s.close()


def test_open_connections_are_capped_with_503(served, port, client, reference):
    deadline = time.monotonic() + 10
    while served[0].open_connections() and time.monotonic() < deadline:
        time.sleep(0.05)  # earlier tests' connections gone
    idle = [socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) for _ in range(MAX_CONNECTIONS)]
    try:
        while served[0].open_connections() < MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)
        status, headers, body = exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert status == 503
        assert "max-connections" in assert_openai_error(json.loads(body), 503)["message"]
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while served[0].open_connections() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert answer(client) == reference


def test_32_concurrent_clients_all_answered_as_serial(served, port, monkeypatch):
    """32 clients at once, 8 requests each (the listen backlog and the connection
    cap above them): every request answered, each equal to its serial answer."""
    import concurrent.futures

    monkeypatch.setattr(served[0], "max_connections", 64)
    bodies = [
        {"messages": [{"role": "user", "content": f"Q{i}?"}], "max_tokens": 4, "temperature": 0} for i in range(8)
    ]

    def ask(i):
        status, data = post(port, bodies[i % len(bodies)])
        assert status == 200, data
        return data["choices"][0]["message"]["content"]

    serial = [ask(i) for i in range(len(bodies))]
    start = threading.Barrier(32, timeout=TIMEOUT)

    def client_(k):
        start.wait()
        return [(i, ask(i)) for i in range(k, k + 8 * 32, 32)]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = [a for batch in pool.map(client_, range(32), timeout=8 * TIMEOUT) for a in batch]
    assert len(answers) == 256
    assert all(text == serial[i % len(bodies)] for i, text in answers)


def test_slow_clients_are_closed_while_others_are_served(port, client, reference, capfd):
    slow_headers = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    slow_body = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    try:
        started = time.monotonic()
        slow_headers.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow_body.sendall(request_bytes(b"", headers="Content-Length: 100\r\n") + b'{"mes')
        assert answer(client) == reference  # served meanwhile
        for _ in range(int(4 * READ_TIMEOUT / 0.2)):  # a byte every 0.2 s: still cut at the deadline
            try:
                slow_body.sendall(b" ")
            except OSError:
                break
            time.sleep(0.2)
        for sock in (slow_headers, slow_body):
            try:
                assert sock.recv(1024) == b""  # closed by the server
            except ConnectionResetError:
                pass
        assert time.monotonic() - started < 4 * READ_TIMEOUT + 2
    finally:
        slow_headers.close()
        slow_body.close()
    assert answer(client) == reference
    assert "Traceback" not in capfd.readouterr().err  # closed quietly


def test_a_non_streaming_client_that_leaves_cancels_its_decode(port, client, served, monkeypatch):
    # the serial path, whose decode this counts (batched: test_scheduler's disconnected
    # client); without this the test passed only after another test had loaded a second
    # model, which sends the served one down the serial path
    monkeypatch.setattr(served[1], "scheduler", None)
    yielded = []
    dispatch = mlx_lm.server.stream_generate

    def counting(*args, **kwargs):
        yielded.append(0)
        for response in dispatch(*args, **kwargs):
            yielded[-1] += 1
            time.sleep(0.01)
            yield response

    monkeypatch.setattr(mlx_lm.server, "stream_generate", counting)
    body = json.dumps({"messages": USER, "max_tokens": 300, "logit_bias": NO_STOP}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    sock.sendall(request_bytes(body))
    deadline = time.monotonic() + TIMEOUT
    while not (yielded and yielded[0] >= 2):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    r = client.chat.completions.create(model="default_model", messages=USER, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert len(yielded) == 2 and yielded[0] < 100  # the abandoned decode stopped early


def test_nofile_limit_is_restored():
    """mlx_lm.utils sets RLIMIT_NOFILE to (2048, 4096) at import; the server puts back
    the limits its process started with (its parent's when it cannot know them)."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, before[1]), before[1]))  # as mlx_lm.utils left it
        want = (min(3000, before[1]), before[1])
        assert dserver.restore_nofile(want) == want
        assert dserver.restore_nofile((1024, before[1])) == want  # never lowered
        limits = Path(f"/proc/{os.getppid()}/limits").read_text()
        soft = next(l.split()[3] for l in limits.splitlines() if l.startswith("Max open files"))
        assert str(dserver._parent_nofile()[0]) == soft or soft == "unlimited"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


# ----------------------------------------------------------------------------- issue 12 part 6: start


@pytest.mark.parametrize("kind", ["missing", "empty"])  # empty: fails in the loader itself
def test_bad_model_fails_at_start_before_binding(monkeypatch, capsys, tmp_path, kind):
    bound, restored = [], []
    monkeypatch.setattr(dserver, "make_http_server", lambda *a, **k: bound.append(a))
    monkeypatch.setattr(dserver, "restore_nofile", lambda: restored.append(1))
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        (tmp_path / "empty").mkdir()
        rc = dserver.main(["--model", str(tmp_path / kind), "--port", "0"])
    finally:
        mld.uninstall()
        now = {s: signal.getsignal(s) for s in handlers}
        for s, handler in handlers.items():
            signal.signal(s, handler)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not bound and restored
    assert now == handlers  # main gave the caller's Ctrl-C back (the pytest process's, here)
    assert len(err) == 1 and err[0].startswith("mlx_lm_diffusion.server: error: cannot load --model")


@pytest.mark.parametrize(
    "flags",
    [
        ["--draft-model", "x"],
        ["--num-draft-tokens", "3"],
        ["--kv-bits", "4"],
        ["--kv-group-size", "32"],
        ["--quantized-kv-start", "0"],
        ["--prefill-step-size", "512"],
        ["--pipeline"],
        ["--read-timeout", "0"],
        ["--max-connections", "0"],
        ["--max-forwards", "0"],
        ["--threshold", "2"],
    ],
)
def test_flags_that_cannot_apply_fail_at_start(capsys, flags):
    with pytest.raises(SystemExit) as e:
        dserver.parse_args(["--model", "m", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "error" in err[0]
    if flags[0] not in ("--read-timeout", "--max-connections", "--max-forwards", "--threshold"):
        assert flags[0] in err[0] and "cannot apply" in err[0]


# ----------------------------------------------------------------------------- part 6: signals


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(llada_path, tmp_path, *flags):
    port = _free_port()
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm_diffusion.server", "--model", str(llada_path), "--port", str(port), *flags],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).parents[2],
    )
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "server did not come up"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                if read_response(s)[0] == 200:
                    return proc, port
        except OSError:
            time.sleep(0.3)


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def _read_all(sock):
    received = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return received
        received += chunk


def _events(received):
    return [l[6:] for l in received.decode().split("\n") if l.startswith("data: ")]


def test_sigterm_finishes_in_flight_cancels_the_rest_exits_0(slow_llada_path, tmp_path):
    """SIGTERM during a decode: the request in flight is answered in full, the one
    still streaming when the grace period ends gets an SSE error and [DONE], the one
    still queued a 503, and the server exits 0 without accepting new connections."""
    # (the first request: 96 forwards over a short canvas, seconds; the long one: 1,600
    # over a 1,600-position canvas, minutes: conftest.slow_llada_path)
    grace = 10.0
    # served one at a time, so that a request is still queued (batched: test_scheduler)
    proc, port = _start_server(slow_llada_path, tmp_path, "--shutdown-grace", str(grace), "--no-batch")
    try:
        results = {}

        def long_stream():  # starts after the first, streams far longer than the grace period
            with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
                sock.sendall(
                    request_bytes(
                        json.dumps(
                            {"messages": USER, "stream": True, "max_tokens": 1600, "logit_bias": NO_STOP}
                        ).encode()
                    )
                )
                results["stream"] = _read_all(sock)

        def queued():  # behind both
            results["queued"] = post(port, {"messages": USER, "max_tokens": 400, "logit_bias": NO_STOP})

        first = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        first.sendall(
            request_bytes(
                json.dumps({"messages": USER, "stream": True, "max_tokens": 96, "logit_bias": NO_STOP}).encode()
            )
        )
        received = b""
        while b"data: " not in received:
            chunk = first.recv(4096)
            assert chunk, "the stream ended before its first token"
            received += chunk
        waiters = [threading.Thread(target=long_stream), threading.Thread(target=queued)]
        for w in waiters:
            w.start()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        received += _read_all(first)  # the request in flight completes
        first.close()
        events = _events(received)
        assert events[-1] == "[DONE]"
        assert [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # no longer accepting (once the signal is handled)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
            except OSError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("still accepting connections 5 s after SIGTERM")
        assert proc.wait(timeout=grace + 30) == 0, (tmp_path / "server.log").read_text()[-3000:]
        assert time.monotonic() - signalled < grace + 15
        for w in waiters:
            w.join(timeout=TIMEOUT)
        events = _events(results["stream"])
        assert results["stream"].startswith(b"HTTP/1.0 200") and events[-1] == "[DONE]"
        assert all("choices" in json.loads(e) for e in events[:-2])  # tokens, if any came in time
        error = assert_openai_error(json.loads(events[-2]), 503)
        assert "shutting down" in error["message"]
        status, data = results["queued"]
        assert status == 503 and "shutting down" in assert_openai_error(data, 503)["message"]
        log = (tmp_path / "server.log").read_text()
        assert "terminate called" not in log and "Traceback" not in log
    finally:
        _stop(proc)


def test_sigint_when_idle_exits_0(llada_path, tmp_path):
    proc, port = _start_server(llada_path, tmp_path)
    try:
        assert post(port, {"messages": USER, "max_tokens": 4})[0] == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, (tmp_path / "server.log").read_text()[-3000:]
        log = (tmp_path / "server.log").read_text()
        assert "terminate called" not in log and "Traceback" not in log
    finally:
        _stop(proc)


# ----------------------------------------------------------------------------- part 7: dependencies


def test_base_dependencies_cover_what_the_server_imports():
    """`pip install -e .` alone (no extras) gives every distribution the server and
    the protocol import."""
    import importlib.metadata as md
    import re

    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]

    def name(req):
        return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")

    required, todo = set(), [name(r) for r in project["dependencies"]]
    while todo:  # the base dependencies and theirs
        dist = todo.pop()
        if dist in required:
            continue
        required.add(dist)
        try:
            reqs = md.requires(dist) or []
        except md.PackageNotFoundError:
            continue
        todo += [name(r) for r in reqs if "extra ==" not in r]
    import ast

    root = Path(__file__).parents[2]

    def imported(nodes) -> set:
        found = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        return found

    modules, top = set(), set()  # what the package's own code imports; at module level
    writers = set()  # mlx_lm_diffusion.testing (the test checkpoints' writers): the `test` extra's
    for path in [*(root / "mlx_lm_diffusion").rglob("*.py"), *(root / "model_adapters").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        if "testing" in path.relative_to(root).parts:
            writers |= imported(ast.walk(tree))
            continue
        modules |= imported(ast.walk(tree))
        # (the evaluation's lm-eval side imports lm-eval at module level: the door reaches those
        # modules only after checking that the `eval` extra is installed)
        in_evaluation = "evaluation" in path.relative_to(root).parts
        top |= {m for m in imported(tree.body) if not (in_evaluation and m == "lm_eval")}
    assert "jsonschema" in modules
    # the `vision` extra (images: mlx-vlm, PIL) is imported only inside functions, on use
    vision = {name(r) for r in project["optional-dependencies"]["vision"]}
    vision |= {name(r) for d in list(vision) for r in (md.requires(d) or []) if "extra ==" not in r}
    # so are the `bench` extra (matplotlib: the plots) and the `eval` extra (lm-eval)
    lazy = vision | {name(r) for extra in ("bench", "eval") for r in project["optional-dependencies"][extra]}
    owners = md.packages_distributions()
    own = {"mlx_lm_diffusion", "model_adapters"}

    def owned_by(m, dists) -> bool:
        return any(d.lower().replace("_", "-") in dists for d in owners[m])

    # The `constraints` extra (llguidance) is imported only when a grammar is asked for, and its
    # absence is a clear error there (mlx_lm_diffusion.output.grammar): it need not be a base dependency.
    optional = {name(r) for r in project["optional-dependencies"]["constraints"]}
    missing = {
        m: owners[m]
        for m in sorted(modules - own)
        if m in owners and not owned_by(m, required | optional) and (m in top or not owned_by(m, lazy))
    }
    assert not missing, f"imported but not base dependencies (nor the vision, bench or eval extras, lazily): {missing}"
    extras = {name(r) for extra in ("test", "vision") for r in project["optional-dependencies"][extra]}
    uncovered = {m for m in writers - own if m in owners and not owned_by(m, required | extras)}
    assert not uncovered, f"the checkpoint writers import what no extra installs: {uncovered}"
