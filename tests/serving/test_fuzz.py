"""A bounded fuzz test of the server (issue 13): hostile bodies on every route, each
answered with a 2xx or a 4xx whose body is strict JSON (a stream: JSON events ending in
[DONE]), and the server still answering right afterwards. The bodies come from
mlx_lm_diffusion/testing/fuzz_bodies.py, which bench/soak_server.py also runs, by the thousand."""

import http.client
import random

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_runs import running_server

from mlx_lm_diffusion.testing.fuzz_bodies import ROUTES, check_answer, encode, random_body

TIMEOUT = 60
USER = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def port(llada_path):
    # a small forward budget keeps every accepted body cheap on the tiny model
    with running_server(["--model", str(llada_path), "--port", "0", "--max-tokens", "8", "--max-forwards", "64"]) as (
        httpd,
        _,
    ):
        yield httpd.server_address[1]


def exchange(port: int, route: str, data: bytes):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("POST", route, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read()
    finally:
        conn.close()


def answer(port):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    r = client.chat.completions.create(model="default_model", messages=USER, temperature=0, max_tokens=4)
    return r.choices[0].message.content


@pytest.mark.parametrize("route", ROUTES)
def test_every_fuzzed_body_gets_a_clean_json_answer(port, route):
    reference = answer(port)
    problems, served = [], []

    @settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 2**32 - 1))  # a seed: hypothesis's own randoms lean to edge values
    def one(seed: int):
        rng = random.Random(seed)
        body = random_body(rng, route)
        data = encode(body, rng)
        status, content_type, payload = exchange(port, route, data)
        problem = check_answer(status, content_type, payload)
        served.append(200 <= status < 300)
        if problem:
            problems.append((problem, data[:300], payload[:300]))

    one()
    assert not problems, problems[:5]
    assert sum(served) >= len(served) / 10  # the bodies reach the decode, not only the validation
    assert answer(port) == reference  # the server still answers, and the same
