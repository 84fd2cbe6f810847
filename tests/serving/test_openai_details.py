"""OpenAI's answers to the letter where clients read them (issue 54, item 2), on the demo and
on a byte-level random checkpoint: the served model's id, a build fingerprint, an empty
string for an empty answer, usage that counts the answer's tokens, OpenAI's ranges for
temperature and top_logprobs, the role in a stream's first delta only, 405 with Allow."""

from __future__ import annotations

import http.client
import json

import openai
import pytest
from server_runs import post_json, running_server

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

ASK = [{"role": "user", "content": "357+468="}]


@pytest.fixture(scope="module")
def demo():
    with running_server(["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        yield httpd.server_address[1]


def raw(port: int, method: str, path: str, body: bytes = b""):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body or None, headers={"Content-Type": "application/json"} if body else {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read() or b"null")
    finally:
        conn.close()


def test_the_answer_names_the_served_model_and_a_build_not_the_host(demo):
    status, models = post_json(demo, "/v1/chat/completions", {"messages": ASK, "max_tokens": 8})
    assert status == 200
    listed = raw(demo, "GET", "/v1/models")[2]["data"][0]["id"]
    assert models["model"] == listed != "default_model"
    fingerprint = models["system_fingerprint"]
    assert fingerprint.startswith("fp_") and not any(w in fingerprint.lower() for w in ("linux", "glibc", "darwin"))


def test_usage_counts_the_answers_tokens_and_an_empty_answer_is_a_string(demo):
    status, body = post_json(demo, "/v1/chat/completions", {"messages": ASK, "max_tokens": 8})
    assert body["choices"][0]["message"]["content"] == "825"
    assert body["usage"]["completion_tokens"] == 3  # (not the two textless <blank>s, nor the EOS)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 3
    status, body = post_json(demo, "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, "stop": ["8"]})
    assert status == 200 and body["choices"][0]["message"]["content"] == ""
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    "field,value,ok",
    [("temperature", 2.0, True), ("temperature", 2.5, False), ("top_logprobs", 20, True), ("top_logprobs", 21, False)],
)
def test_openai_ranges(demo, field, value, ok):
    body = {"messages": ASK, "max_tokens": 8, field: value, "logprobs": True}
    status, answer = post_json(demo, "/v1/chat/completions", body)
    assert status == (200 if ok else 400), answer
    if ok and field == "top_logprobs":
        assert all(len(e["top_logprobs"]) == 20 for e in answer["choices"][0]["logprobs"]["content"])
    if not ok:
        assert answer["error"]["param"] == field


def test_a_streams_role_comes_in_its_first_delta_only(llada_path):
    with running_server(["--model", str(llada_path), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="unused", max_retries=0
        )
        chunks = [
            c
            for c in client.chat.completions.create(
                model="default_model", messages=ASK, max_tokens=24, stream=True, extra_body={"block_length": 4}
            )
            if c.choices
        ]
        assert len(chunks) > 1
        roles = [c.choices[0].delta.role for c in chunks]
        assert roles[0] == "assistant" and not any(roles[1:])


def test_a_route_of_another_method_is_a_405_with_allow(demo):
    for method, path, allowed in (
        ("GET", "/v1/chat/completions", "POST"),
        ("GET", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("POST", "/health", "GET"),
    ):
        status, headers, body = raw(demo, method, path, b"{}" if method == "POST" else b"")
        assert (status, headers.get("Allow")) == (405, allowed), (method, path, body)
        assert body["error"]["code"] == "method_not_allowed"
    assert raw(demo, "GET", "/nope")[0] == 404


def test_a_bad_template_argument_names_no_path_or_repr(llada_path):
    with running_server(["--model", str(llada_path), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        port = httpd.server_address[1]
        for kwargs in ({"tokenizer_kwargs": 3}, {"tokenize": True}, {"tools": 5}):
            status, body = post_json(
                port, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "chat_template_kwargs": kwargs}
            )
            message = body["error"]["message"]
            assert status == 400 and "cannot build a prompt" in message
            assert str(llada_path) not in message and "name_or_path" not in message, message


def test_a_request_rule_replaces_the_servers_rule_defaults():
    """Issue 52's bug: a server started with --threshold 0.9 answers a request's factor (its
    own rule) instead of refusing two rules the client never sent together; strategy,
    schedule and entropy_bound likewise."""
    flags = ["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING", "--threshold", "0.9"]
    with running_server(flags) as (httpd, _):
        port = httpd.server_address[1]
        for rule in ({"factor": 1.0}, {"entropy_bound": 0.5}, {"strategy": "low_confidence"}):
            status, body = post_json(port, "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, **rule})
            assert status == 200 and body["choices"][0]["message"]["content"] == "825", (rule, body)


def test_head_is_answered_where_get_is_and_only_safe_host_names_pass(demo):
    """Issue 55.8: HEAD on a GET route is GET's status and headers without a body (was 501);
    a dotless host name (a rebinding name a search domain completes) is refused like any
    other name the operator did not allow; localhost, *.localhost and IP literals pass."""
    for path in ("/health", "/v1/models", "/studio"):
        conn = http.client.HTTPConnection("127.0.0.1", demo, timeout=60)
        conn.request("HEAD", path)
        response = conn.getresponse()
        assert response.status == 200 and response.getheader("Content-Type")
        assert response.read() == b""
        conn.close()
    for host, status in (
        ("evil", 403),
        ("evil.example.com", 403),
        ("localhost", 200),
        ("app.localhost", 200),
        ("127.0.0.1", 200),
        ("[::1]", 200),
    ):
        conn = http.client.HTTPConnection("127.0.0.1", demo, timeout=60)
        conn.putrequest("GET", "/health", skip_host=True)
        conn.putheader("Host", f"{host}:{demo}")
        conn.endheaders()
        assert conn.getresponse().status == status, host
        conn.close()
