"""OpenAI's `tool_choice` on a chat: "auto" (the default: the model may call a tool its
template describes), "none" (the tools are left out of the prompt: no call), "required"
(the answer is one call of a listed tool) or {"type": "function", "function": {"name": N}}
(the answer is a call of N).

A required call is decoded under a JSON-schema grammar (mlx_lm_diffusion.output.grammar),
as vLLM serves it: the answer is {"name": ..., "arguments": {...}} with the arguments valid
against the tool's `parameters`, and comes back as the message's `tool_calls` (finish_reason
"tool_calls"), whatever markers the model's template uses for calls. One call per answer:
`parallel_tool_calls` asks for nothing more here. LangChain's function-calling structured
output names its function this way (it got None while tool_choice was ignored)."""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from mlx_lm_diffusion.serving.errors import RequestError

CHOICES = ("none", "auto", "required")


def _tool_names(tools: Any) -> dict:
    """name -> parameters schema of the request's function tools (RequestError otherwise)."""
    if not isinstance(tools, list) or not tools:
        raise RequestError(
            'tool_choice "required" or a named function needs a non-empty `tools` list', param="tool_choice"
        )
    named = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or tool.get("type") != "function"
        ):
            raise RequestError('each tool must be {"type": "function", "function": {"name": ...}}', param="tools")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise RequestError(
                f"the parameters of tool {function['name']!r} must be a JSON schema object", param="tools"
            )
        named[function["name"]] = parameters or {"type": "object"}
    return named


def forced_call_format(body: dict) -> Optional[dict]:
    """The response_format that makes the answer a call of the tool(s) `tool_choice` requires,
    or None (no call is required). RequestError for a tool_choice that is not OpenAI's, one that
    names a tool the request does not list, or one combined with a response_format."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        tools = _tool_names(body.get("tools"))
        if name not in tools:
            raise RequestError(f"tool_choice names {name[:60]!r}, which is not in `tools`", param="tool_choice")
        tools = {name: tools[name]}
    elif choice == "required":
        tools = _tool_names(body.get("tools"))
    else:
        raise RequestError(
            f"tool_choice must be one of {', '.join(CHOICES)} or a named function; got {choice!r}"[:200],
            param="tool_choice",
        )
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        raise RequestError(
            "a required tool call and a response_format each set the answer's format: send one", param="tool_choice"
        )
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in tools.items()
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}


def as_tool_calls(text: str, streaming: bool) -> Optional[list]:
    """The answer decoded under forced_call_format as OpenAI's `tool_calls`, or None where it
    is not a whole call (the answer was cut by max_tokens)."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    out = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
    }
    return [{"index": 0, **out} if streaming else out]


__all__ = ["forced_call_format", "as_tool_calls"]
