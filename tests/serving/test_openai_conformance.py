"""The server's answers as OpenAI's API defines them (issue 34, items 1 and 3, in part):
chat log-probabilities, in full answers and in stream chunks, and null as "left out"."""

from __future__ import annotations

import http.client
import json

import openai
import pytest
from server_runs import demo_server, post_json, running_server

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

USER = [{"role": "user", "content": "357+468="}]


@pytest.fixture(scope="module", params=["batched", "serial"])
def server(request):
    with demo_server(request.param) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    port = server[0].server_address[1]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def check_entry(entry, top_n: int) -> None:
    assert entry.bytes == list(entry.token.encode("utf-8"))
    assert len(entry.top_logprobs) == top_n
    ranked = [t.logprob for t in entry.top_logprobs]
    assert ranked == sorted(ranked, reverse=True)
    own = [t for t in entry.top_logprobs if t.model_extra["id"] == entry.model_extra["id"]]
    if own:  # the generated token among the alternatives: the same entry, the same log-prob
        assert own[0].token == entry.token and own[0].logprob == entry.logprob


def test_chat_logprobs_are_the_generated_tokens(client):
    r = client.chat.completions.create(model="default_model", messages=USER, logprobs=True, top_logprobs=3)
    text, content = r.choices[0].message.content, r.choices[0].logprobs.content
    assert text == "825" and "".join(e.token for e in content) == text
    for entry in content:
        check_entry(entry, 3)
        # greedy decoding commits its position's most likely token
        assert entry.top_logprobs[0].model_extra["id"] == entry.model_extra["id"]
    plain = client.chat.completions.create(model="default_model", messages=USER, logprobs=True).choices[0]
    assert [e.token for e in plain.logprobs.content] == [e.token for e in content]
    assert all(e.top_logprobs == [] and e.bytes is not None for e in plain.logprobs.content)
    assert client.chat.completions.create(model="default_model", messages=USER).choices[0].logprobs is None


def test_stream_chunks_carry_their_tokens_logprobs(client):
    whole = client.chat.completions.create(model="default_model", messages=USER, logprobs=True, top_logprobs=2)
    chunks = [
        c
        for c in client.chat.completions.create(
            model="default_model", messages=USER, logprobs=True, top_logprobs=2, stream=True
        )
        if c.choices
    ]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "825"
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]
    for entry in streamed:
        check_entry(entry, 2)


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "seed",
        "stop",
        "logit_bias",
        "threshold",
        "block_length",
    ],
)
def test_null_is_a_field_left_out(server, field):
    port = server[0].server_address[1]
    status, body = post_json(port, "/v1/chat/completions", {"messages": USER, field: None})
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == "825"


def test_without_max_tokens_the_server_uses_the_models_default(client):
    """The demo's generation_config.json says how long an answer may be; the generate CLI
    and the Python API use it when max_tokens is not given, and so does the server (it
    used mlx_lm.server's 512: '9999+9999=' answered 18998 where the CLI said 19998)."""
    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.decoding.options import default_max_tokens

    model, tok = mld.load(str(DEMO_MODEL_PATH))
    prompt = [{"role": "user", "content": "9999+9999="}]
    expected = mld.generate(model, tok, tok.apply_chat_template(prompt, add_generation_prompt=True))
    assert default_max_tokens(model) != 512
    r = client.chat.completions.create(model="default_model", messages=prompt)
    assert r.choices[0].message.content == expected == "19998"


def test_chat_takes_the_models_default_length_too():
    from mlx_lm_diffusion.cli import chat

    assert chat.setup_arg_parser().parse_args([]).max_tokens is None
    assert chat.setup_arg_parser().parse_args(["--max-tokens", "7"]).max_tokens == 7


def post(server, body: dict):
    return post_json(server[0].server_address[1], "/v1/chat/completions", {"messages": USER, **body})


@pytest.mark.parametrize(
    "field,near",
    [
        ("threshhold", "threshold"),
        ("block_lenght", "block_length"),
        ("temprature", "temperature"),
        ("max_token", "max_tokens"),
    ],
)
def test_a_misspelled_field_is_a_400_naming_the_field(server, field, near):
    """It used to decode with the default, silently ("threshhold": 5 passed where
    "threshold": 5 was a 400)."""
    status, body = post(server, {field: 0.5})
    assert status == 400 and f"did you mean {near!r}" in body["error"]["message"], body
    assert body["error"]["param"] == field


@pytest.mark.parametrize("field", ["user", "store", "metadata", "parallel_tool_calls", "x_client_trace"])
def test_fields_the_server_does_not_use_are_ignored(server, field):
    status, body = post(server, {field: {"a": 1} if field == "metadata" else "x"})
    assert status == 200 and body["choices"][0]["message"]["content"] == "825", body


def test_n_out_of_range_is_refused_not_ignored(server, client):
    """n=2 silently returned one choice, and n=0 was accepted (n choices: test_openai_choices)."""
    for n in (0, 17, True, 1.5, "2"):
        status, body = post(server, {"n": n})
        assert status == 400 and body["error"]["param"] == "n", body
    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 16\]"):
        client.chat.completions.create(model="default_model", messages=USER, n=17)
    assert client.chat.completions.create(model="default_model", messages=USER, n=1).choices[0].message.content == "825"


def test_completions_take_integer_logprobs_in_the_legacy_shape(client):
    """client.completions.create(logprobs=2) was a 400 ("must be of type bool"), and true
    gave the chat shape."""
    r = client.completions.create(model="default_model", prompt="357+468=", logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text == "825" and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and top[token] == logprob  # (greedy: the token is its position's best)
    zero = client.completions.create(model="default_model", prompt="357+468=", logprobs=0).choices[0].logprobs
    assert zero.tokens == lp.tokens and all(
        t == {k: v} for t, k, v in zip(zero.top_logprobs, zero.tokens, zero.token_logprobs)
    )
    chunks = list(client.completions.create(model="default_model", prompt="357+468=", logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset
    assert client.completions.create(model="default_model", prompt="357+468=").choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="default_model", prompt="357+468=", logprobs=6)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="default_model", prompt="357+468=", echo=True)


def test_completions_take_a_prompt_as_token_ids(client):
    import mlx_lm_diffusion as mld

    _, tok = mld.load(str(DEMO_MODEL_PATH))
    ids = tok.encode("357+468=")
    for prompt in (ids, [ids], ["357+468="]):
        assert client.completions.create(model="default_model", prompt=prompt).choices[0].text == "825"


@pytest.mark.parametrize("prompt", [["357+468=", 5], [[1, 2], []], [[1, 2], "x", [[3]]], 5, [], [1.5], None, {"a": 1}])
def test_completions_refuse_other_prompts_cleanly(server, prompt):
    status, body = post_json(server[0].server_address[1], "/v1/completions", {"prompt": prompt})
    error = body["error"]
    assert status == 400 and error["param"] == "prompt", error
    assert "'<='" not in error["message"] and "Traceback" not in error["message"]


def test_models_are_listed_by_a_name_a_client_can_send_back(client, server):
    """/v1/models listed the server's absolute path, and only that path or "default_model"
    was accepted; the id is now the directory's name (or --served-model-name)."""
    from pathlib import Path

    listed = [m.id for m in client.models.list().data]
    assert listed == [Path(DEMO_MODEL_PATH).resolve().name] and "/" not in listed[0]
    for name in (listed[0], "default_model", str(DEMO_MODEL_PATH)):
        assert client.chat.completions.create(model=name, messages=USER).choices[0].message.content == "825"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="someone/else", messages=USER)
    assert str(Path(DEMO_MODEL_PATH).resolve()) not in str(e.value)


def test_served_model_name():
    argv = ["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING", "--served-model-name", "adder"]
    with running_server(argv) as (httpd, _):
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["adder"]
        assert c.chat.completions.create(model="adder", messages=USER).choices[0].message.content == "825"


@pytest.mark.parametrize("stop,text", [("2", "8"), (["25"], "8"), (["5", "x"], "82"), ("82", ""), ("9", "825")])
def test_stop_strings_end_the_answer_whatever_the_tokenization(client, stop, text):
    """Stops are matched in the text, not as token ids (found on the earlier demo, whose
    tokenizer encoded "2" alone as [0, 0, 0, 2], never what the model writes: the stop was
    cut out of the text and decoding went on, "825" with stop "2" gave "85")."""
    full = client.chat.completions.create(model="default_model", messages=USER)
    r = client.chat.completions.create(model="default_model", messages=USER, stop=stop, logprobs=True)
    assert (r.choices[0].message.content or "") == text and r.choices[0].finish_reason == "stop"
    assert "".join(e.token for e in r.choices[0].logprobs.content) == text
    if text != "825":
        assert r.usage.completion_tokens < full.usage.completion_tokens  # (decoding stopped there)
    chunks = [
        c
        for c in client.chat.completions.create(model="default_model", messages=USER, stop=stop, stream=True)
        if c.choices
    ]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_max_tokens_still_ends_with_length(client):
    r = client.chat.completions.create(model="default_model", messages=USER, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def raw_post(server, path: str, body: dict):
    conn = http.client.HTTPConnection("127.0.0.1", server[0].server_address[1], timeout=120)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read().decode()
    if response.getheader("Content-Type", "").startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in data.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return response.status, [json.loads(e) for e in events[:-1]]
    return response.status, json.loads(data)


@pytest.mark.parametrize(
    "extra", [{}, {"logprobs": True}, {"logprobs": True, "top_logprobs": 3}, {"stop": "2"}, {"max_tokens": 2}]
)
def test_chat_answers_and_chunks_validate_against_openais_schema(server, extra):
    from openai_schema import check

    status, body = raw_post(server, "/v1/chat/completions", {"messages": USER, **extra})
    assert status == 200
    check("CreateChatCompletionResponse", body)
    status, chunks = raw_post(
        server,
        "/v1/chat/completions",
        {"messages": USER, "stream": True, "stream_options": {"include_usage": True}, **extra},
    )
    assert status == 200 and chunks
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"stop": "5"}])
def test_completions_validate_against_openais_schema(server, extra):
    from openai_schema import check

    status, body = raw_post(server, "/v1/completions", {"prompt": "357+468=", **extra})
    assert status == 200
    check("CreateCompletionResponse", body)


def test_models_and_errors_validate_against_openais_schema(server):
    from openai_schema import check

    conn = http.client.HTTPConnection("127.0.0.1", server[0].server_address[1], timeout=120)
    conn.request("GET", "/v1/models")
    check("ListModelsResponse", json.loads(conn.getresponse().read()))
    for path, body in (
        ("/v1/chat/completions", {"messages": USER, "model": "nope"}),
        ("/v1/chat/completions", {"messages": USER, "temperature": -1}),
        ("/v1/completions", {"prompt": 5}),
    ):
        status, error = raw_post(server, path, body)
        assert status in (400, 404)
        check("ErrorResponse", error)


def test_an_unsatisfiable_format_and_allowed_set_is_a_400_before_decoding(llada_path):
    """A json_object format with an allowed-token set that holds no '{' was a 500 mid-decode."""
    import mlx_lm_diffusion as mld

    _, tok = mld.load(str(llada_path))
    digits = sorted({t for d in "0123456789" for t in tok.encode(d, add_special_tokens=False)})
    brace = tok.encode("{", add_special_tokens=False)
    with running_server(["--model", str(llada_path), "--port", "0", "--log-level", "WARNING"]) as (httpd, _):
        port = httpd.server_address[1]
        body = {"messages": USER, "max_tokens": 8, "response_format": {"type": "json_object"}}
        status, answer = post_json(port, "/v1/chat/completions", {**body, "allowed_tokens": digits})
        assert status == 400 and "allowed_tokens" in answer["error"]["message"], answer
        status, answer = post_json(port, "/v1/chat/completions", {**body, "allowed_tokens": digits + brace})
        assert status != 400 or "allowed_tokens leave no token" not in answer["error"]["message"], answer


@pytest.mark.parametrize(
    "prompt,schema,text",
    [
        ("357+468=", {"enum": [825, 100]}, "825"),
        ("357+468=", {"const": 825}, "825"),
        ("357+468=", {"enum": [100, 7]}, None),  # (the model's choice, one of them)
        ("9999+9999=", {"enum": [19998]}, "19998"),
        ("1+2=", {"const": 3}, "3"),
    ],
)
def test_enum_and_const_schemas_on_a_tokenizer_that_rewrites_text(server, prompt, schema, text):
    """Enums and consts of numbers force their text. (Found on the earlier demo, whose
    normalizer zero-padded numbers: llguidance, handed that encoding of the forced text,
    forced a "0" the answer never has, a 500 mid-decode; the spelling is tested on such a
    tokenizer in test_forced_text_is_spelled_with_the_tokens_that_write_it.)"""
    status, body = post_json(
        server[0].server_address[1],
        "/v1/completions",
        {"prompt": prompt, "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
    )
    assert status == 200, body
    answer = body["choices"][0]["text"]
    assert answer == text if text is not None else int(answer) in schema["enum"]


def _zero_padding_tokenizer():
    """One token per digit, and a normalizer that writes a zero before the text (the old
    demo's zero-padding, in small): "825" encodes as 0 8 2 5."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate("0123456789")} | {"<eos>": 10}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.normalizer = normalizers.Prepend("0")
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_forced_text_is_spelled_with_the_tokens_that_write_it():
    from mlx_lm_diffusion.output.grammar import _TokenTable

    hf = _zero_padding_tokenizer()
    assert hf.encode("825", add_special_tokens=False) == [0, 8, 2, 5]  # (the normalizer's rewrite)
    table = _TokenTable(hf, 12)
    ids = table("825")
    assert b"".join(table.tokens[i] for i in ids) == b"825" and ids == [8, 2, 5]
