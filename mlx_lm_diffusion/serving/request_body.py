"""An OpenAI body parsed once: `parse_body` reads a completions or chat completions body
into a `RequestBody`, every field checked, the server's defaults merged in, and the
handler, its routes and the generator read the fields from it.

Each field's type, range and default is declared here: the sampling fields in
`SAMPLING_FIELDS` (their default a constant or the server's flag: --temp, --top-p,
--max-tokens), the others beside them (`n`, `seed`, `top_logprobs`, `stop`,
`stream_options`...), and the decoding fields by their `Option` declarations
(decoding/option_schema.py, through `openai_requests.parse_request_options`). A bad field
is a RequestError or ValueError with the message the server answered before (400, the
field as `param`), never a 500.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Union

from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.decoding import default_max_tokens
from mlx_lm_diffusion.serving import openai_requests, tool_choice
from mlx_lm_diffusion.serving.errors import RequestError, excerpt
from mlx_lm_diffusion.serving.openai_requests import (
    _BODY_FIELDS,
    CONTEXT_SIZE_MAX,
    DEFAULT_MAX_CHOICES,
    IGNORED_OPENAI_FIELDS,
    MAX_LEGACY_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    SEED_MAX,
    TOP_LOGPROBS_MAX,
    check_prompt_length,
    check_unknown_fields,
    parse_proposals,
    parse_request_options,
)

COMPLETIONS_PATH = "/v1/completions"  # (its logprobs is an integer; it takes no tool_choice)
# every field a body may carry by name (the decoding options' are added per request)
KNOWN_FIELDS = _BODY_FIELDS + ("suffix", "response_format") + IGNORED_OPENAI_FIELDS
REFUSED_FIELDS = ("draft_model", "adapters", "num_draft_tokens")  # mlx_lm.server's, not a diffusion model's


@dataclass(frozen=True)
class BodyField:
    """A finite number (`kind` float) or an integer field, its range [low, high] (high None:
    unbounded) and its default: `flag`, the server's setting of that name where it has one,
    else `default`."""

    name: str
    kind: type
    low: float
    high: Optional[float] = None
    default: Any = None
    flag: Optional[str] = None

    def default_of(self, cli: Any) -> Any:
        return getattr(cli, self.flag) if self.flag is not None else self.default

    def check(self, value: Any) -> Union[int, float]:
        name, low, high = self.name, self.low, self.high
        if self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"{name} must be a number", param=name)
            if not math.isfinite(value) or not low <= value <= high:
                raise RequestError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value!r}", param=name)
            return float(value)  # (mlx_lm.server wants floats for xtc_*)
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(f"{name} must be an integer", param=name)
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise RequestError(f"{name} must be an integer {span}, got {value!r}", param=name)
        return value


# mlx_lm.server's sampling and penalty fields, in the order they are checked
SAMPLING_FIELDS = (
    BodyField("temperature", float, 0.0, 2.0, flag="temp"),  # OpenAI's range
    BodyField("top_p", float, 0.0, 1.0, flag="top_p"),
    BodyField("min_p", float, 0.0, 1.0, flag="min_p"),
    BodyField("repetition_penalty", float, 0.0, 100.0, default=0.0),
    BodyField("presence_penalty", float, -100.0, 100.0, default=0.0),
    BodyField("frequency_penalty", float, -100.0, 100.0, default=0.0),
    BodyField("xtc_probability", float, 0.0, 1.0, default=0.0),
    BodyField("xtc_threshold", float, 0.0, 1.0, default=0.1),
    # max_completion_tokens, else max_tokens, else --max-tokens, else the model's own default
    BodyField("max_tokens", int, 1, flag="max_tokens"),
    BodyField("top_k", int, 0, flag="top_k"),
    BodyField("repetition_context_size", int, 0, CONTEXT_SIZE_MAX, default=20),
    BodyField("presence_context_size", int, 0, CONTEXT_SIZE_MAX, default=20),
    BodyField("frequency_context_size", int, 0, CONTEXT_SIZE_MAX, default=20),
)


@dataclass(frozen=True)
class RequestBody:
    """One completions or chat completions request, as its body asked, checked and with
    the server's defaults in. `route` is "chat" or "text"; a completion's `prompts` are
    its prompts (one choice per prompt and n), a chat's `messages` its turns. Read-only
    (its mappings too); a choice's copy with its own seed is `dataclasses.replace`'s."""

    route: str
    model: str
    messages: Optional[list]
    prompts: tuple
    tools: Optional[list]  # (None under tool_choice "none": the model is not told of them)
    role_mapping: Any
    stream: bool
    stream_options: Optional[dict]
    sampling: Mapping[str, Union[int, float]]  # SAMPLING_FIELDS by name, max_tokens included
    logit_bias: Optional[dict]  # token id -> bias
    logprobs: bool
    top_logprobs: int  # -1: none
    legacy_logprobs: Optional[int]  # /v1/completions' integer logprobs: top alternatives per token
    n: int
    max_choices: int  # the server's --max-choices
    seed: int  # drawn here when the body names none (openai_requests.request_seed)
    stop: tuple
    chat_template_kwargs: Optional[dict]
    options: Mapping[str, Any]  # the decoding fields (suffix, response_format, a required tool call's format)
    drafts: bool
    proposals: int
    forced_tool_call: bool

    @property
    def max_tokens(self) -> int:
        return self.sampling["max_tokens"]

    @property
    def object_type(self) -> str:
        if self.route == "text":
            return "text_completion"
        return "chat.completion.chunk" if self.stream else "chat.completion"


def _get(body: dict, name: str, default: Any = None) -> Any:
    """A field; an explicit null is the field left out, as in OpenAI's API (mlx_lm.server
    answered `"temperature": null` with a 400)."""
    value = body.get(name)
    return default if value is None else value


def parse_body(body: Any, path: str, generator: Any) -> RequestBody:
    """`body` (the JSON value of a POST to `path`) as a RequestBody. `generator` is the
    server's response generator: its `cli_args` (the defaults and limits), its model (the
    default max_tokens, the context a prompt must fit)."""
    if not isinstance(body, dict):
        logging.warning(f"Invalid Request Body: {excerpt(json.dumps(body).encode())}")
        raise RequestError("the request body must be a JSON object")
    cli = generator.cli_args
    route = "text" if path == COMPLETIONS_PATH else "chat"
    check_unknown_fields(body, KNOWN_FIELDS + compat.DECODE_FIELDS)
    for name in REFUSED_FIELDS:
        if body.get(name) is not None:
            raise RequestError(
                f"{name} is not accepted: speculative decoding and adapters do "
                "not apply to this server's diffusion models",
                param=name,
            )
    logprobs, top_logprobs, legacy = _logprobs(body, route)
    if _get(body, "echo", False) is not False:
        raise RequestError("echo is not supported: the answer holds the completion only", param="echo")
    n, most = _choices(body, cli)
    sampling = _sampling(body, generator)
    top_logprobs = _top_logprobs(top_logprobs)
    seed = _seed(_get(body, "seed"))
    stream_options = _stream_options(_get(body, "stream_options"))
    chat_template_kwargs = _chat_template_kwargs(_get(body, "chat_template_kwargs"), cli)
    stream, model = _get(body, "stream", False), _get(body, "model", "default_model")
    _check_types(stream, logprobs, model)
    logit_bias = _logit_bias(_get(body, "logit_bias"))
    check_prompt_length(body, generator)
    options, drafts, proposals, forced = _decoding(body, route, stream, n)
    stop = stop_words(body.get("stop"))
    messages = _messages(body) if route == "chat" else None
    prompts = _prompts(body, n, most) if route == "text" else ()
    return RequestBody(
        route=route,
        model=model,
        messages=messages,
        prompts=prompts,
        tools=None if body.get("tool_choice") == "none" else body.get("tools") or None,
        role_mapping=body.get("role_mapping"),
        stream=stream,
        stream_options=stream_options,
        sampling=MappingProxyType(sampling),
        logit_bias=logit_bias,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        legacy_logprobs=legacy,
        n=n,
        max_choices=most,
        seed=seed,
        stop=tuple(stop),
        chat_template_kwargs=chat_template_kwargs,
        options=MappingProxyType(options),
        drafts=drafts,
        proposals=proposals,
        forced_tool_call=forced is not None,
    )


def _check_types(stream: Any, logprobs: Any, model: Any) -> None:
    """mlx_lm.server's own checks of these fields (APIHandler.validate_model_parameters),
    with its messages."""
    if not isinstance(stream, bool):
        raise ValueError("stream must be of type bool")
    if not isinstance(logprobs, bool):
        raise ValueError("logprobs must be of type bool")
    if not isinstance(model, str):
        raise ValueError("requested_model must be of type str")


def _decoding(body: dict, route: str, stream: bool, n: int) -> tuple:
    """(options, drafts, proposals, forced): the decoding fields by their Option declarations,
    with suffix and response_format, or a required tool call's format (a chat's tool_choice);
    the draft frames and their proposals."""
    options, drafts = parse_request_options(body)
    proposals = parse_proposals(body, drafts)
    forced = tool_choice.forced_call_format(body) if route == "chat" else None
    if forced is not None:
        options["response_format"] = forced  # (checked and compiled as any other)
    if drafts and not stream:
        raise ValueError("drafts are sent as SSE comments of a stream; set stream to true")
    if drafts and n > 1:
        raise RequestError("drafts are one decode's canvas: ask for them with n = 1", param="drafts")
    return options, drafts, proposals, forced


def _logprobs(body: dict, route: str) -> tuple:
    """(logprobs, top_logprobs, legacy): a completion's integer logprobs asks for that many
    alternatives per token (true: the tokens' own log-probabilities)."""
    logprobs, top_logprobs = _get(body, "logprobs", False), _get(body, "top_logprobs", -1)
    if route != "text" or not isinstance(logprobs, int) or logprobs is False:
        return logprobs, top_logprobs, None
    legacy = 0 if logprobs is True else logprobs
    if not 0 <= legacy <= MAX_LEGACY_LOGPROBS:
        raise RequestError(
            f"logprobs must be an integer in [0, {MAX_LEGACY_LOGPROBS}] for completions, got {logprobs!r}",
            param="logprobs",
        )
    return True, legacy if legacy > 0 else -1, legacy


def _choices(body: dict, cli: Any) -> tuple:
    """(n, the server's --max-choices); best_of may only repeat n."""
    n = _get(body, "n", 1)
    most = getattr(cli, "max_choices", None) or DEFAULT_MAX_CHOICES
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise RequestError(f"n must be an integer in [1, {most}], got {n!r} (the server's --max-choices)", param="n")
    if _get(body, "best_of", n) != n:  # (no candidates beyond the n choices are decoded)
        raise RequestError(f"best_of must equal n ({n}): this server decodes no extra candidates", param="best_of")
    return n, most


def _sampling(body: dict, generator: Any) -> dict:
    cli = generator.cli_args
    values = {f.name: _get(body, f.name, f.default_of(cli)) for f in SAMPLING_FIELDS}
    asked = _get(body, "max_completion_tokens")
    if asked is not None:
        values["max_tokens"] = asked
    if values["max_tokens"] is None:  # neither the request nor --max-tokens: the model's own default
        values["max_tokens"] = default_max_tokens(generator.model_provider.model)
    return {f.name: f.check(values[f.name]) for f in SAMPLING_FIELDS}


def _top_logprobs(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError("top_logprobs must be an integer", param="top_logprobs")
    if value != -1 and not 0 <= value <= TOP_LOGPROBS_MAX:  # (OpenAI's bound; mlx_lm.server's is 11)
        raise RequestError(
            f"top_logprobs must be an integer in [0, {TOP_LOGPROBS_MAX}], got {value}", param="top_logprobs"
        )
    return value


def _seed(seed: Any) -> int:
    if seed is None:
        return openai_requests.request_seed()
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise RequestError(f"seed must be an integer in [0, 2**64 - 1], got {seed!r}", param="seed")
    return seed


def _stream_options(value: Any) -> Optional[dict]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError("stream_options must be an object", param="stream_options")
    include = value.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError("stream_options.include_usage must be a boolean", param="stream_options")
    return {**value, "include_usage": include}


def _chat_template_kwargs(value: Any, cli: Any) -> Optional[dict]:
    if value is not None and not isinstance(value, dict):
        raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    if (value or {}).get("chat_template") is not None and not getattr(cli, "allow_client_chat_templates", False):
        raise RequestError(
            "a client-supplied chat_template is refused (a template is code this "
            "server would run); start it with --allow-client-chat-templates",
            param="chat_template_kwargs",
        )
    return value


def _logit_bias(value: Any) -> Optional[dict]:
    """Token id -> bias (mlx_lm.server's conversion and messages; ids and finiteness are
    checked against the model on the generation thread: check_sampling_against_vocabulary)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("logit_bias must be of type dict")
    try:
        return {int(k): float(v) for k, v in value.items()}
    except ValueError as e:
        raise ValueError("logit_bias must be a dict of int to float") from e


def stop_words(stop: Any) -> list:
    """`stop`: a string or at most MAX_STOP_STRINGS strings of at most MAX_STOP_CHARS
    characters each (empty ones dropped)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise RequestError("stop must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    long = next((s for s in stop if len(s) > MAX_STOP_CHARS), None)
    if long is not None:
        raise RequestError(f"a stop string has {len(long)} characters; at most {MAX_STOP_CHARS}", param="stop")
    return [s for s in stop if s]


def _messages(body: dict) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a list of message objects", param="messages")
    return messages


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _prompts(body: dict, n: int, most: int) -> tuple:
    """`prompt`: a string, a list of token ids, or a list of those (one choice per prompt
    and n, in order: routes' choices)."""
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and not _token_ids(prompt) else [prompt]
    if not all(isinstance(p, str) or _token_ids(p) for p in prompts):
        raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of those", param="prompt")
    if len(prompts) * n > most:
        raise RequestError(
            f"{len(prompts)} prompts x n = {n} is {len(prompts) * n} choices; this server answers at most "
            f"{most} (--max-choices)",
            param="prompt",
        )
    return tuple(prompts)


def stock_attributes(request: RequestBody, cli: Any) -> dict:
    """What mlx_lm.server's APIHandler reads off the handler (`self.temperature`, ...,
    `self.body` in handle_chat_completions): set from the parsed body, in one place."""
    return {
        **request.sampling,
        "body": {"messages": request.messages, "tools": request.tools, "role_mapping": request.role_mapping},
        "stream": request.stream,
        "stream_options": request.stream_options,
        "requested_model": request.model,
        "requested_draft_model": "default_model",
        "num_draft_tokens": cli.num_draft_tokens,
        "adapter": None,
        "logit_bias": request.logit_bias,
        "logprobs": request.logprobs,
        "top_logprobs": request.top_logprobs,
        "seed": request.seed,
        "chat_template_kwargs": request.chat_template_kwargs,
    }


def known_fields() -> Sequence[str]:
    """Every field a body may name (the decoding options' as registered now)."""
    return _BODY_FIELDS + compat.DECODE_FIELDS
