"""Hostile request bodies for the server, and the one rule every answer must keep.

`random_body(rng, route)` builds a body from the fields a route reads, each given a
sane value, a value of the wrong type, or an extreme one, plus stray fields. It is
shared by the fuzz test (tests/serving/test_fuzz.py, hypothesis drawing the `rng`) and the
soak script (bench/soak_server.py, thousands of bodies). `check_answer` says whether
one HTTP answer is clean: a 2xx or 4xx status whose body is strict JSON (a stream:
SSE events each strict JSON, ending in [DONE]).
"""

import json
import math
import random
from typing import Any, Optional

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/diffusion/generate")

WEIRD = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**64,
    -(2**64),
    10**30,
    0.5,
    -0.5,
    1e-38,
    1e30,
    -1e30,
    math.inf,
    -math.inf,
    math.nan,
    "",
    "x",
    "0.5",
    "\u0000",
    "\u00ff\u00ff",
    [],
    [1],
    {},
    {"a": 1},
    [[[[[]]]]],
    "default_model",
    "/etc",
    "..",
    "data:image/png;base64,AAAA",
]

SANE = {
    "max_tokens": [1, 4, 8, 12, -1, 100_000],
    "temperature": [0, 0.0, 0.7, 1.0, 2.0],
    "top_p": [1.0, 0.9, 0.0],
    "top_k": [0, 1, 5, 50, 10**6],
    "min_p": [0.0, 0.1],
    "seed": [0, 7, 2**64 - 1],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}, {}],
    "stop": ["\n", ["a", "b"], []],
    "logit_bias": [{"5": 1.0}, {"100000": 5}, {"-1": 1}, {"x": 1}, {"5": math.inf}],
    "logprobs": [True, False],
    "top_logprobs": [0, 3],
    "repetition_penalty": [1.0, 1.2],
    "presence_penalty": [0.0, 1.0],
    "frequency_penalty": [0.0, 1.0],
    "model": ["default_model"],
    "steps": [1, 2, 4, 8, 100_000, 0],
    "block_length": [1, 4, 8, 32, 0, 2**21],
    "strategy": ["low_confidence", "random", "threshold", "entropy", "nope"],
    "threshold": [0.5, 0.9, 1.5],
    "schedule": ["linear", "cosine", "nope"],
    "editing_threshold": [0.1, 0.9],
    "max_post_steps": [0, 2, 100_000],
    "preset": ["fast", "nope"],
    "cache": ["prefix", "dual", "nope"],
    "drafts": [True, False],
    "n": [1, 2],
}

PROTOCOL = {
    "prompt_tokens": [[72, 101], [5], [], [-1], [10**9]],
    "target_length": [4, 6, 12, 10**9, 1],
    "num_steps": [1, 2, 4, 100_000],
    "mask_schedule": ["cosine", "linear", "exp", "nope"],
    "top_p": [1.0, 0.9, 2.0],
    "confidence_threshold": [0.5, 2.0],
    "seed": [0, 3],
    "cache": ["prefix"],
}

MAX_PROTOCOL_STEPS = 64  # a sane temperature_schedule is sent for at most this many steps


def _value(rng: random.Random, sane: list, hostile: float = 0.4) -> Any:
    roll = rng.random()
    if roll >= hostile:
        return rng.choice(sane)
    if roll < 0.75 * hostile:
        return rng.choice(WEIRD)
    return _nested(rng, rng.randint(1, 4))


def _nested(rng: random.Random, depth: int) -> Any:
    if depth == 0:
        return rng.choice(WEIRD)
    if rng.random() < 0.5:
        return [_nested(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["a", "role", "content", "type"]): _nested(rng, depth - 1) for _ in range(rng.randint(0, 3))}


def _messages(rng: random.Random, hostile: float) -> Any:
    roll = rng.random()
    if roll >= 0.75 * hostile:
        text = rng.choice(["Hello", "Q1?", "", "357+468=", "x" * 200, "\u00e9\u4e2d"])
        role = "user" if rng.random() >= hostile else rng.choice(["system", "assistant", "tool", "nope"])
        messages = [{"role": role, "content": text}]
        if rng.random() < hostile / 2:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hi"},
                        {
                            "type": "image_url",
                            "image_url": {
                                "url": rng.choice(
                                    ["http://127.0.0.1:9/x.png", "data:image/png;base64,AAAA", "/etc/passwd"]
                                )
                            },
                        },
                    ],
                }
            )
        return messages
    return _value(rng, [[], [{"role": "user"}], "Hello"])


def random_body(rng: random.Random, route: str) -> Any:
    """One body for `route` (usually an object; sometimes not even that)."""
    if rng.random() < 0.03:
        return rng.choice(WEIRD)
    # half the bodies are careful (a few fields, rarely a wrong one): they reach the decode
    careful = rng.random() < 0.5
    hostile, share = (0.03, 0.12) if careful else (0.4, 0.35)
    protocol = route.endswith("/generate")
    fields = PROTOCOL if protocol else SANE
    # (a careful protocol body keeps to each field's first two values, which are valid)
    body = {
        name: _value(rng, values[:2] if protocol and careful else values, hostile)
        for name, values in fields.items()
        if rng.random() < share
    }
    if protocol:
        for name in ("prompt_tokens", "target_length", "num_steps", "mask_schedule", "top_p"):
            if name not in body and rng.random() >= hostile / 4:
                body[name] = rng.choice(PROTOCOL[name][:2] if careful else PROTOCOL[name])
        steps = body.get("num_steps")
        if isinstance(steps, int) and 0 < steps <= MAX_PROTOCOL_STEPS and rng.random() >= hostile / 4:
            body["temperature_schedule"] = [rng.choice([0.0, 0.5, 1.0]) for _ in range(steps)]
        else:
            body["temperature_schedule"] = _value(rng, [[0.0], []], hostile)
    elif route.endswith("chat/completions"):
        body["messages"] = _messages(rng, hostile)
    else:
        body["prompt"] = _value(rng, ["Hi", "357+468=", "", [5, 9, 30]], hostile)
    if rng.random() < hostile / 4:
        body[rng.choice(["x", "extra", "chat_template_kwargs", "draft_model", "adapters"])] = _nested(rng, 2)
    return body


def encode(body: Any, rng: random.Random) -> bytes:
    """The body's bytes: JSON (non-finite numbers as JS literals, as a careless client
    writes them), now and then broken or not UTF-8."""
    data = json.dumps(body).encode()
    roll = rng.random()
    if roll < 0.02:
        return data[: rng.randint(0, max(len(data) - 1, 0))]  # truncated
    if roll < 0.04:
        return data + b"\xff\xfe"
    return data


def _strict(text: str) -> Any:
    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def check_answer(status: int, content_type: str, body: bytes) -> Optional[str]:
    """None if the answer is clean; else what is wrong with it."""
    if not (200 <= status < 300 or 400 <= status < 500):
        return f"status {status}"
    try:
        if content_type.startswith("text/event-stream"):
            events = [line[len("data: ") :] for line in body.decode().split("\n") if line.startswith("data: ")]
            if not events or events[-1].strip() != "[DONE]":
                return "a stream that does not end with [DONE]"
            for event in events[:-1]:
                _strict(event)
        else:
            data = _strict(body.decode())
            if status >= 400 and not (
                isinstance(data, dict) and isinstance(data.get("error"), dict) and data["error"].get("message")
            ):
                return "an error without an OpenAI-shaped body"
    except (ValueError, UnicodeDecodeError) as e:
        return f"not JSON: {e}"
    return None
