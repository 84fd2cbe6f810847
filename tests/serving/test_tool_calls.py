"""Tool calls (issue 34, item 9): a chat template that defines tool-call markers gets the
model's calls back as OpenAI `tool_calls` (finish_reason "tool_calls"), in full answers
and in streams, as mlx_lm.server parses them; through the openai SDK and langchain-openai.
The model is tests/helpers/scripted_family.py, which writes a given answer: a tool call here."""

from __future__ import annotations

import json

import openai
import pytest
import scripted_family
from openai_schema import check
from server_runs import post_json, running_server

from mlx_lm_diffusion.testing.checkpoints import write_dream

# Qwen-style markers: mlx-lm picks its json_tools parser from "<tool_call>" and
# "tool_call.name" in the template (mlx_lm.tokenizer_utils._infer_tool_parser).
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for tool_call in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ tool_call.name }}"}\n</tool_call>{% endfor %}{% else %}{{ m[\'content\'] }}{% endif %}'
    "<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 357, "b": 468}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
USER = [{"role": "user", "content": "What is 357 + 468?"}]


@pytest.fixture(scope="module", params=["batched", "serial"])
def server(request, tmp_path_factory, monkeypatch_module):
    path = write_dream(tmp_path_factory.mktemp("scripted"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": scripted_family.MODEL_TYPE}))
    settings = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": TOOL_TEMPLATE}))
    for leftover in path.glob("chat_template.*"):
        leftover.unlink()
    flags = [] if request.param == "batched" else ["--no-batch"]
    monkeypatch_module.setattr(scripted_family, "SCRIPT", CALL)
    argv = ["--model", str(path), "--port", "0", "--log-level", "WARNING", "--max-tokens", "96", *flags]
    with running_server(argv) as s:
        yield s


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


def base_url(server) -> str:
    return f"http://127.0.0.1:{server[0].server_address[1]}/v1"


def test_a_tool_call_comes_back_as_tool_calls(server):
    client = openai.OpenAI(base_url=base_url(server), api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="default_model", messages=USER, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 357, "b": 468}
    status, body = post_json(server[0].server_address[1], "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    assert status == 200
    check("CreateChatCompletionResponse", body)


def test_a_streamed_tool_call(server):
    client = openai.OpenAI(base_url=base_url(server), api_key="x", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(model="default_model", messages=USER, tools=TOOLS, stream=True))
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "add"
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"a": 357, "b": 468}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_langchain_binds_tools_and_reads_the_call(server):
    import langchain_openai

    chat = langchain_openai.ChatOpenAI(
        model="default_model", base_url=base_url(server), api_key="x", max_retries=0, timeout=120
    )
    message = chat.bind_tools(TOOLS).invoke("What is 357 + 468?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "add"
    assert message.tool_calls[0]["args"] == {"a": 357, "b": 468}


# tool_choice "required" or a named function (issue 54.2): the answer is decoded under the
# call's JSON-schema grammar and comes back as tool_calls; the scripted model writes the JSON.
FORCED = '{"name":"add","arguments":{"a":357,"b":468}}'  # (the grammar's JSON is compact)


def test_a_required_call_comes_back_as_tool_calls(server, monkeypatch):
    monkeypatch.setattr(scripted_family, "SCRIPT", FORCED)
    client = openai.OpenAI(base_url=base_url(server), api_key="x", max_retries=0, timeout=120)
    for tool_choice in ("required", {"type": "function", "function": {"name": "add"}}):
        r = client.chat.completions.create(model="default_model", messages=USER, tools=TOOLS, tool_choice=tool_choice)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 357, "b": 468}
        chunks = list(
            client.chat.completions.create(
                model="default_model", messages=USER, tools=TOOLS, tool_choice=tool_choice, stream=True
            )
        )
        calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "add"
        assert json.loads(calls[0].function.arguments) == {"a": 357, "b": 468}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            "tool_calls"
        ]
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    status, answer = post_json(server[0].server_address[1], "/v1/chat/completions", body)
    assert status == 200
    check("CreateChatCompletionResponse", answer)
    # cut short by max_tokens: no call, the text and "length"
    status, answer = post_json(server[0].server_address[1], "/v1/chat/completions", {**body, "max_tokens": 8})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert FORCED.startswith(choice["message"]["content"])


def test_the_grammar_holds_the_call_to_the_named_tool(server, monkeypatch):
    """The model writes a call of another tool: the grammar keeps it to the one named, its
    arguments to that tool's parameters."""
    monkeypatch.setattr(scripted_family, "SCRIPT", FORCED.replace('"add"', '"sub"'))
    tools = [
        *TOOLS,
        {"type": "function", "function": {"name": "sub", "parameters": TOOLS[0]["function"]["parameters"]}},
    ]
    body = {
        "messages": USER,
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "max_tokens": 96,
    }
    status, answer = post_json(server[0].server_address[1], "/v1/chat/completions", body)
    assert status == 200, answer
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and set(json.loads(call["function"]["arguments"])) == {"a", "b"}


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(server):
    port = server[0].server_address[1]
    counts = {}
    for choice in ("auto", "none"):
        status, answer = post_json(
            port, "/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": choice, "max_tokens": 8}
        )
        assert status == 200, answer
        counts[choice] = answer["usage"]["prompt_tokens"]
    status, answer = post_json(port, "/v1/chat/completions", {"messages": USER, "max_tokens": 8})
    assert counts["none"] == answer["usage"]["prompt_tokens"] < counts["auto"]


@pytest.mark.parametrize(
    "body, says",
    [
        ({"tool_choice": "required"}, "needs a non-empty `tools`"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "'mul', which is not in"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be one of"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice must be"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "each tool must be"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "send one"),
    ],
)
def test_a_tool_choice_that_cannot_be_served_is_a_400(server, body, says):
    status, answer = post_json(server[0].server_address[1], "/v1/chat/completions", {"messages": USER, **body})
    assert status == 400 and says in answer["error"]["message"] and answer["error"]["param"] in ("tool_choice", "tools")
    check("ErrorResponse", answer)


def test_langchain_structured_output_by_function_calling(server, monkeypatch):
    """LangChain's with_structured_output(method="function_calling") names its function in
    tool_choice and reads the call (it got None while tool_choice was ignored)."""
    import langchain_openai
    from pydantic import BaseModel

    class Add(BaseModel):
        """a + b"""

        a: int
        b: int

    monkeypatch.setattr(scripted_family, "SCRIPT", FORCED.replace('"add"', '"Add"'))
    chat = langchain_openai.ChatOpenAI(
        model="default_model", base_url=base_url(server), api_key="x", max_retries=0, timeout=120
    )
    answer = chat.with_structured_output(Add, method="function_calling").invoke("What is 357 + 468?")
    assert answer == Add(a=357, b=468)
