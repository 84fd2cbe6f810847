"""The OpenAI body parsed once (serving/request_body.py): fields, defaults and bounds read
by `parse_body` directly, without HTTP, and a server that reads each body once."""

import dataclasses
import inspect
import re
from types import SimpleNamespace

import mlx_lm.server
import pytest
from server_runs import post_json, running_server

from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.serving import openai_requests, request_body
from mlx_lm_diffusion.serving import startup as dserver
from mlx_lm_diffusion.serving.errors import RequestError
from mlx_lm_diffusion.serving.request_body import SAMPLING_FIELDS, parse_body

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "357+468="}]


@pytest.fixture
def generator():
    """What parse_body reads of a response generator: the server's flags and its model
    (none here: no context bound, the schema's default max_tokens)."""
    cli = dserver.parse_args(["--model", "unused", "--temp", "0.5", "--top-p", "0.9", "--max-choices", "4"])
    return SimpleNamespace(cli_args=cli, model_provider=SimpleNamespace(model=None))


def refused(body, generator, path=CHAT):
    with pytest.raises((RequestError, ValueError, TypeError)) as e:
        parse_body(body, path, generator)
    return e.value


def test_defaults_are_the_servers_flags(generator):
    parsed = parse_body({"messages": USER}, CHAT, generator)
    cli = generator.cli_args
    assert (parsed.sampling["temperature"], parsed.sampling["top_p"], parsed.sampling["top_k"]) == (0.5, 0.9, 0)
    assert parsed.max_tokens == 256  # (no --max-tokens, no model: the schema's default)
    assert parsed.sampling["xtc_threshold"] == 0.1 and parsed.sampling["repetition_context_size"] == 20
    assert (parsed.n, parsed.max_choices, parsed.stream, parsed.stop, parsed.options) == (1, 4, False, (), {})
    assert 0 <= parsed.seed <= openai_requests.SEED_MAX  # drawn for a body that names none
    assert parsed.route == "chat" and parsed.object_type == "chat.completion" and parsed.messages == USER
    with_flag = SimpleNamespace(cli_args=dserver.parse_args(["--model", "unused", "--max-tokens", "7"]))
    assert parse_body({"messages": USER}, CHAT, with_flag).max_tokens == 7
    assert cli.temp == 0.5


def test_a_null_field_is_the_field_left_out(generator):
    parsed = parse_body({"messages": USER, "temperature": None, "n": None, "seed": 3}, CHAT, generator)
    assert parsed.sampling["temperature"] == 0.5 and parsed.n == 1 and parsed.seed == 3


def test_fields_read_from_the_body(generator):
    body = {
        "prompt": ["a", [5, 6]],
        "max_tokens": 3,
        "max_completion_tokens": 9,  # (over max_tokens, as mlx_lm.server reads them)
        "temperature": 1,
        "stop": ["x", ""],
        "stream": True,
        "stream_options": {},
        "logprobs": 2,
        "n": 2,
        "steps": 4,
        "block_length": 8,
        "logit_bias": {"3": 1},
    }
    parsed = parse_body(body, "/v1/completions", generator)
    assert parsed.route == "text" and parsed.object_type == "text_completion"
    assert parsed.prompts == ("a", [5, 6]) and parsed.messages is None
    assert parsed.max_tokens == 9 and parsed.sampling["temperature"] == 1.0
    assert isinstance(parsed.sampling["temperature"], float)
    assert parsed.stop == ("x",) and parsed.stream_options == {"include_usage": False}
    assert (parsed.logprobs, parsed.top_logprobs, parsed.legacy_logprobs) == (True, 2, 2)
    assert parsed.options == {"steps": 4, "block_length": 8} and parsed.logit_bias == {3: 1.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.n = 3
    with pytest.raises(TypeError):
        parsed.options["steps"] = 5  # (read-only: the request's DiffusionRequest gets a copy)


def test_each_sampling_field_has_its_bounds(generator):
    for field in SAMPLING_FIELDS:
        past = field.high + 1 if field.high is not None else None
        for value in (field.low - 1, past, "1"):
            if value is None:
                continue
            error = refused({"messages": USER, field.name: value}, generator)
            assert isinstance(error, RequestError) and error.param == field.name, (field.name, value)
            assert str(error).startswith(f"{field.name} must be "), str(error)
    error = refused({"messages": USER, "temperature": 2.5}, generator)
    assert str(error) == "temperature must be a finite number in [0, 2], got 2.5"


def test_decoding_fields_are_the_option_declarations(generator):
    assert set(compat.DECODE_FIELDS) <= set(request_body.known_fields())
    error = refused({"messages": USER, "steps": 0}, generator)
    assert str(error) == (
        "steps must be an integer in [1, 1048576], got 0; use at least one denoising step per block"
    )  # (the Option's message: the same through every door)
    assert parse_body({"messages": USER, "threshold": 0.5}, CHAT, generator).options == {"threshold": 0.5}


@pytest.mark.parametrize(
    "body, message, param",
    [
        ({"messages": USER, "threshhold": 0.5}, "unknown field 'threshhold'; did you mean 'threshold'?", "threshhold"),
        ({"messages": USER, "n": 5}, "n must be an integer in [1, 4], got 5 (the server's --max-choices)", "n"),
        ({"messages": USER, "stop": ["s"] * 17}, "stop holds 17 strings; at most 16", "stop"),
        ({"messages": USER, "echo": True}, "echo is not supported: the answer holds the completion only", "echo"),
        ({"messages": "hi"}, "messages must be a list of message objects", "messages"),
        ({"messages": USER, "logprobs": 2}, "logprobs must be of type bool", None),
        ({"messages": USER, "drafts": True}, "drafts are sent as SSE comments of a stream; set stream to true", None),
        ({"messages": USER, "draft_model": "x"}, "draft_model is not accepted", "draft_model"),
    ],
)
def test_bad_fields_are_refused_with_their_message(generator, body, message, param):
    error = refused(body, generator)
    assert str(error).startswith(message)
    assert getattr(error, "param", None) == param


def test_not_an_object(generator):
    assert str(refused([1, 2], generator)) == "the request body must be a JSON object"


def test_tool_choice_none_hides_the_tools(generator):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert parse_body({"messages": USER, "tools": tools}, CHAT, generator).tools == tools
    assert parse_body({"messages": USER, "tools": tools, "tool_choice": "none"}, CHAT, generator).tools is None


def test_the_handler_attributes_are_mlx_lm_servers():
    """stock_attributes sets every attribute mlx_lm.server's do_POST would have set."""
    stock = set(re.findall(r"self\.(\w+) = ", inspect.getsource(mlx_lm.server.APIHandler.do_POST)))
    generator = SimpleNamespace(
        cli_args=dserver.parse_args(["--model", "unused"]), model_provider=SimpleNamespace(model=None)
    )
    parsed = parse_body({"messages": USER}, CHAT, generator)
    assert set(request_body.stock_attributes(parsed, generator.cli_args)) == stock


def test_the_server_reads_a_body_once(llada_path, monkeypatch):
    calls = []
    real = request_body.parse_body

    def counted(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(request_body, "parse_body", counted)
    with running_server(["--model", str(llada_path), "--port", "0", "--max-tokens", "4"]) as (httpd, _):
        port = httpd.server_address[1]
        status, answer = post_json(port, CHAT, {"messages": USER, "n": 2, "seed": 1})
        assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1]
        assert calls == [CHAT]  # (two choices, one reading)
        status, answer = post_json(port, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
        assert status == 200 and len(answer["choices"]) == 2 and len(calls) == 2
        status, answer = post_json(port, CHAT, {"messages": USER, "top_p": 2})
        assert status == 400 and len(calls) == 3
        assert answer["error"] == {
            "message": "top_p must be a finite number in [0, 1], got 2",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": None,
        }
