"""`n` choices and lists of prompts (issue 34, items 2 and 3): the choices are decoded as
rows of one batch, answered in OpenAI's order (prompt by prompt, n each), streams carry
their choice's index, usage counts each prompt once and every choice's tokens."""

from __future__ import annotations

import http.client
import json

import openai
import pytest
from openai_schema import check
from server_runs import demo_server, post_json, running_server

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

USER = [{"role": "user", "content": "357+468="}]


@pytest.fixture(scope="module", params=["batched", "serial"])
def server(request):
    with demo_server(request.param) as s:
        yield s


def port_of(server) -> int:
    return server[0].server_address[1]


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port_of(server)}/v1", api_key="x", max_retries=0, timeout=120)


def stream(server, path: str, body: dict):
    """The data events of a streamed answer (the [DONE] checked and dropped)."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    events = [line[len("data: ") :] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


def test_n_choices_in_one_answer(server):
    one = client_of(server).chat.completions.create(model="default_model", messages=USER)
    r = client_of(server).chat.completions.create(model="default_model", messages=USER, n=3, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == ["825"] * 3
    assert all("".join(e.token for e in c.logprobs.content) == "825" for c in r.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # (the prompt once)
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    status, body = post_json(port_of(server), "/v1/chat/completions", {"messages": USER, "n": 2})
    assert status == 200
    check("CreateChatCompletionResponse", body)


def test_choices_are_rows_of_one_batch(server):
    """(With --no-batch the server decodes one request at a time: the choices come one
    after another, the same answer.)"""
    scheduler = server[1].scheduler
    if scheduler is not None:
        scheduler.peak_rows = 0
    r = client_of(server).completions.create(model="default_model", prompt="357+468=", n=4)
    assert [c.text for c in r.choices] == ["825"] * 4
    assert scheduler is None or scheduler.peak_rows == 4


def test_a_list_of_prompts_gives_one_choice_per_prompt_in_order(server):
    import mlx_lm_diffusion as mld

    _, tok = mld.load(str(DEMO_MODEL_PATH))
    c = client_of(server)
    r = c.completions.create(model="default_model", prompt=["357+468=", "1+2=", "50+50="])
    assert [(x.index, x.text) for x in r.choices] == [(0, "825"), (1, "3"), (2, "100")]
    ids = c.completions.create(model="default_model", prompt=[tok.encode("1+2="), tok.encode("357+468=")])
    assert [x.text for x in ids.choices] == ["3", "825"]
    both = c.completions.create(model="default_model", prompt=["357+468=", "1+2="], n=2, logprobs=1)
    assert [(x.index, x.text) for x in both.choices] == [(0, "825"), (1, "825"), (2, "3"), (3, "3")]
    alone = [c.completions.create(model="default_model", prompt=p).usage for p in ("357+468=", "1+2=")]
    assert both.usage.prompt_tokens == sum(u.prompt_tokens for u in alone)
    assert both.usage.completion_tokens == 2 * sum(u.completion_tokens for u in alone)
    assert all(x.logprobs.tokens for x in both.choices)
    status, body = post_json(port_of(server), "/v1/completions", {"prompt": ["357+468=", "1+2="], "n": 2})
    check("CreateCompletionResponse", body)


def test_streams_interleave_the_choices_indexes(server):
    chunks = stream(
        server,
        "/v1/chat/completions",
        {"messages": USER, "n": 3, "logprobs": True, "stream_options": {"include_usage": True}},
    )
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    texts, finishes = {}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "825", 1: "825", 2: "825"} and finishes == {0: "stop", 1: "stop", 2: "stop"}
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 * 3  # ('825': not its <blank>s nor EOS)
    legacy = stream(server, "/v1/completions", {"prompt": ["357+468=", "1+2="]})
    got = {}
    for chunk in legacy:
        for choice in chunk["choices"]:
            got[choice["index"]] = got.get(choice["index"], "") + choice["text"]
    assert got == {0: "825", 1: "3"}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"n": 9, "prompt": ["1+2=", "3+4="]}, "prompt"),  # 18 choices, over --max-choices 16
        ({"n": 2, "best_of": 3, "prompt": "1+2="}, "best_of"),
        ({"n": 2, "prompt": ["1+2=", [10**9]]}, None),  # the second prompt's ids are outside the vocabulary
        ({"n": 2, "prompt": "1+2=", "stream": True, "drafts": True}, "drafts"),
    ],
)
def test_a_bad_choice_refuses_the_whole_request(server, body, param):
    status, error = post_json(port_of(server), "/v1/completions", body)
    assert status == 400 and error["error"]["param"] == param, error
    check("ErrorResponse", error)


def test_a_stream_whose_choice_is_refused_is_a_plain_400(server):
    conn = http.client.HTTPConnection("127.0.0.1", port_of(server), timeout=120)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": ["1+2=", [10**9]], "stream": True}),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 400 and "error" in json.loads(response.read())


def test_max_choices_is_the_operators():
    argv = ["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING", "--max-choices", "2"]
    with running_server(argv) as s:
        assert post_json(port_of(s), "/v1/completions", {"prompt": "1+2=", "n": 2})[0] == 200
        status, error = post_json(port_of(s), "/v1/completions", {"prompt": "1+2=", "n": 3})
        assert status == 400 and "[1, 2]" in error["error"]["message"]


def test_sampled_choices_differ_and_repeat_with_a_seed(llada_path):
    """On a random tiny LLaDA, sampled at temperature 1: the n choices are not copies of
    one decode (each row has its own seed), and the same seed gives the same choices."""
    argv = ["--model", str(llada_path), "--port", "0", "--log-level", "WARNING"]
    with running_server(argv) as s:
        c = client_of(s)

        def texts(seed):
            r = c.completions.create(
                model="default_model",
                prompt="hello",
                n=4,
                temperature=1.0,
                seed=seed,
                max_tokens=8,
                extra_body={"steps": 8, "block_length": 8},
            )
            return [x.text for x in r.choices]

        first = texts(7)
        assert len(set(first)) > 1, first
        assert texts(7) == first
