"""An OpenAI-compatible server for diffusion models, on mlx_lm.server's machinery.

    mlx_lm_diffusion.server [--model PATH] [--port 8080] [--block-length 32 --steps 32 ...]

(without --model: the embedded demo model, as the generate and chat CLIs)

Takes every mlx_lm.server flag (parsed by mlx_lm.server itself) plus the diffusion
defaults, and serves /v1/chat/completions, /v1/completions, /v1/models and /health
with mlx_lm.server's request and response shapes. On top of mlx_lm.server:

* per-request decoding fields in the JSON body: block_length, steps, strategy,
  threshold, factor, entropy_bound, alg_temp, editing_threshold, max_post_steps,
  checked before anything is generated;
* `"drafts": true` with `"stream": true` sends the canvas after every forward as an
  SSE comment line (`: draft {"forwards": 3, "committed": 1, "text": "He░░o"}`),
  which OpenAI clients ignore;
* every error has OpenAI's body, `{"error": {"message", "type", "param", "code"}}`:
  a 4xx for a bad request (malformed HTTP or JSON, an invalid field, a prompt the
  model cannot decode, a model this server does not serve), a 5xx for the server's
  own failures; an error found once a stream has begun ends the stream with an SSE
  `data: {"error": ...}` event and `data: [DONE]`;
* POST /v1/diffusion/generate takes a step-schedule InferenceRequest and returns its
  InferenceResponse (`protocol.run_request`); a schema violation is a 400 carrying
  the validation message.

What a client may do is bounded (mlx_lm.server leaves these open):

* bodies: at most --max-body-bytes (413), a Content-Length required (411) and
  well-formed (400), UTF-8 JSON without NaN/Infinity nested at most
  MAX_JSON_DEPTH deep (400); sampling fields finite and in range (400);
* connections: a listen backlog of 128, --read-timeout for the request line,
  headers and body, at most --max-connections open (503 beyond), RLIMIT_NOFILE
  restored after mlx_lm.utils lowers it; a client that goes away (streaming or not)
  cancels its decode at the next forward;
* models: only --model and the --allowed-models the operator named are served; any
  other "model" is a 404 that reads neither the filesystem nor the Hub; a request's
  draft_model, adapters and num_draft_tokens are refused, images (DiffusionGemma) are
  data: URLs or files under --allowed-image-dir (nothing is fetched; --max-images,
  --max-image-bytes: 400 / 413), a client's chat template is refused unless
  --allow-client-chat-templates;
* browsers: CORS is off unless --allowed-origins names origins; a request carrying an
  Origin not allowed, or a Host that is a domain name this server was not told of
  (--allowed-hosts; DNS rebinding), gets a 403;
* SIGTERM / SIGINT stop accepting, let in-flight requests finish for
  --shutdown-grace seconds, cancel the rest with an error, and exit 0;
* the server fails at start (one line on stderr, exit 2, before binding the port)
  when --model cannot be loaded or a flag cannot apply to a diffusion model.

Diffusion requests are batched continuously (mlx_lm_diffusion.scheduler): one running
batch per group of requests with the same family options, rows joining at the next step
and leaving once done, at most --decode-concurrency rows a batch; each row gives the
tokens the request gives alone. --no-batch serves one request at a time, as mlx_lm.server
does for these models (their `compat.TokenCache` has no `merge`). The step-schedule
endpoint's requests join the same scheduler (a batch of protocol rows, which ignore EOS;
with --no-batch each decodes whole under the decode lock). For the families whose prompt
KV is exact, the prompt cache also holds the KV of its leading tokens: a request (batched
or not) that shares a prefix with an earlier one prefills only the rest; usage's
`prompt_tokens_details.cached_tokens` counts the positions the cache held, and GET
/v1/stats reports running and queued requests and the prompt cache's occupancy (kv_reuse).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import json
import logging
import math
import os
import re
import resource
import secrets
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import unquote

import mlx_lm.server as mlx_server
from mlx_lm.server import (
    APIHandler,
    CompletionRequest,
    LRUPromptCache,
    ModelProvider,
    ResponseGenerator,
    get_system_fingerprint,
)
from mlx_lm.utils import _parse_size

from model_adapters import adapter_for, is_diffusion_model

from . import compat, distributed, distributed_server, images, peers, request_constraints, stream_batching
from .decoders.speculative import check_greedy
from .demo import MODEL_HELP, model_or_demo
from .generate import one_line_errors
from .canvas_view import MASK_GLYPH
from .engine import Step
from .install import install
from .kv_reuse import CachedTokensTap, cache_occupancy
from .protocol import prepare_request, run_request
from .scheduler import Scheduler, prepare_job

PROG = "mlx_lm_diffusion.server"
DRAFT_EVENT = "mlx_lm_diffusion.draft"  # tag of draft events on a request's response queue
# The decoding fields are the options schema's named options, looked up per request (a
# family registered after this import adds its own): compat.DECODE_FIELDS.
PROTOCOL_PATH = "/v1/diffusion/generate"  # the step-schedule protocol (shared/seeds/004)
STATS_PATH = "/v1/stats"  # running decodes, queued requests, prompt cache occupancy
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
_RULE_FIELDS = ("strategy", "threshold")

DEFAULT_MAX_BODY_BYTES = 10 * 1000 * 1000
DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_SHUTDOWN_GRACE = 30.0
# Forwards a request may cost at most (--max-forwards): above any reference decode of a
# few thousand tokens, below what would hold the model for hours ("steps": 10**5).
DEFAULT_MAX_FORWARDS = 16384
LISTEN_BACKLOG = 128
MAX_JSON_DEPTH = 64
LOG_EXCERPT = 200  # characters of a request body a log line may quote
SEED_MAX = 2**64 - 1  # mx.random.seed takes an unsigned 64-bit integer
CONTEXT_SIZE_MAX = 1 << 20



def check_sampling_against_vocabulary(args: Any, vocab_size: int) -> None:
    """The sampling fields that name token ids, against the model that will decode them
    (known on the generation thread only): an id outside the vocabulary would index past
    the logits (a logit_bias key of 100000 on a 16-token vocabulary is a segfault), and
    mlx-lm's top-k raises mid-decode for top_k >= the vocabulary."""
    top_k = args.sampling.top_k
    if top_k >= vocab_size:
        raise RequestError(f"top_k must be below the vocabulary size ({vocab_size}), got {top_k}; "
                           "0 keeps every token", param="top_k")
    for token, bias in (args.logits.logit_bias or {}).items():
        if not 0 <= token < vocab_size:
            raise RequestError(f"logit_bias key {token} is not a token id (0 to {vocab_size - 1})",
                               param="logit_bias")
        if not math.isfinite(bias):
            raise RequestError(f"logit_bias values must be finite numbers, got {bias!r} for {token}",
                               param="logit_bias")


def request_seed() -> int:
    """The seed of a request that names none. Every request draws from its own key
    (isolation: no request's draws depend on another's, or on a global random state a
    failed request left behind). Drawn here, on the HTTP thread before the request is
    queued, so under mlx.launch rank 0's choice travels with the request to every rank."""
    return secrets.randbits(64)


# mlx_lm.server flags that cannot apply to a diffusion model: refused at start
INAPPLICABLE_FLAGS = {
    "draft_model": ("--draft-model", "speculative decoding does not apply to diffusion models"),
    "num_draft_tokens": ("--num-draft-tokens", "speculative decoding does not apply to diffusion models"),
    "adapter_path": ("--adapter-path", "this server does not load adapters for diffusion models (mlx_lm_diffusion.load, "
                     "the generate and chat CLIs do); serve a model with the adapter fused into its weights"),
    "kv_bits": ("--kv-bits", compat.NO_KV_QUANTIZATION),
    "kv_group_size": ("--kv-group-size", compat.NO_KV_QUANTIZATION),
    "quantized_kv_start": ("--quantized-kv-start", compat.NO_KV_QUANTIZATION),
    "prefill_step_size": ("--prefill-step-size", "a diffusion model has no prefill"),
    "pipeline": ("--pipeline", "pipeline parallelism is not supported for diffusion models; tensor "
                 "parallelism is (mlx.launch without --pipeline)"),
}

# the NOFILE limits this process started with, before mlx_lm.utils set (2048, 4096);
# known here when this module is imported before mlx_lm.utils, else read at start
_NOFILE_AT_IMPORT = None if "mlx_lm.utils" in sys.modules else resource.getrlimit(resource.RLIMIT_NOFILE)


class RequestError(ValueError):
    """A request the server cannot serve as asked: answered with `status` and an
    OpenAI-shaped JSON body."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


class Cancelled(RequestError):
    """The server cancelled a request (it is shutting down)."""

    def __init__(self, message: str = "the server is shutting down; retry later"):
        super().__init__(message, status=503, code="shutting_down")


class ClientGone(Exception):
    """The client closed its connection: its decode stops, nobody is answered."""


class StartupError(Exception):
    """The server cannot start as asked (one line for stderr)."""


def error_body(message: str, status: int, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error object."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    if code is None:
        code = {404: "not_found", 411: "length_required", 413: "request_too_large",
                403: "forbidden", 503: "unavailable"}.get(status)
    return {"error": {"message": str(message), "type": kind, "param": param, "code": code}}


_LEADING_NAME = re.compile(r"^([a-z_][a-z0-9_]*)\b")


def _param_of(message: str, known: Sequence[str]) -> Optional[str]:
    """The request field an error message starts with, if it names one."""
    m = _LEADING_NAME.match(message)
    return m.group(1) if m and m.group(1) in known else None


def excerpt(raw: bytes, limit: int = LOG_EXCERPT) -> str:
    """A bounded, escaped quotation of client bytes for a log line (no control
    characters, so a body cannot forge log lines)."""
    head = raw[:limit].decode("utf-8", "backslashreplace")
    text = head.encode("ascii", "backslashreplace").decode("ascii")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    more = f"... ({len(raw)} bytes)" if len(raw) > limit else ""
    return f"'{text}'{more}"


# ----------------------------------------------------------------------------- requests


@dataclass
class DiffusionRequest(CompletionRequest):
    """mlx_lm.server's request plus its decoding fields and draft channel."""

    options: dict = field(default_factory=dict)
    drafts: bool = False
    draft_sink: Optional[Callable[[dict], None]] = None
    error_status: Optional[int] = None
    ctx: Any = None  # mlx_lm.server's GenerationContext once generation starts
    cancel: threading.Event = field(default_factory=threading.Event)
    cancel_error: Optional[BaseException] = None  # what a cancelled decode raises
    connection: Any = None  # the client's socket: a closed one cancels the decode
    images: list = field(default_factory=list)  # decoded on the handler thread (images.py)
    image_prompt: Optional[List[int]] = None  # their prompt, built by the processor

    # mlx.launch: the other ranks receive the request without this process's channels
    def __getstate__(self):
        return distributed_server.request_state(self)

    def __setstate__(self, state):
        distributed_server.restore_request(self, state)


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


def merge_options(defaults: dict, requested: dict) -> dict:
    """The server's decoding defaults under a request's fields. A request that names its
    commit rule (strategy or threshold) drops the server's rule defaults, which belong
    to another rule."""
    if any(name in requested for name in _RULE_FIELDS):
        defaults = {k: v for k, v in defaults.items() if k not in _RULE_FIELDS}
    return {**defaults, **requested}


def render_draft(tokenizer: Any, step: Step, mask_id: Optional[int]) -> str:
    """Row 0's generated region: runs of tokens decoded together, masks as a glyph."""
    pieces: List[str] = []
    run: List[int] = []
    for token in step.canvas[0, step.prompt_len :].tolist():
        if token == mask_id:
            if run:
                pieces.append(tokenizer.decode(run))
                run = []
            pieces.append(MASK_GLYPH)
        else:
            run.append(int(token))
    if run:
        pieces.append(tokenizer.decode(run))
    return "".join(pieces)


def _model_names(name: str) -> List[str]:
    """The strings a client may send for a model the operator named: the name as
    given, and for a local directory its absolute and resolved paths."""
    names = [name]
    path = Path(name).expanduser()
    if path.exists():
        names += [str(path.absolute()), str(path.resolve())]
    return names


def _model_id(name: str) -> str:
    path = Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


class DiffusionResponseGenerator(distributed_server.DistributedGeneration, ResponseGenerator):
    """mlx_lm.server's generation loop, with decoding options, drafts, up-front checks,
    the served-model allow-list and per-step cancellation."""

    def __init__(self, model_provider: ModelProvider, prompt_cache: LRUPromptCache, defaults: Optional[dict] = None):
        self.defaults = dict(defaults or {})  # set before the generation thread starts
        # One decode at a time: the generation thread's requests and the step-schedule
        # protocol's (served on handler threads) take turns on the model.
        self.decode_lock = threading.Lock()
        self.load_error: Optional[BaseException] = None
        self.loaded = threading.Event()
        cli = model_provider.cli_args
        self.served: Dict[str, str] = {}  # what a client may send -> what mlx_lm.server loads
        self.listed: Dict[str, str] = {}  # what mlx_lm.server loads -> the id /v1/models lists
        if cli.model is not None:
            self.listed["default_model"] = _model_id(cli.model)
            for name in ["default_model", *_model_names(cli.model)]:
                self.served[name] = "default_model"
        for extra in getattr(cli, "allowed_models", None) or []:
            self.listed.setdefault(extra, _model_id(extra))
            for name in _model_names(extra):
                self.served.setdefault(name, extra)
        for key, listed in self.listed.items():
            self.served.setdefault(listed, key)
        self.model_ids: List[str] = list(dict.fromkeys(self.listed.values()))
        # Continuous batching (mlx_lm_diffusion.scheduler), started once the model loads;
        # None with --no-batch: one request at a time, as before.
        self.scheduler: Optional[Scheduler] = None
        super().__init__(model_provider, prompt_cache)

    def wait_loaded(self, timeout: Optional[float] = None) -> None:
        """Block until --model is loaded; raise StartupError if it cannot be."""
        if not self.loaded.wait(timeout):
            raise StartupError("the model did not load in time")
        if self.load_error is not None:
            message = str(self.load_error).strip().splitlines() or [type(self.load_error).__name__]
            raise StartupError(f"cannot load --model {self.cli_args.model!r}: {message[0]}")

    def run_protocol(self, body: Any, cancel: Optional[threading.Event] = None) -> dict:
        """Decode one step-schedule InferenceRequest on the served model: a row of the
        scheduler's batches when batching (a batch of protocol rows), else here."""
        scheduler = self.scheduler
        # (DiffusionGemma's committing uniform canvas and a request's images decode alone)
        alone = isinstance(body, dict) and bool(body.get("images")) or getattr(
            scheduler, "model", None) is not None and getattr(scheduler.model, "has_vision", None) is not None
        if scheduler is not None and self.model_provider.model is scheduler.model and not alone:
            if isinstance(body, dict) and "seed" not in body:  # its own key, as for completions
                body = {**body, "seed": request_seed()}
            with self.decode_lock:  # (validated and resolved as alone; the decode is the scheduler's)
                self._check_cancel(cancel)
                decode = prepare_request(scheduler.model, scheduler.tokenizer, body, max_forwards=self.max_forwards)
            return scheduler.submit_protocol(decode, lambda: self._check_cancel(cancel)).result()
        with self.decode_lock:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            model, tokenizer = self.model_provider.model, self.model_provider.tokenizer
            if model is None:
                raise RequestError("no model is loaded yet; start the server with --model", status=503)
            if self.group is not None:  # (decoded on this handler thread: rank 0 alone)
                raise RequestError("the step-schedule protocol is not served under mlx.launch", status=501)
            if isinstance(body, dict) and "seed" not in body:  # its own key, as for completions
                body = {**body, "seed": request_seed()}
            pictures = isinstance(body, dict) and bool(body.get("images"))  # the `images` extension
            return run_request(model, tokenizer, body, max_forwards=self.max_forwards,
                               on_step=lambda step: self._check_cancel(cancel),
                               processor=images.served_processor(self.model_provider) if pictures else None,
                               image_policy=images.server_policy(self.cli_args))

    @property
    def max_forwards(self) -> Optional[int]:
        return getattr(self.cli_args, "max_forwards", DEFAULT_MAX_FORWARDS)

    @staticmethod
    def _check_cancel(cancel: Optional[threading.Event]) -> None:
        if cancel is not None and cancel.is_set():
            raise Cancelled()

    # -- handler thread

    def generate(self, request, generation_args, progress_callback=None):
        try:
            self._check_model(generation_args.model)
            ctx, responses = super().generate(
                request, generation_args, self._progress(request, progress_callback)
            )
        except RequestError as e:
            if isinstance(request, DiffusionRequest):
                request.error_status = e.status
            raise
        if isinstance(request, DiffusionRequest):
            request.ctx = ctx
        return ctx, responses

    @staticmethod
    def _progress(request, callback):
        sink = getattr(request, "draft_sink", None)

        def progress(*values):
            if values and values[0] == DRAFT_EVENT:
                if sink is not None:
                    sink(values[1])
            elif callback is not None:
                callback(*values)

        return progress

    def _check_model(self, description) -> None:
        """Only the models the operator named are served: any other name is a 404,
        decided on the string alone (no filesystem, no Hub, the served model stays)."""
        name = description.model
        if isinstance(name, str) and name in self.served:
            description.model = self.served[name]
            return
        served = ", ".join(self.model_ids) or "nothing"
        raise RequestError(
            f"model {name!r} is not served here; this server serves: {served}",
            status=404, param="model", code="model_not_found",
        )

    # -- generation thread

    def _generate(self):
        try:
            self.model_provider.load_default()
        except Exception as e:  # reported by wait_loaded; the thread ends
            self.load_error = e
            self.model_provider.reset()
            self.loaded.set()
            return
        self._start_scheduler()
        self.loaded.set()
        super()._generate()  # load_default again: the same model key, no reload

    def _start_scheduler(self) -> None:
        model, cli = self.model_provider.model, self.cli_args
        # (under mlx.launch every rank follows mlx_lm.server's own loop, request by request:
        # a batch's rows would be stepped on rank 0 alone)
        if is_diffusion_model(model) and not getattr(cli, "no_batch", False) and self.group is None:
            self.scheduler = Scheduler(model, self.model_provider.tokenizer, self.decode_lock,
                                       getattr(cli, "decode_concurrency", 32))

    def stop_and_join(self):
        if self.scheduler is not None:
            self.scheduler.stop()
        super().stop_and_join()

    def _batched(self, request) -> bool:
        """Whether the scheduler decodes this request (the served diffusion model, batching
        on). Images, an infill's suffix and a response_format take the serial path, whose
        decode applies them (a batch row knows none of them yet)."""
        options = self._options(request[1])
        return (self.scheduler is not None and self.model_provider.model is self.scheduler.model
                and not any(mlx_server._image_parts(getattr(request[1], "messages", None) or []))
                and all(options.get(name) is None for name in request_constraints.REQUEST_FIELDS))

    def _options(self, request) -> dict:
        return merge_options(self.defaults, getattr(request, "options", {}))

    def _tokenize(self, tokenizer, request, args):
        try:
            ids = getattr(request, "image_prompt", None)
            result = (ids, [ids], ["assistant"], "normal", None) if ids is not None else super()._tokenize(
                tokenizer, request, args)
        except Exception as e:
            raise RequestError(f"cannot build a prompt from this request: {e}") from e
        model = self.model_provider.model
        check_sampling_against_vocabulary(args, adapter_for(model, tokenizer).vocab_size)
        if is_diffusion_model(model):
            try:
                compat.check_request(model, tokenizer, result[0], args.max_tokens, self._options(request),
                                     max_forwards=self.max_forwards)
                if self._options(request).get("self_spec"):  # (sampling is in mlx-lm's args, not the fields)
                    check_greedy(args.sampling.temperature, bool(mlx_server._make_logits_processors(args)))
            except (ValueError, TypeError) as e:
                raise RequestError(str(e)) from e
        else:  # mlx-lm's own decode would ignore them
            try:
                request_constraints.refuse_unserved(self._options(request))
            except ValueError as e:
                raise RequestError(str(e)) from e
        return result

    @staticmethod
    def _canceller(req) -> Callable[[], None]:
        """Raises when the request was cancelled or its client left."""
        cancel = getattr(req, "cancel", None)
        sock = getattr(req, "connection", None)

        def check(peer_closed: Optional[bool] = None) -> None:
            """`peer_closed`: whether the client left, when the caller polled it already."""
            if cancel is not None and cancel.is_set():
                raise req.cancel_error or Cancelled()
            if sock is not None and (peers.closed([sock])[0] if peer_closed is None else peer_closed):
                raise ClientGone("the client closed its connection")

        check.socket = sock  # (a running batch polls every row's socket at once: mlx_lm_diffusion.peers)
        return check

    def _serve_single(self, request, stream):
        if self._batched(request):  # joins a running batch at its next step; returns at once
            job = prepare_job(self, request)
            if job is not None:
                self.scheduler.submit(job)
            return
        rqueue, req, _ = request
        options = self._options(req)
        check = self.agreed(self._canceller(req))  # (mlx.launch: rank 0 decides for every rank)
        if is_diffusion_model(self.model_provider.model):
            # usage's cached_tokens: the prompt positions whose KV the decode reused
            tap = CachedTokensTap(rqueue)
            request = (tap, *request[1:])
            options["cached_tokens_callback"] = tap.report
            drafts = self._draft_sender(rqueue) if getattr(req, "drafts", False) else None

            def on_step(step: Step) -> None:
                check()  # a cancelled request or a gone client stops at the next forward
                if drafts is not None:
                    drafts(step)

            options["draft_callback"] = on_step
            # (temperature 0: the decoder's greedy proposal, as a batched row's, not mlx-lm's argmax sampler)
            options["greedy_at_zero_temperature"] = request[2].sampling.temperature == 0
            if getattr(req, "images", None):
                try:
                    options["vision"] = self._image_prompt(req, request[2])
                except (RequestError, ValueError) as e:
                    rqueue.put(e if isinstance(e, RequestError) else RequestError(str(e), status=getattr(e, "status", 400)))
                    return
        with self.decode_lock, compat.request_options(**options):
            try:
                check()
            except (RequestError, ClientGone, distributed.StoppedByLeader) as e:
                rqueue.put(e)
                return
            super()._serve_single(request, stream)

    def _image_prompt(self, req, args):
        """A request with images: its prompt through the processor (`req.image_prompt`)
        and the vision inputs its decode encodes."""
        template_kwargs = dict(self.model_provider.cli_args.chat_template_args or {})
        template_kwargs.update(args.chat_template_kwargs or {})
        template_kwargs.pop("tools", None)
        req.image_prompt, vision = images.served_prompt(
            self.model_provider, self.model_provider.tokenizer, req.messages, req.images, template_kwargs)
        return vision

    def stats(self) -> dict:
        """GET /v1/stats: decodes running and requests waiting (served one at a time: 0 or 1
        running) and the prompt cache's occupancy (kv_reuse.cache_occupancy)."""
        running, queued = int(self.decode_lock.locked()), self.requests.qsize()
        if self.scheduler is not None:  # batched: the rows decoding and the requests waiting for a row
            batch = self.scheduler.stats()
            running, queued = batch["running_rows"], queued + batch["queued_requests"]
        return {
            "object": "stats",
            "running": running,
            "queued": queued,
            "prompt_cache": cache_occupancy(self.prompt_cache),
        }

    def _draft_sender(self, rqueue) -> Callable[[Step], None]:
        tokenizer = self.model_provider.tokenizer
        mask_id = adapter_for(self.model_provider.model, tokenizer).mask_id

        def send(step: Step) -> None:
            payload = {
                "forwards": int(step.forwards),
                "committed": int(step.final[0]),
                "text": render_draft(tokenizer, step, mask_id),
            }
            rqueue.put((DRAFT_EVENT, payload))

        return send


# ----------------------------------------------------------------------------- handler


NO_BODY = object()  # _read_body's "no body to act on: the error was answered"


class _Answered(BaseException):
    """The error was answered already (passes mlx_lm.server's `except Exception`)."""


class _DecodeFailed(Exception):
    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


_CLIENT_ERRORS = (ConnectionError, TimeoutError, socket.timeout)


class _Guarded:
    """The response generator as one request's handler sees it: a failure of
    generate() is answered as an error here; a failure while iterating is marked as
    the decode's (not the client connection's)."""

    def __init__(self, real: ResponseGenerator, handler: "DiffusionAPIHandler"):
        self._real = real
        self._handler = handler

    def __getattr__(self, name):
        return getattr(self._real, name)

    def generate(self, request, args, progress_callback=None):
        try:
            ctx, responses = self._real.generate(request, args, progress_callback)
        except Exception as e:
            self._handler._answer_failure(e)
            raise _Answered() from None
        return ctx, self._iterate(responses)

    @staticmethod
    def _iterate(responses):
        try:
            yield from stream_batching.unpack(responses)  # (the scheduler's tokens come in mailboxes)
        except _CLIENT_ERRORS:  # writing keepalives or drafts to a gone client
            raise
        except Exception as e:
            raise _DecodeFailed(e) from e


_BODY_FIELDS = (
    "model", "messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repetition_context_size",
    "presence_penalty", "presence_context_size", "frequency_penalty", "frequency_context_size",
    "xtc_probability", "xtc_threshold", "logit_bias", "logprobs", "top_logprobs", "seed",
    "stop", "tools", "role_mapping", "chat_template_kwargs", "draft_model", "adapters",
    "num_draft_tokens", "drafts",
)

# finite-number fields and their ranges (low, high), checked before mlx_lm.server's own
_NUMBER_RANGES = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 100.0),
    "presence_penalty": (-100.0, 100.0),
    "frequency_penalty": (-100.0, 100.0),
    "xtc_probability": (0.0, 1.0),
    "xtc_threshold": (0.0, 1.0),
}
_INTEGER_RANGES = {
    "max_tokens": (1, None),
    "top_k": (0, None),
    "repetition_context_size": (0, CONTEXT_SIZE_MAX),
    "presence_context_size": (0, CONTEXT_SIZE_MAX),
    "frequency_context_size": (0, CONTEXT_SIZE_MAX),
}


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


def json_safe(value: Any) -> Any:
    """`value` with no number JSON cannot carry: -inf (a log-probability of an excluded
    token) becomes -9999.0 as in OpenAI's answers, NaN and +inf become null."""
    if isinstance(value, float):
        if math.isnan(value) or value == math.inf:
            return None
        return -9999.0 if value == -math.inf else value
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _host_of(header: str) -> str:
    """The host part of a Host header (no port; IPv6 without brackets)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class DiffusionAPIHandler(APIHandler):
    """mlx_lm.server's handler with decoding fields, drafts, bounded bodies, the
    served-model and browser checks, and OpenAI-shaped errors everywhere."""

    # -- connection bookkeeping (the server's watchdog, shutdown and caps)

    def setup(self):
        self.timeout = getattr(self.server, "read_timeout", None)
        self.busy = False
        self.cancel = threading.Event()
        self.cancel_error: Optional[BaseException] = None
        self._request = None
        super().setup()
        register = getattr(self.server, "register", None)
        if register is not None:
            register(self)

    def finish(self):
        try:
            super().finish()
        finally:
            unregister = getattr(self.server, "unregister", None)
            if unregister is not None:
                unregister(self)

    def handle_one_request(self):
        arm = getattr(self.server, "arm", None)
        if arm is not None:
            arm(self)  # request line, headers and body within --read-timeout
        try:
            super().handle_one_request()
        finally:
            self._disarm()
            self.busy = False

    def parse_request(self):
        if not super().parse_request():
            return False
        self.busy = True
        if self.command != "POST":
            self._disarm()
        return True

    def _disarm(self):
        disarm = getattr(self.server, "disarm", None)
        if disarm is not None:
            disarm(self)

    def cancel_request(self, error: BaseException) -> None:
        """Cancel this connection's request (shutdown): its decode raises `error` at
        the next forward and the client gets it as an error."""
        self.cancel_error = error
        self.cancel.set()  # before reading _request: _diffusion_request checks it after setting that
        request = self._request
        if request is not None:
            request.cancel_error = error
            request.cancel.set()

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (bad request line, headers too long, unsupported
        method) as OpenAI-shaped JSON, not HTML."""
        self.close_connection = True
        self.request_version = "HTTP/1.0"  # a status line and headers even for a garbled request line
        text = message or explain or self.responses.get(code, ("error",))[0]
        body = json.dumps(error_body(text, code)).encode()
        try:
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(body)
        except _CLIENT_ERRORS:
            pass

    def _no_such_method(self):
        self._request = None
        if self._gate():
            self.close_connection = True
            self._send_error(405, f"method {self.command} is not supported here")

    do_PUT = do_DELETE = do_PATCH = _no_such_method

    def log_message(self, format, *args):
        logging.info("%s - %s", self.address_string(), excerpt((format % args).encode(), 300))

    # -- gates before any route

    def _gate(self) -> bool:
        """Shutdown, Host and Origin checks; answers and returns False to refuse."""
        server = self.server
        if getattr(server, "draining", False):
            self.close_connection = True
            self._send_error(503, Cancelled().args[0], code="shutting_down")
            return False
        host = self.headers.get("Host")
        if host is not None and not self._host_allowed(host):
            self.close_connection = True
            self._send_error(403, f"Host {host[:100]!r} is not this server's address; "
                             "start it with --allowed-hosts to serve under this name")
            return False
        origin = self.headers.get("Origin")
        if origin is not None and not self._origin_allowed(origin):
            self.close_connection = True
            self._send_error(403, f"Origin {origin[:100]!r} is not allowed; start the server "
                             "with --allowed-origins to let this page call it")
            return False
        return True

    def _host_allowed(self, header: str) -> bool:
        """IP literals and single-label names (localhost) are safe from DNS
        rebinding; a domain name must be one the operator named."""
        host = _host_of(header)
        cli = self.response_generator.cli_args
        allowed = {h.lower() for h in (getattr(cli, "allowed_hosts", None) or [])}
        if "*" in allowed or host in allowed or host == str(cli.host).lower():
            return True
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            pass
        return "." not in host and host != ""

    def _origin_allowed(self, origin: str) -> bool:
        allowed = self.response_generator.cli_args.allowed_origins or []
        return "*" in allowed or origin in allowed

    def _set_cors_headers(self):
        allowed = self.response_generator.cli_args.allowed_origins or []
        headers = getattr(self, "headers", None)
        origin = headers.get("Origin") if headers is not None else None
        if "*" in allowed:
            self.send_header("Access-Control-Allow-Origin", "*")
        elif origin is not None and origin in allowed:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Vary", "Origin")
        else:
            return  # CORS off: no browser page may read the answers
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")

    def do_OPTIONS(self):
        self._request = None
        if not self._gate():
            return
        self._set_completion_headers(204)
        self.end_headers()

    def do_GET(self):
        self._request = None
        if not self._gate():
            return
        if self.path == STATS_PATH:
            return self._send_json(200, self.response_generator.stats())
        if not (self.path.startswith("/v1/models") or self.path == "/health"):
            return self._send_error(404, f"no such endpoint: GET {self.path[:200]}")
        super().do_GET()

    # -- bodies

    def _read_body(self) -> Any:
        """The request's JSON body (any JSON value, null included), or NO_BODY once an
        error has been answered."""
        self.close_connection = True
        limit = getattr(self.response_generator.cli_args, "max_body_bytes", None) or DEFAULT_MAX_BODY_BYTES
        if self.headers.get("Transfer-Encoding") is not None:
            self._send_error(411, "a Content-Length is required (chunked bodies are not accepted)")
            return NO_BODY
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            self._send_error(411, "a Content-Length header is required")
            return NO_BODY
        text = lengths[0].strip()
        if len(set(v.strip() for v in lengths)) > 1 or not (text.isascii() and text.isdigit()):
            self._send_error(400, f"invalid Content-Length header {excerpt(text.encode(), 40)}")
            return NO_BODY
        length = int(text)
        if length > limit:
            self._send_error(413, f"the body ({length} bytes) is over this server's limit of "
                             f"{limit} bytes (--max-body-bytes)")
            self._drain_after_error()
            return NO_BODY
        raw = self.rfile.read(length)
        self._disarm()
        if len(raw) < length:  # the client left, or --read-timeout closed it, within its body
            logging.info(f"{self.address_string()}: closed within its body ({len(raw)} of {length} bytes)")
            return NO_BODY
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            logging.warning(f"body is not UTF-8: {excerpt(raw)}")
            self._send_error(400, f"the body is not UTF-8: {e}")
            return NO_BODY
        try:
            body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
        except RecursionError:
            body, problem = None, f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        except ValueError as e:  # JSONDecodeError included
            body, problem = None, f"invalid JSON in request body: {e}"
        else:
            problem = None
            if _depth_exceeds(body, MAX_JSON_DEPTH):
                problem = f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        if problem is not None:
            logging.warning(f"{problem}; body: {excerpt(raw)}")
            self._send_error(400, problem)
            return NO_BODY
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            logging.debug(f"Incoming Request Body: {excerpt(json.dumps(body).encode(), 2000)}")
        return body

    def _drain_after_error(self) -> None:
        """Read a little of an unread body so the error reaches the client before
        the close (closing with unread bytes resets the connection)."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.2)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and self.connection.recv(65536):
                pass
        except OSError:
            pass

    # -- POST

    def do_POST(self):
        self._request = None
        if not self._gate():
            return
        if self.path != PROTOCOL_PATH and self.path not in POST_PATHS:
            self.close_connection = True
            return self._send_error(404, f"no such endpoint: POST {self.path[:200]}")
        body = self._read_body()
        if body is NO_BODY:
            return
        if self.path == PROTOCOL_PATH:
            return self.handle_protocol(body)
        if not isinstance(body, dict):
            logging.warning(f"Invalid Request Body: {excerpt(json.dumps(body).encode())}")
            return self._send_error(400, "the request body must be a JSON object")
        self.body = body
        try:
            self._read_fields(body)
            self.validate_model_parameters()
            stop_words = self._stop_words(body.get("stop"))
        except RequestError as e:
            return self._send_error(e.status, str(e), param=e.param, code=e.code)
        except (ValueError, TypeError) as e:
            return self._send_error(400, str(e), param=_param_of(str(e), _BODY_FIELDS + compat.DECODE_FIELDS))
        factories = {
            "/v1/completions": self.handle_text_completions,
            "/v1/chat/completions": self.handle_chat_completions,
            "/chat/completions": self.handle_chat_completions,
        }
        try:
            request = factories[self.path]()
        except RequestError as e:
            return self._send_error(e.status, str(e), param=e.param, code=e.code)
        except Exception as e:
            message = str(e) or type(e).__name__
            return self._send_error(400, message, param=_param_of(message, _BODY_FIELDS + compat.DECODE_FIELDS))
        self.handle_completion(request, stop_words)

    def _read_fields(self, body: dict) -> None:
        """mlx_lm.server's field extraction (APIHandler.do_POST), unchanged in meaning."""
        cli = self.response_generator.cli_args
        self.stream = body.get("stream", False)
        self.stream_options = body.get("stream_options", None)
        self.requested_model = body.get("model", "default_model")
        for name in ("draft_model", "adapters", "num_draft_tokens"):
            if body.get(name) is not None:
                raise RequestError(f"{name} is not accepted: speculative decoding and adapters do "
                                   "not apply to this server's diffusion models", param=name)
        self.requested_draft_model = "default_model"
        self.num_draft_tokens = cli.num_draft_tokens
        self.adapter = None
        self.max_tokens = body.get("max_completion_tokens", None)
        if self.max_tokens is None:
            self.max_tokens = body.get("max_tokens", cli.max_tokens)
        self.temperature = body.get("temperature", cli.temp)
        self.top_p = body.get("top_p", cli.top_p)
        self.top_k = body.get("top_k", cli.top_k)
        self.min_p = body.get("min_p", cli.min_p)
        self.repetition_penalty = body.get("repetition_penalty", 0.0)
        self.repetition_context_size = body.get("repetition_context_size", 20)
        self.presence_penalty = body.get("presence_penalty", 0.0)
        self.presence_context_size = body.get("presence_context_size", 20)
        self.frequency_penalty = body.get("frequency_penalty", 0.0)
        self.frequency_context_size = body.get("frequency_context_size", 20)
        self.xtc_probability = body.get("xtc_probability", 0.0)
        self.xtc_threshold = body.get("xtc_threshold", 0.1)
        self.logit_bias = body.get("logit_bias", None)
        self.logprobs = body.get("logprobs", False)
        self.top_logprobs = body.get("top_logprobs", -1)
        self.seed = body.get("seed", None)
        self.chat_template_kwargs = body.get("chat_template_kwargs")

    @staticmethod
    def _stop_words(stop: Any) -> List[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            return [stop] if stop else []
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            return [s for s in stop if s]
        raise RequestError("stop must be a string or a list of strings", param="stop")

    def validate_model_parameters(self) -> None:
        for name, (low, high) in _NUMBER_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"{name} must be a number", param=name)
            if not math.isfinite(value) or not low <= value <= high:
                raise RequestError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value!r}",
                                   param=name)
            setattr(self, name, float(value))  # mlx_lm.server wants floats for xtc_*
        for name, (low, high) in _INTEGER_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise RequestError(f"{name} must be an integer", param=name)
            if value < low or (high is not None and value > high):
                span = f">= {low}" if high is None else f"in [{low}, {high}]"
                raise RequestError(f"{name} must be an integer {span}, got {value!r}", param=name)
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int):
            raise RequestError("top_logprobs must be an integer", param="top_logprobs")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= SEED_MAX
        ):
            raise RequestError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}", param="seed")
        if self.seed is None:
            self.seed = request_seed()
        if self.stream_options is not None:
            if not isinstance(self.stream_options, dict):
                raise RequestError("stream_options must be an object", param="stream_options")
            include = self.stream_options.get("include_usage", False)
            if not isinstance(include, bool):
                raise RequestError("stream_options.include_usage must be a boolean", param="stream_options")
            self.stream_options = {**self.stream_options, "include_usage": include}
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        if (self.chat_template_kwargs or {}).get("chat_template") is not None and not getattr(
            self.response_generator.cli_args, "allow_client_chat_templates", False
        ):
            raise RequestError("a client-supplied chat_template is refused (a template is code this "
                               "server would run); start it with --allow-client-chat-templates",
                               param="chat_template_kwargs")
        super().validate_model_parameters()
        self.decode_options, self.drafts = parse_request_options(self.body)
        if self.drafts and not self.stream:
            raise ValueError("drafts are sent as SSE comments of a stream; set stream to true")

    def handle_chat_completions(self) -> CompletionRequest:
        messages = self.body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a list of message objects", param="messages")
        try:  # read in full here, before anything runs (mlx_lm_diffusion.images)
            pictures = images.check_served_messages(messages, images.server_policy(self.response_generator.cli_args))
        except images.ImageError as e:
            raise RequestError(str(e), status=e.status, param="messages") from None
        request = self._diffusion_request(super().handle_chat_completions())
        request.images = pictures
        return request

    def handle_text_completions(self) -> CompletionRequest:
        return self._diffusion_request(super().handle_text_completions())

    def _diffusion_request(self, request: CompletionRequest) -> DiffusionRequest:
        stock = {f.name: getattr(request, f.name) for f in dataclasses.fields(CompletionRequest)}
        self._request = DiffusionRequest(
            **stock,
            options=self.decode_options,
            drafts=self.drafts,
            draft_sink=self._send_draft if self.drafts else None,
            connection=self.connection,
        )
        if self.cancel.is_set():
            self._request.cancel_error = self.cancel_error
            self._request.cancel.set()
        return self._request

    # -- completions

    def handle_completion(self, request, stop_words):
        self._stream_started = False
        real = self.response_generator
        self.response_generator = _Guarded(real, self)
        try:
            super().handle_completion(request, stop_words)
        except _Answered:
            pass
        except _DecodeFailed as e:
            self._answer_failure(e.error)
        except _CLIENT_ERRORS:
            self.close_connection = True  # the client left; its decode is cancelled below
        except Exception as e:
            logging.exception("completion failed")
            self._answer_failure(e)
        finally:
            self.response_generator = real
            ctx = getattr(request, "ctx", None)
            if ctx is not None:
                ctx.stop()
            if isinstance(request, DiffusionRequest) and not request.cancel.is_set():
                request.cancel_error = ClientGone("the response has ended")
                request.cancel.set()  # a decode still running for it stops at the next forward

    def _answer_failure(self, error: BaseException) -> None:
        """Answer an error: a status and a JSON body before the response began, an SSE
        error event and [DONE] once a stream has."""
        if isinstance(error, ClientGone):
            self.close_connection = True
            return
        if isinstance(error, RequestError):
            status, param, code = error.status, error.param, error.code
        else:
            status, param, code = 500, None, None
            logging.error(f"request failed: {type(error).__name__}: {error}")
        message = str(error) or type(error).__name__
        try:
            if self._stream_started:
                body = error_body(message, status, param, code)
                self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            else:
                self._headers_buffer = []  # a 200 may be buffered, never sent
                self._send_error(status, message, param=param, code=code)
        except _CLIENT_ERRORS:
            self.close_connection = True

    def generate_response(self, *args, **kwargs) -> dict:
        return json_safe(super().generate_response(*args, **kwargs))

    def _set_stream_headers(self, status_code: int = 200):
        super()._set_stream_headers(status_code)
        self._stream_started = True

    def handle_models_request(self):
        """The served models only (mlx_lm.server lists the whole Hugging Face cache)."""
        ids = list(self.response_generator.model_ids)
        models = [{"id": i, "object": "model", "created": self.created, "owned_by": "operator"} for i in ids]
        path = self.path.split("?", 1)[0]
        parts = path.split("/")
        if len(parts) > 3 and "/".join(parts[3:]):
            wanted = unquote("/".join(parts[3:]))
            key = self.response_generator.served.get(wanted)
            found = [m for m in models if key is not None and m["id"] == self.response_generator.listed[key]]
            if not found:
                return self._send_error(404, f"model {wanted[:200]!r} is not served here",
                                        param="model", code="model_not_found")
            return self._send_json(200, found[0])
        self._send_json(200, {"object": "list", "data": models})

    def handle_protocol(self, body: Any) -> None:
        """POST /v1/diffusion/generate: an InferenceRequest in, an InferenceResponse out;
        a request that breaks the schema gets a 400 carrying the validation message."""
        try:
            response = self.response_generator.run_protocol(body, self.cancel)
        except RequestError as e:
            return self._send_error(e.status, str(e), param=e.param, code=e.code)
        except images.ImageError as e:  # (400, or 413 past the size limits)
            return self._send_error(e.status, str(e), param="images")
        except (ValueError, TypeError) as e:
            return self._send_error(400, str(e))
        except Exception as e:
            logging.exception("protocol request failed")
            return self._send_error(500, f"{type(e).__name__}: {e}")
        self._send_bytes(200, json.dumps(json_safe(response)).encode())

    def _send_draft(self, payload: dict) -> None:
        self.wfile.write(f": draft {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def _send_error(self, status: int, message: str, param: Optional[str] = None,
                    code: Optional[str] = None) -> None:
        self._send_json(status, error_body(message, status, param, code))

    def _send_json(self, status: int, data: dict) -> None:
        self._send_bytes(status, json.dumps(data).encode())

    def _send_bytes(self, status: int, body: bytes) -> None:
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()


# ----------------------------------------------------------------------------- server


class DiffusionHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a listen backlog of 128, a cap on open connections
    (503 beyond it), a watchdog that closes connections whose request line, headers
    or body take longer than `read_timeout`, and graceful shutdown (`drain`)."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True
    block_on_close = False

    def __init__(self, address, handler, read_timeout: Optional[float] = DEFAULT_READ_TIMEOUT,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self.draining = False
        self._lock = threading.Lock()
        self._open = 0
        self._handlers: set = set()
        self._deadlines: Dict[Any, float] = {}
        self._closing: List[Tuple[Any, float]] = []
        self._stopped = threading.Event()
        super().__init__(address, handler)
        self._watchdog = threading.Thread(target=self._watch, name="http-watchdog", daemon=True)
        self._watchdog.start()

    # -- connections

    def process_request(self, request, client_address):
        with self._lock:
            refuse = self.draining or self._open >= self.max_connections
            if not refuse:
                self._open += 1
        if refuse:
            why = "the server is shutting down" if self.draining else (
                f"too many open connections (--max-connections {self.max_connections}); retry later")
            return self._refuse(request, why)
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self._lock:
                self._open -= 1
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open -= 1

    def handle_error(self, request, client_address):
        """A client that left is one line in the log, not a traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, _CLIENT_ERRORS + (BrokenPipeError,)):
            logging.info(f"{client_address[0]}: connection closed ({type(error).__name__})")
            return
        logging.exception(f"error while serving {client_address[0]}")

    def open_connections(self) -> int:
        return self._open

    def _refuse(self, sock, message: str) -> None:
        body = json.dumps(error_body(message, 503)).encode()
        head = (f"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        try:
            sock.setblocking(False)
            sock.send(head + body)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self._lock:  # closed by the watchdog once the client has read it
            if len(self._closing) < 256:
                self._closing.append((sock, time.monotonic() + 1.0))
                return
        self.close_request(sock)

    # -- handlers (DiffusionAPIHandler calls these)

    def register(self, handler) -> None:
        with self._lock:
            self._handlers.add(handler)

    def unregister(self, handler) -> None:
        with self._lock:
            self._handlers.discard(handler)
            self._deadlines.pop(handler, None)

    def arm(self, handler) -> None:
        if self.read_timeout:
            with self._lock:
                self._deadlines[handler] = time.monotonic() + self.read_timeout

    def disarm(self, handler) -> None:
        with self._lock:
            self._deadlines.pop(handler, None)

    def _watch(self) -> None:
        while not self._stopped.wait(0.1):
            now = time.monotonic()
            with self._lock:
                late = [h for h, t in self._deadlines.items() if t < now]
                for h in late:
                    del self._deadlines[h]
                closing, self._closing = self._closing, []
            for h in late:
                logging.info(f"closing {h.client_address[0]}: no complete request within "
                             f"{self.read_timeout:g} s (--read-timeout)")
                _shut(h.connection)
            keep = []
            for sock, deadline in closing:
                try:
                    if now < deadline and sock.recv(65536):
                        keep.append((sock, deadline))
                        continue
                except BlockingIOError:
                    if now < deadline:
                        keep.append((sock, deadline))
                        continue
                except OSError:
                    pass
                self.close_request(sock)
            if keep:
                with self._lock:
                    self._closing.extend(keep)

    def server_close(self):
        self._stopped.set()
        super().server_close()
        with self._lock:
            closing, self._closing = self._closing, []
        for sock, _ in closing:
            self.close_request(sock)

    # -- shutdown

    def drain(self, grace: float, cancel_wait: float = 5.0, hurry: Optional[threading.Event] = None) -> int:
        """Stop accepting; let requests in flight finish within `grace` seconds, then
        cancel the rest (their clients get an error). Call from a thread other than
        serve_forever's, which this stops; setting `hurry` ends the grace period early.
        Returns how many requests were cancelled."""
        self.draining = True
        try:  # refuse connections now, not at serve_forever's next poll
            self.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.shutdown()
        try:
            self.socket.close()
        except OSError:
            pass

        def busy():
            with self._lock:
                handlers = list(self._handlers)
            for h in handlers:
                if not getattr(h, "busy", True):
                    _shut(h.connection)  # idle: nothing to finish
            return [h for h in handlers if getattr(h, "busy", True)]

        deadline = time.monotonic() + max(0.0, grace)
        while busy() and time.monotonic() < deadline and not (hurry is not None and hurry.is_set()):
            time.sleep(0.05)
        remaining = busy()
        for h in remaining:
            cancel = getattr(h, "cancel_request", None)
            if cancel is not None:
                cancel(Cancelled("the server is shutting down; the request was cancelled"))
        if remaining:
            logging.warning(f"shutting down: cancelled {len(remaining)} request(s) still running "
                            f"after {grace:g} s (--shutdown-grace)")
        deadline = time.monotonic() + cancel_wait
        while busy() and time.monotonic() < deadline:
            time.sleep(0.05)
        for h in busy():
            _shut(h.connection)
        return len(remaining)


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# ----------------------------------------------------------------------------- wiring


def make_http_server(
    host: str, port: int, response_generator: ResponseGenerator, handler_class=DiffusionAPIHandler,
    read_timeout: Optional[float] = None, max_connections: Optional[int] = None,
) -> DiffusionHTTPServer:
    """A DiffusionHTTPServer bound to (host, port) (port 0: any free port) whose
    handlers are `handler_class(response_generator, ...)`, as mlx_lm.server builds it.
    The limits default to the generator's flags (--read-timeout, --max-connections)."""
    cli = response_generator.cli_args
    if read_timeout is None:
        read_timeout = getattr(cli, "read_timeout", DEFAULT_READ_TIMEOUT)
    if max_connections is None:
        max_connections = getattr(cli, "max_connections", DEFAULT_MAX_CONNECTIONS)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    server_class = type("DiffusionHTTPServer", (DiffusionHTTPServer,), {"address_family": family})
    handler = functools.partial(
        handler_class, response_generator, system_fingerprint=get_system_fingerprint()
    )
    return server_class(address, handler, read_timeout=read_timeout or None, max_connections=max_connections)


def start(args: argparse.Namespace) -> Tuple[DiffusionHTTPServer, DiffusionResponseGenerator]:
    """Install the mlx-lm hooks, start the generation thread, wait for it to load
    --model (StartupError if it cannot), then bind the HTTP server; call
    `serve_forever()` on the first result. Stop with `httpd.shutdown();
    httpd.server_close(); generator.stop_and_join()` (or `shutdown(httpd, generator)`)."""
    model = getattr(args, "model", None)
    if isinstance(model, str) and model.startswith(("/", ".", "~")) and not Path(model).expanduser().exists():
        raise StartupError(f"cannot load --model {model!r}: no such directory")
    install()
    provider = ModelProvider(args)
    # mlx_lm.server bounds the bytes only when it batches; here always (the KV it holds)
    max_bytes = args.prompt_cache_bytes if getattr(args, "prompt_cache_bytes", None) is not None else 1 << 63
    prompt_cache = LRUPromptCache(args.prompt_cache_size, max_bytes)
    generator = DiffusionResponseGenerator(provider, prompt_cache, compat.decode_defaults(args))
    try:
        generator.wait_loaded()
        if not distributed.is_leader(generator.group):
            return None, generator  # mlx.launch: rank 0 serves, this rank follows it
        try:
            httpd = make_http_server(args.host, args.port, generator)
        except OSError as e:
            raise StartupError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from e
    except BaseException:
        generator.stop_and_join()
        raise
    return httpd, generator


def shutdown(httpd: DiffusionHTTPServer, generator: ResponseGenerator, grace: float,
             hurry: Optional[threading.Event] = None) -> int:
    """Graceful stop (see DiffusionHTTPServer.drain), then the generation thread is
    joined and the model released in it. Returns how many requests were cancelled."""
    cancelled = httpd.drain(grace, hurry=hurry)
    httpd.server_close()
    generator.stop_and_join()
    return cancelled


def restore_nofile(original: Optional[Tuple[int, int]] = None) -> Tuple[int, int]:
    """Undo mlx_lm.utils' RLIMIT_NOFILE of (2048, 4096): back to the limits this
    process started with (known when this module was imported first, else its
    parent's), as far as the process may raise them. Returns the limits now."""
    if original is None:
        original = _NOFILE_AT_IMPORT or _parent_nofile()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if original is None:
        return soft, hard
    want_soft, want_hard = original
    inf = resource.RLIM_INFINITY
    if want_hard == inf or (hard != inf and want_hard > hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, want_hard))
            hard = want_hard
        except (ValueError, OSError):
            pass
    target = want_soft if hard == inf or (want_soft != inf and want_soft <= hard) else hard
    if target == inf or target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _parent_nofile() -> Optional[Tuple[int, int]]:
    try:
        text = Path(f"/proc/{os.getppid()}/limits").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Max open files"):
            values = line.split()[3:5]
            return tuple(resource.RLIM_INFINITY if v == "unlimited" else int(v) for v in values)
    return None


@contextmanager
def _patched(target: Any, **attrs: Any) -> Iterator[None]:
    saved = {name: getattr(target, name) for name in attrs}
    for name, value in attrs.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(target, name, value)


class _FlagRecorder(argparse.ArgumentParser):
    """mlx_lm.server's parser, recording which flags the command line gave; its errors
    (an unknown flag, a bad value) are one line, as the server's own are."""

    given: set = set()

    def add_argument(self, *names, **kwargs):
        if "--model" in names:  # (what --model means here: no --model serves the demo)
            kwargs["help"] = MODEL_HELP
        return super().add_argument(*names, **kwargs)

    def error(self, message: str) -> None:
        _fail(f"{message} (see {PROG} --help)")

    def parse_args(self, args=None, namespace=None):
        saved = [(a, a.default) for a in self._actions]
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        try:
            _FlagRecorder.given = set(vars(super().parse_args(args)))
        finally:
            for a, default in saved:
                a.default = default
        return super().parse_args(args, namespace)


def _server_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("serving limits")
    group.add_argument("--allowed-models", type=lambda x: [m for m in x.split(",") if m], default=[],
                       help="Models a request may name besides --model (comma-separated paths or repo ids); "
                            "any other model is a 404")
    group.add_argument("--allowed-hosts", type=lambda x: [h for h in x.split(",") if h], default=[],
                       help="Host names the server answers under besides IP addresses and localhost "
                            "(comma-separated; DNS rebinding protection)")
    group.add_argument("--max-body-bytes", type=_parse_size, default=DEFAULT_MAX_BODY_BYTES,
                       help="Largest request body (default 10MB; e.g. 1MB, 50MB)")
    group.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT,
                       help="Seconds a client has to send its request line, headers and body (default 30)")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help=f"Open connections at most; more get a 503 (default {DEFAULT_MAX_CONNECTIONS})")
    group.add_argument("--allow-client-chat-templates", action="store_true",
                       help="Let requests replace the chat template (chat_template_kwargs.chat_template)")
    group.add_argument("--no-batch", action="store_true",
                       help="Serve one request at a time instead of continuous batching (the batch size "
                            "is mlx_lm.server's --decode-concurrency)")
    group.add_argument("--max-forwards", type=int, default=DEFAULT_MAX_FORWARDS,
                       help="Model forwards a request may take at most, from its settings (steps x blocks, "
                            f"plus editing passes); a request over it gets a 400 (default {DEFAULT_MAX_FORWARDS})")
    group.add_argument("--shutdown-grace", type=float, default=DEFAULT_SHUTDOWN_GRACE,
                       help="Seconds SIGTERM/SIGINT let requests in flight finish before cancelling them "
                            "(default 30)")
    return parser


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """mlx_lm.server's flags, parsed by mlx_lm.server.main itself (which also sets up
    logging), plus the diffusion defaults and the serving limits. A flag that cannot
    apply, or a bad value, exits 2 with one line on stderr."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = one_line_errors(argparse.ArgumentParser(prog=PROG, add_help=False), prefix=f"{PROG}: error: ")
    compat.add_decode_arguments(ours)
    _server_arguments(ours)
    images.add_server_arguments(ours)
    dargs, rest = ours.parse_known_args(argv)
    if any(a in ("-h", "--help") for a in rest):
        print("Diffusion and serving options (with every mlx_lm.server option below):")
        ours.print_help()
        print()
    captured: List[argparse.Namespace] = []
    recorder = SimpleNamespace(**{**vars(argparse), "ArgumentParser": _FlagRecorder})
    with _patched(
        mlx_server,
        argparse=recorder,
        run=lambda host, port, provider: captured.append(provider.cli_args),
        ModelProvider=lambda cli_args: SimpleNamespace(cli_args=cli_args),
    ), _patched(sys, argv=[PROG, *rest]):
        mlx_server.main()
    args = captured[0]
    given = set(_FlagRecorder.given)
    for name, value in vars(dargs).items():
        setattr(args, name, value)
    for dest, (flag, why) in INAPPLICABLE_FLAGS.items():
        if dest in given:
            _fail(f"{flag} cannot apply: {why}")
    if "allowed_origins" not in given:
        args.allowed_origins = []  # CORS off unless the operator names origins
    try:
        compat.decode_defaults(args)
    except ValueError as e:
        _fail(str(e))
    if args.max_body_bytes is None or args.max_body_bytes < 1:
        _fail("--max-body-bytes must be positive")
    if not args.read_timeout > 0:
        _fail("--read-timeout must be positive")
    if args.max_connections < 1:
        _fail("--max-connections must be at least 1")
    if args.max_forwards < 1:
        _fail("--max-forwards must be at least 1")
    if not args.shutdown_grace >= 0:
        _fail("--shutdown-grace must be >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer warns about model types it does not know
    args = parse_args(argv)
    args.model = model_or_demo(args.model)  # (as the generate and chat CLIs)
    restore_nofile()
    stop = threading.Event()
    signals: List[int] = []

    def on_signal(signum, frame):
        signals.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(args, stop, signals, command_line=argv is None)
    finally:
        _restore_signals(previous)  # (a caller in process, e.g. a test, keeps its Ctrl-C)


def _serve(args, stop: threading.Event, signals: List[int], command_line: bool) -> int:
    """Start, serve until `stop` (a signal) or the accept loop ends, then shut down in order."""
    try:
        httpd, generator = start(args)
    except StartupError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if httpd is None:
        code = distributed_server.follow(generator)
        return _exit_now(code) if command_line else code
    host, port = httpd.server_address[:2]
    logging.info(f"Starting httpd at {host} on port {port}...")
    serving = threading.Thread(target=httpd.serve_forever, name="http-accept", daemon=True)
    serving.start()
    while not stop.wait(0.5):
        if not serving.is_alive():
            break
        if generator.group is not None and not generator.generation_available():
            distributed.fail(generator.group, "the generation loop ended: the distributed group failed "
                                              "(a peer rank died or lost its connection)")
    name = signal.Signals(signals[0]).name if signals else "stop"
    logging.info(f"{name}: no new connections; waiting up to {args.shutdown_grace:g} s for requests in flight")
    hurry = threading.Event()  # a second signal cancels what is left at once
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: hurry.set())
    shutdown(httpd, generator, args.shutdown_grace, hurry)
    serving.join(timeout=5)
    logging.info("stopped")
    if command_line:  # leave without C++ static teardown (see _exit_now)
        _exit_now(0)
    return 0


def _restore_signals(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


def _exit_now(code: int) -> None:
    """End the process once the server has stopped in order (connections drained,
    generation thread joined, model released in it): flush what Python buffers, then
    os._exit, so that no native destructor runs after Python's (MLX's stream threads at
    interpreter teardown ended some exits with SIGABRT, "terminate called without an
    active exception")."""
    try:
        import mlx.core as mx

        mx.synchronize()
    except Exception:
        pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
