"""OpenAI requests' parts: the JSON body's limits, the checks `request_body.parse_body`
builds on (unknown fields, the decoding fields, proposals, a prompt's length), the seed of a
request that names none, the sampling ids against the vocabulary (generation thread), and
the DiffusionRequest handed to the generator."""

from __future__ import annotations

import difflib
import math
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

from mlx_lm.server import (
    CompletionRequest,
)

from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.decoding import IMPLIED_RULES, MAX_PROPOSALS
from mlx_lm_diffusion.output import request_constraints
from mlx_lm_diffusion.serving import distributed_server
from mlx_lm_diffusion.serving.errors import RequestError

SEED_MAX = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer
CONTEXT_SIZE_MAX = 1 << 20
MAX_JSON_DEPTH = 64
# Stop strings a request may give: each is tokenized and compiled into a matcher that
# mlx_lm.server caches per set (400,000 stops took 44-105 s and 1.2 GB, a 3 MB one 46 s,
# while every other request waited). OpenAI's API takes up to 4.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LEGACY_LOGPROBS = 5  # /v1/completions' integer logprobs, as OpenAI bounds it
DEFAULT_MAX_CHOICES = 16  # choices in one answer (n times the prompts): rows of one batch (--max-choices)
# the fields that choose a commit rule (a strategy, a schedule, a setting that selects its own
# rule): the decoding layer's list, so that none is missed (issue 52: {"factor": 1.0} under a
# server's --threshold was refused as two rules)
_RULE_FIELDS = ("strategy", "schedule", *IMPLIED_RULES)


def check_sampling_against_vocabulary(args: Any, vocab_size: int) -> None:
    """The sampling fields that name token ids, against the model that will decode them
    (known on the generation thread only): an id outside the vocabulary would index past
    the logits (a logit_bias key of 100000 on a 16-token vocabulary is a segfault), and
    mlx-lm's top-k raises mid-decode for top_k >= the vocabulary."""
    top_k = args.sampling.top_k
    if top_k >= vocab_size:
        raise RequestError(
            f"top_k must be below the vocabulary size ({vocab_size}), got {top_k}; 0 keeps every token", param="top_k"
        )
    for token, bias in (args.logits.logit_bias or {}).items():
        if not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias key {token} is not a token id (0 to {vocab_size - 1})", param="logit_bias")
        if not math.isfinite(bias):
            raise RequestError(
                f"logit_bias values must be finite numbers, got {bias!r} for {token}", param="logit_bias"
            )


def request_seed() -> int:
    """The seed of a request that names none. Every request draws from its own key
    (isolation: no request's draws depend on another's, or on a global random state a
    failed request left behind). Drawn here, on the HTTP thread before the request is
    queued, so under mlx.launch rank 0's choice travels with the request to every rank."""
    return secrets.randbits(64)


@dataclass
class DiffusionRequest(CompletionRequest):
    """mlx_lm.server's request plus its decoding fields and draft channel."""

    options: dict = field(default_factory=dict)
    drafts: bool = False
    proposals: int = 0  # per draft frame, the k most likely tokens at each predicted position (the studio's hover)
    draft_sink: Optional[Callable[[dict], None]] = None
    error_status: Optional[int] = None
    ctx: Any = None  # mlx_lm.server's GenerationContext once generation starts
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_error: Optional[BaseException] = None  # what a cancelled decode raises
    connection: Any = None  # the client's socket: a closed one cancels the decode
    peer_probe: Optional[Callable[[], None]] = None  # writes the client an interim answer (peers.HALF)
    images: list = field(default_factory=list)  # decoded on the handler thread (images.py)
    image_prompt: Optional[List[int]] = None  # their prompt, built by the processor
    prompt_ids: Optional[List[int]] = None  # a completion's prompt given as token ids

    # mlx.launch: the other ranks receive the request without this process's channels
    def __getstate__(self):
        return distributed_server.request_state(self)

    def __setstate__(self, state):
        distributed_server.restore_request(self, state)


# OpenAI's request fields this server reads no meaning from: accepted and ignored (README)
IGNORED_OPENAI_FIELDS = (
    "user",
    "store",
    "metadata",
    "service_tier",
    "parallel_tool_calls",
    "function_call",
    "functions",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "verbosity",
    "prompt_cache_key",
    "safety_identifier",
)


def check_unknown_fields(body: dict, known: Sequence[str]) -> None:
    """A field this server does not know that looks like one it does ("threshhold") is a
    misspelling that would silently decode with the default: a 400 naming the field it
    resembles. Other unknown fields (OpenAI's and clients' extras) are ignored."""
    names = [n for n in known if n not in IGNORED_OPENAI_FIELDS]
    for name in body:
        if not isinstance(name, str) or name in known:
            continue
        near = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
        if near:
            raise RequestError(f"unknown field {name[:60]!r}; did you mean {near[0]!r}?", param=name[:60])


def parse_request_options(body: dict) -> Tuple[dict, bool]:
    """The decoding fields and the `drafts` flag of a JSON body, checked (ValueError)."""
    options = compat.check_decode_fields({k: body[k] for k in compat.DECODE_FIELDS if k in body})
    options.update(request_constraints.parse_fields(body))  # suffix, response_format
    drafts = body.get("drafts", False)
    if drafts is None:
        drafts = False
    if not isinstance(drafts, bool):
        raise ValueError(f"drafts must be a boolean, got {drafts!r}")
    return options, drafts


def parse_proposals(body: dict, drafts: bool) -> int:
    """The `proposals` field: per draft frame, the k most likely tokens at each position the
    forward predicted (0 to MAX_PROPOSALS; it needs drafts)."""
    k = body.get("proposals", 0)
    if k is None:
        return 0
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_PROPOSALS:
        raise RequestError(f"proposals must be an integer from 0 to {MAX_PROPOSALS}, got {k!r}", param="proposals")
    if k and not drafts:
        raise RequestError("proposals come with the draft frames: set drafts to true", param="proposals")
    return k


def prompt_characters(body: dict) -> tuple[int, int]:
    """(characters of the prompt's text, token ids given as such) of a completions `prompt`
    or a chat's `messages` (string contents and text parts), read without tokenizing."""
    chars, ids = 0, 0

    def add(value: Any) -> None:
        nonlocal chars, ids
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, int) and not isinstance(item, bool):
                    ids += 1
                elif isinstance(item, dict):
                    add(item.get("text"))
                else:
                    add(item)

    add(body.get("prompt"))
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            add(message.get("content"))
    return chars, ids


def check_prompt_length(body: dict, generator: Any) -> None:
    """Refuse (400) from its length alone a prompt that cannot fit the model's context: it has
    at least characters / (the most characters a vocabulary entry holds) tokens. A 10 MB
    prompt was tokenized in full first (15-30 s, 1 GB) on the path every request waits on."""
    provider = getattr(generator, "model_provider", None)
    model = getattr(provider, "model", None)
    context = getattr(model, "max_length", None)
    longest = generator.longest_token_chars() if hasattr(generator, "longest_token_chars") else None
    if not isinstance(context, int) or not longest:
        return
    chars, ids = prompt_characters(body)
    at_least = ids + chars // longest
    if at_least >= context:
        field = "messages" if "messages" in body else "prompt"
        raise RequestError(
            f"the prompt has at least {at_least} tokens ({chars} characters, at most {longest} a "
            f"token), more than the model's context of {context}: shorten it",
            param=field,
            code="context_length_exceeded",
        )


def merge_options(defaults: dict, requested: dict) -> dict:
    """The server's decoding defaults under a request's fields. A request that names its
    commit rule (a strategy, a schedule, or a setting that selects a rule: threshold,
    factor, entropy_bound) drops the server's rule defaults, which belong to another rule."""
    if any(name in requested for name in _RULE_FIELDS):
        defaults = {k: v for k, v in defaults.items() if k not in _RULE_FIELDS}
    return {**defaults, **requested}


_BODY_FIELDS = (
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "xtc_probability",
    "xtc_threshold",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "seed",
    "stop",
    "tools",
    "tool_choice",
    "role_mapping",
    "chat_template_kwargs",
    "draft_model",
    "adapters",
    "num_draft_tokens",
    "drafts",
    "proposals",
    "n",
    "echo",
    "best_of",
)


TOP_LOGPROBS_MAX = 20  # OpenAI's bound (mlx_lm.server's is 11)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _depth_exceeds(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                return True
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
