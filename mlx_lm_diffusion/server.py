"""An OpenAI-compatible server for diffusion models, on mlx_lm.server's machinery.

    mlx_lm_diffusion.server --model PATH [--port 8080] [--block-length 32 --steps 32 ...]

Takes every mlx_lm.server flag (parsed by mlx_lm.server itself) plus the diffusion
defaults, and serves /v1/chat/completions, /v1/completions, /v1/models and /health
with mlx_lm.server's request and response shapes. On top of mlx_lm.server:

* per-request decoding fields in the JSON body: block_length, steps, strategy,
  threshold, factor, entropy_bound, alg_temp, editing_threshold, max_post_steps,
  checked before anything is generated;
* `"drafts": true` with `"stream": true` sends the canvas after every forward as an
  SSE comment line (`: draft {"forwards": 3, "committed": 1, "text": "He░░o"}`),
  which OpenAI clients ignore;
* every bad request (malformed JSON, invalid field, a prompt the model cannot
  decode, an unknown model or path) gets a 4xx with a JSON error body;
* POST /v1/diffusion/generate takes a step-schedule InferenceRequest and returns its
  InferenceResponse (`protocol.run_request`); a schema violation is a 400 carrying
  the validation message.

Diffusion models are served one request at a time (their prompt cache, a
`compat.TokenCache`, has no `merge`, so mlx_lm.server does not batch them).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import re
import socket
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import mlx_lm.server as mlx_server
from mlx_lm.server import (
    APIHandler,
    CompletionRequest,
    LRUPromptCache,
    ModelProvider,
    ResponseGenerator,
    get_system_fingerprint,
)

from model_adapters import adapter_for, is_diffusion_model

from . import compat
from .canvas_view import MASK_GLYPH
from .engine import Step
from .install import install
from .protocol import run_request

PROG = "mlx_lm_diffusion.server"
DRAFT_EVENT = "mlx_lm_diffusion.draft"  # tag of draft events on a request's response queue
REQUEST_FIELDS = compat.DECODE_FIELDS
PROTOCOL_PATH = "/v1/diffusion/generate"  # the step-schedule protocol (shared/seeds/004)
POST_PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")
_RULE_FIELDS = ("strategy", "threshold")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name on the Hugging Face Hub


class RequestError(ValueError):
    """A request the server cannot serve as asked: answered with `status` and a JSON body."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class DiffusionRequest(CompletionRequest):
    """mlx_lm.server's request plus its decoding fields and draft channel."""

    options: dict = field(default_factory=dict)
    drafts: bool = False
    draft_sink: Optional[Callable[[dict], None]] = None
    error_status: Optional[int] = None
    ctx: Any = None  # mlx_lm.server's GenerationContext once generation starts


def parse_request_options(body: dict) -> Tuple[dict, bool]:
    """The decoding fields and the `drafts` flag of a JSON body, checked (ValueError)."""
    options = compat.check_decode_fields({k: body[k] for k in REQUEST_FIELDS if k in body})
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


class DiffusionResponseGenerator(ResponseGenerator):
    """mlx_lm.server's generation loop, with decoding options, drafts and up-front checks."""

    def __init__(self, model_provider: ModelProvider, prompt_cache: LRUPromptCache, defaults: Optional[dict] = None):
        self.defaults = dict(defaults or {})  # set before the generation thread starts
        # One decode at a time: the generation thread's requests and the step-schedule
        # protocol's (served on handler threads) take turns on the model.
        self.decode_lock = threading.Lock()
        super().__init__(model_provider, prompt_cache)

    def run_protocol(self, body: Any) -> dict:
        """Decode one step-schedule InferenceRequest on the served model."""
        with self.decode_lock:
            model, tokenizer = self.model_provider.model, self.model_provider.tokenizer
            if model is None:
                raise RequestError("no model is loaded yet; start the server with --model", status=503)
            return run_request(model, tokenizer, body)

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
        """Unknown models get a 404 without unloading the served one (mlx_lm.server
        unloads it first, then tries to download the new one)."""
        name = description.model
        served = self.cli_args.model
        if name == "default_model":
            return
        if served is not None and name in (served, str(Path(served).resolve())):
            description.model = "default_model"  # the same model under another name
            return
        if Path(name).is_dir():
            return
        from huggingface_hub import constants, try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(name, "config.json")
        except Exception:  # not a valid repo id
            cached = None
        downloadable = not constants.HF_HUB_OFFLINE and _REPO_ID.match(name) is not None
        if isinstance(cached, str) or (cached is None and downloadable):
            return  # in the Hugging Face cache, or mlx_lm.server may download it
        raise RequestError(
            f"model {name!r} not found (not a local directory, not in the Hugging Face "
            f"cache); this server serves {served!r}",
            status=404,
        )

    # -- generation thread

    def _options(self, request) -> dict:
        return merge_options(self.defaults, getattr(request, "options", {}))

    def _tokenize(self, tokenizer, request, args):
        try:
            result = super()._tokenize(tokenizer, request, args)
        except Exception as e:
            raise RequestError(f"cannot build a prompt from this request: {e}") from e
        model = self.model_provider.model
        if is_diffusion_model(model):
            try:
                compat.check_request(model, tokenizer, result[0], args.max_tokens, self._options(request))
            except (ValueError, TypeError) as e:
                raise RequestError(str(e)) from e
        return result

    def _serve_single(self, request, stream):
        rqueue, req, _ = request
        options = self._options(req)
        if getattr(req, "drafts", False) and is_diffusion_model(self.model_provider.model):
            options["draft_callback"] = self._draft_sender(rqueue)
        with self.decode_lock, compat.request_options(**options):
            super()._serve_single(request, stream)

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


class DiffusionAPIHandler(APIHandler):
    """mlx_lm.server's handler with decoding fields, drafts and JSON errors everywhere."""

    def do_POST(self):
        self._request = None
        if self.path == PROTOCOL_PATH:
            return self.handle_protocol()
        if self.path not in POST_PATHS:
            return self._send_error(404, f"no such endpoint: POST {self.path}")
        super().do_POST()

    def do_GET(self):
        self._request = None
        if not (self.path.startswith("/v1/models") or self.path == "/health"):
            return self._send_error(404, f"no such endpoint: GET {self.path}")
        super().do_GET()

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        self.decode_options, self.drafts = parse_request_options(self.body)
        if self.drafts and not self.stream:
            raise ValueError("drafts are sent as SSE comments of a stream; set stream to true")

    def handle_chat_completions(self) -> CompletionRequest:
        return self._diffusion_request(super().handle_chat_completions())

    def handle_text_completions(self) -> CompletionRequest:
        return self._diffusion_request(super().handle_text_completions())

    def _diffusion_request(self, request: CompletionRequest) -> DiffusionRequest:
        stock = {f.name: getattr(request, f.name) for f in dataclasses.fields(CompletionRequest)}
        self._request = DiffusionRequest(
            **stock,
            options=self.decode_options,
            drafts=self.drafts,
            draft_sink=self._send_draft if self.drafts else None,
        )
        return self._request

    def handle_completion(self, request, stop_words):
        try:
            super().handle_completion(request, stop_words)
        finally:  # also when the client left before the first byte was written
            ctx = getattr(request, "ctx", None)
            if ctx is not None:
                ctx.stop()

    def _set_completion_headers(self, status_code: int = 200):
        if status_code == 404:  # mlx_lm.server answers every failed generate() with 404
            status_code = getattr(getattr(self, "_request", None), "error_status", None) or 404
        super()._set_completion_headers(status_code)

    def handle_models_request(self):
        """mlx_lm.server's listing, which sends its 200 before scanning the Hugging Face
        cache and fails when that folder is missing: then only the served model."""
        from huggingface_hub import scan_cache_dir

        try:
            scan_cache_dir()
        except Exception as e:
            logging.warning(f"/v1/models lists only the served model: {e}")
            models = []
            served = self.response_generator.cli_args.model
            if served is not None and Path(served).exists():
                models.append({"id": str(Path(served).resolve()), "object": "model", "created": self.created})
            return self._send_json(200, {"object": "list", "data": models})
        super().handle_models_request()

    def handle_protocol(self) -> None:
        """POST /v1/diffusion/generate: an InferenceRequest in, an InferenceResponse out;
        a request that breaks the schema gets a 400 carrying the validation message."""
        try:
            length = int(self.headers.get("Content-Length", ""))
            body = json.loads(self.rfile.read(length).decode())
        except (ValueError, UnicodeDecodeError) as e:
            return self._send_error(400, f"the body must be a JSON InferenceRequest: {e}")
        try:
            response = self.response_generator.run_protocol(body)
        except RequestError as e:
            return self._send_error(e.status, str(e))
        except ValueError as e:
            return self._send_error(400, str(e))
        self._send_json(200, response)

    def _send_draft(self, payload: dict) -> None:
        self.wfile.write(f": draft {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def _send_error(self, status: int, message: str) -> None:
        self._send_json(status, {"error": message})

    def _send_json(self, status: int, data: dict) -> None:
        body = json.dumps(data).encode()
        self._set_completion_headers(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# ----------------------------------------------------------------------------- wiring


def make_http_server(
    host: str, port: int, response_generator: ResponseGenerator, handler_class=DiffusionAPIHandler
) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer bound to (host, port) (port 0: any free port) whose
    handlers are `handler_class(response_generator, ...)`, as mlx_lm.server builds it."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    server_class = type("DiffusionHTTPServer", (ThreadingHTTPServer,), {"address_family": family})
    handler = functools.partial(
        handler_class, response_generator, system_fingerprint=get_system_fingerprint()
    )
    return server_class(address, handler)


def start(args: argparse.Namespace) -> Tuple[ThreadingHTTPServer, DiffusionResponseGenerator]:
    """Install the mlx-lm hooks, start the generation thread (it loads --model) and bind
    the HTTP server; call `serve_forever()` on the first result. Stop with
    `httpd.shutdown(); httpd.server_close(); generator.stop_and_join()`."""
    install()
    provider = ModelProvider(args)
    prompt_cache = LRUPromptCache(args.prompt_cache_size)
    generator = DiffusionResponseGenerator(provider, prompt_cache, compat.decode_defaults(args))
    try:
        httpd = make_http_server(args.host, args.port, generator)
    except BaseException:
        generator.stop_and_join()
        raise
    return httpd, generator


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


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """mlx_lm.server's flags, parsed by mlx_lm.server.main itself (which also sets up
    logging), plus the diffusion defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    diffusion = compat.add_decode_arguments(argparse.ArgumentParser(prog=PROG, add_help=False))
    dargs, rest = diffusion.parse_known_args(argv)
    if any(a in ("-h", "--help") for a in rest):
        print("Diffusion options (with every mlx_lm.server option below):")
        diffusion.print_help()
        print()
    captured: List[argparse.Namespace] = []
    with _patched(
        mlx_server,
        run=lambda host, port, provider: captured.append(provider.cli_args),
        ModelProvider=lambda cli_args: SimpleNamespace(cli_args=cli_args),
    ), _patched(sys, argv=[PROG, *rest]):
        mlx_server.main()
    args = captured[0]
    for name, value in vars(dargs).items():
        setattr(args, name, value)
    try:
        compat.decode_defaults(args)
    except ValueError as e:
        diffusion.error(str(e))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer warns about model types it does not know
    args = parse_args(argv)
    httpd, generator = start(args)
    host, port = httpd.server_address[:2]
    logging.info(f"Starting httpd at {host} on port {port}...")
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        generator.stop_and_join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
