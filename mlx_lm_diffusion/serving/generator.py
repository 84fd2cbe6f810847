"""The generation side of the server: mlx_lm.server's ResponseGenerator with decoding
options, drafts, the served-model allow-list, continuous batching and the protocol."""

from __future__ import annotations

import logging
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx_lm.server as mlx_server
from mlx_lm.server import (
    LRUPromptCache,
    ModelProvider,
    ResponseGenerator,
)

from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.api.protocol import prepare_request, run_request, validate_request
from mlx_lm_diffusion.decoding import CachedTokensTap, Step, cache_occupancy, release_thread_streams, thread_streams
from mlx_lm_diffusion.media import images
from mlx_lm_diffusion.output import request_constraints
from mlx_lm_diffusion.parallel import distributed
from mlx_lm_diffusion.serving import distributed_server, memory, openai_requests, peers, template_sandbox
from mlx_lm_diffusion.serving.errors import Cancelled, ClientGone, RequestError, StartupError
from mlx_lm_diffusion.serving.jobs import prepare_job, request_decode
from mlx_lm_diffusion.serving.openai_requests import (
    DiffusionRequest,
    check_sampling_against_vocabulary,
    merge_options,
)
from mlx_lm_diffusion.serving.responses import draft_frame
from mlx_lm_diffusion.serving.scheduler import Scheduler
from mlx_lm_diffusion.serving.turns import TurnLock
from model_adapters import adapter_for, is_diffusion_model

DRAFT_EVENT = "mlx_lm_diffusion.draft"  # tag of draft events on a request's response queue
# Forwards a request may cost at most (--max-forwards): above any reference decode of a
# few thousand tokens, below what would hold the model for hours ("steps": 10**5).
DEFAULT_MAX_FORWARDS = 16384
# A request whose decode could take more forwards than this is long: long rows may hold
# at most half of a batch (scheduler), so that a short request never waits for them all.
# 256: a default chat request (256 tokens, one per forward) is not long; one at twice it is.
DEFAULT_LONG_FORWARDS = 256


def _model_names(name: str) -> List[str]:
    """The strings a client may send for a model the operator named: the name as
    given, and for a local directory its absolute and resolved paths."""
    names = [name]
    path = Path(name).expanduser()
    if path.exists():
        names += [str(path.absolute()), str(path.resolve())]
    return names


def _model_id(name: str) -> str:
    """The id /v1/models lists for a model the operator named: a local directory's own name
    (a client can send it back; the server's paths stay its own), else the name as given."""
    path = Path(name).expanduser()
    return path.resolve().name if path.exists() else name


def scrubbed(error: BaseException, tokenizer: Any) -> str:
    """An error's message as a client may read it: a tokenizer's repr (it names the
    checkpoint's absolute path and its settings) becomes "the tokenizer", and any path of the
    served model's directory its base name."""
    text = str(error)
    for tok in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        if tok is not None:
            text = text.replace(repr(tok), "the tokenizer")
    text = re.sub(r"\b[A-Za-z_]\w*\(name_or_path=.*", "the tokenizer", text)  # (a repr cut or nested)
    path = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "name_or_path", None)
    if isinstance(path, str) and path.startswith("/"):
        text = text.replace(path, Path(path).name)
    return text


class DiffusionResponseGenerator(distributed_server.DistributedGeneration, ResponseGenerator):
    """mlx_lm.server's generation loop, with decoding options, drafts, up-front checks,
    the served-model allow-list and per-step cancellation."""

    def __init__(self, model_provider: ModelProvider, prompt_cache: LRUPromptCache, defaults: Optional[dict] = None):
        self.defaults = dict(defaults or {})  # set before the generation thread starts
        # One decode at a time: the generation thread's requests and the step-schedule
        # protocol's (served on handler threads) take turns on the model.
        self.out_of_memory = False  # (the last generation ran out of memory: note_outcome)
        self.decode_lock = TurnLock()  # (the batch and lone decodes take turns: serving.turns)
        # The one thread the step-schedule protocol's MLX work runs on (run_protocol)
        self.protocol_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion-protocol")
        # The one thread that decodes, one at a time, the requests the batch cannot take
        # (images, a suffix, a response_format): beside the batch, not on the generation
        # thread, which would otherwise hold every later request until the decode ends
        self.lone_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffusion-lone")
        self.load_error: Optional[BaseException] = None
        self.loaded = threading.Event()
        cli = model_provider.cli_args
        self.served: Dict[str, str] = {}  # what a client may send -> what mlx_lm.server loads
        self.listed: Dict[str, str] = {}  # what mlx_lm.server loads -> the id /v1/models lists
        if cli.model is not None:
            self.listed["default_model"] = getattr(cli, "served_model_name", None) or _model_id(cli.model)
            for name in ["default_model", *_model_names(cli.model)]:
                self.served[name] = "default_model"
        for extra in getattr(cli, "allowed_models", None) or []:
            taken = set(self.listed.values())
            self.listed.setdefault(extra, _model_id(extra) if _model_id(extra) not in taken else extra)
            for name in _model_names(extra):
                self.served.setdefault(name, extra)
        for key, listed in self.listed.items():
            self.served.setdefault(listed, key)
        self.model_ids: List[str] = list(dict.fromkeys(self.listed.values()))
        # Continuous batching (mlx_lm_diffusion.serving.scheduler), started once the model loads;
        # None with --no-batch: one request at a time, as before.
        self.scheduler: Optional[Scheduler] = None
        super().__init__(model_provider, prompt_cache)

    def wait_loaded(self, timeout: Optional[float] = None) -> None:
        """Block until --model is loaded; raise StartupError if it cannot be."""
        if not self.loaded.wait(timeout):
            raise StartupError("the model did not load in time")
        if isinstance(self.load_error, StartupError):
            raise self.load_error
        if self.load_error is not None:
            message = str(self.load_error).strip().splitlines() or [type(self.load_error).__name__]
            raise StartupError(f"cannot load --model {self.cli_args.model!r}: {message[0]}")

    def run_protocol(self, body: Any, cancel: Optional[threading.Event] = None) -> dict:
        """Decode one step-schedule InferenceRequest on the served model: a row of the
        scheduler's batches when batching (a batch of protocol rows), else alone.

        The body is checked against the schema here, on the handler thread, before any
        lock the decoder needs (a large body's check stalls nobody). Everything that runs
        MLX runs on one thread of the server's (`protocol_worker`), never on the handler's:
        MLX keeps a stream, and a native thread, for every thread that evaluates."""
        validate_request(body)
        if "seed" not in body:  # its own key, as for completions
            body = {**body, "seed": openai_requests.request_seed()}
        scheduler = self.scheduler
        # (DiffusionGemma's committing uniform canvas and a request's images decode alone)
        alone = (
            bool(body.get("images"))
            or getattr(scheduler, "model", None) is not None
            and getattr(scheduler.model, "has_vision", None) is not None
        )
        if scheduler is not None and self.model_provider.model is scheduler.model and not alone:
            decode = self.protocol_worker.submit(self._prepare_protocol, scheduler, body, cancel).result()
            return scheduler.submit_protocol(decode, lambda: self._check_cancel(cancel)).result()
        return self.protocol_worker.submit(self._run_protocol_alone, body, cancel).result()

    def _prepare_protocol(self, scheduler: Scheduler, body: dict, cancel: Optional[threading.Event]):
        with self.decode_lock:  # (resolved as alone; the decode is the scheduler's)
            self._check_cancel(cancel)
            return prepare_request(
                scheduler.model, scheduler.tokenizer, body, max_forwards=self.max_forwards, validated=True
            )

    def _run_protocol_alone(self, body: dict, cancel: Optional[threading.Event]) -> dict:
        with self.decode_lock:
            self._check_cancel(cancel)
            model, tokenizer = self.model_provider.model, self.model_provider.tokenizer
            if model is None:
                raise RequestError("no model is loaded yet; start the server with --model", status=503)
            if self.group is not None:  # (decoded on rank 0 alone)
                raise RequestError("the step-schedule protocol is not served under mlx.launch", status=501)
            pictures = bool(body.get("images"))  # the `images` extension
            return run_request(
                model,
                tokenizer,
                body,
                max_forwards=self.max_forwards,
                on_step=lambda step: self._check_cancel(cancel),
                processor=images.served_processor(self.model_provider) if pictures else None,
                image_policy=images.server_policy(self.cli_args),
                validated=True,
            )

    def longest_token_chars(self) -> Optional[int]:
        """The most characters one vocabulary entry spells (its string in the tokenizer's
        vocabulary: a byte-level entry has a character per byte, at least its text's
        characters), so a text has at least len(text) / this many tokens. Cached per tokenizer."""
        tokenizer = self.model_provider.tokenizer
        cache = self.__dict__.setdefault("_longest", {})
        key = id(tokenizer)
        if key not in cache:
            hf = getattr(tokenizer, "_tokenizer", tokenizer)
            try:
                cache[key] = max((len(t) for t in hf.get_vocab()), default=0) or None
            except Exception:  # noqa: BLE001 (a processor or a tokenizer without a vocabulary: no bound)
                cache[key] = None
        return cache[key]

    def textless(self, token: int) -> bool:
        """Whether `token` has no text of its own (a canvas's padding: the demo's <blank>;
        special tokens such as EOS): usage does not count it. Cached per tokenizer."""
        tokenizer = self.model_provider.tokenizer
        cache = self.__dict__.setdefault("_textless", {}).setdefault(id(tokenizer), {})
        if token not in cache:
            cache[token] = tokenizer.decode([int(token)]) == ""
        return cache[token]

    def health_problem(self) -> Optional[str]:
        """Why generation cannot run now (GET /health answers 503 with it), or None. MLX
        writes the kernels it compiles under the temporary directory: where it cannot,
        every generation fails."""
        if self.load_error is not None:
            return "the model could not be loaded"
        if self.out_of_memory:
            return "the last generation ran out of memory (ready again once one completes)"
        short = memory.shortage()
        if short is not None:
            return short
        directory = getattr(self.cli_args, "kernel_cache_dir", None) or tempfile.gettempdir()
        try:
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".health-"):
                pass
        except OSError as e:
            logging.error("kernel cache directory %s cannot be written: %s", directory, e)
            return "the kernel cache directory cannot be written (see the server's log)"
        return None

    def note_outcome(self, error: Optional[BaseException]) -> None:
        """A generation ended, with `error` or None: one that ran out of memory makes the
        server not ready (/health 503) until a later one completes."""
        if error is None:
            self.out_of_memory = False
        elif memory.is_out_of_memory(error):
            self.out_of_memory = True

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
            ctx, responses = super().generate(request, generation_args, self._progress(request, progress_callback))
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

    def takes_images(self, name: Any) -> bool:
        """Whether the served model a request names has a vision tower, decided before any
        image of the request is decoded: an unknown name is the 404 it will be anyway; a
        model other than the one loaded is not known yet (it loads at its turn)."""
        if not (isinstance(name, str) and name in self.served):
            raise self._not_served(name)
        key = self.served[name]
        path = self.cli_args.model if key == "default_model" else key
        loaded = getattr(self.model_provider, "model_key", None)
        if loaded is None or loaded[0] != path:
            return True
        return bool(getattr(self.model_provider.model, "has_vision", False))

    def _check_model(self, description) -> None:
        """Only the models the operator named are served: any other name is a 404,
        decided on the string alone (no filesystem, no Hub, the served model stays)."""
        name = description.model
        if not (isinstance(name, str) and name in self.served):
            raise self._not_served(name)
        description.model = self.served[name]

    def _not_served(self, name: Any) -> RequestError:
        served = ", ".join(self.model_ids) or "nothing"
        return RequestError(
            f"model {name!r} is not served here; this server serves: {served}",
            status=404,
            param="model",
            code="model_not_found",
        )

    # -- generation thread

    def _generate(self):
        with thread_streams():  # (the generation thread's MLX streams end with it: interpreter_exit)
            self._load_and_generate()

    def _load_and_generate(self):
        try:
            self.model_provider.load_default()
        except Exception as e:  # reported by wait_loaded; the thread ends
            self.load_error = e
            self.model_provider.reset()
            self.loaded.set()
            return
        try:
            self._start_scheduler()
        except Exception as e:  # noqa: BLE001 (its thread cannot start: out of memory)
            self.load_error = StartupError(f"cannot start the decoding thread: {e}")
            self.model_provider.reset()
            self.loaded.set()
            return
        self.loaded.set()
        super()._generate()  # load_default again: the same model key, no reload

    def _start_scheduler(self) -> None:
        model, cli = self.model_provider.model, self.cli_args
        # (under mlx.launch every rank follows mlx_lm.server's own loop, request by request:
        # a batch's rows would be stepped on rank 0 alone)
        if is_diffusion_model(model) and not getattr(cli, "no_batch", False) and self.group is None:
            self.scheduler = Scheduler(
                model,
                self.model_provider.tokenizer,
                self.decode_lock,
                getattr(cli, "decode_concurrency", 32),
                getattr(cli, "long_request_forwards", DEFAULT_LONG_FORWARDS),
            )

    def stop_and_join(self):
        if self.scheduler is not None:
            self.scheduler.stop()
        self.protocol_worker.submit(release_thread_streams)  # (their one thread's last task: interpreter_exit)
        self.protocol_worker.shutdown(wait=True, cancel_futures=True)
        self.lone_worker.submit(release_thread_streams)
        self.lone_worker.shutdown(wait=True)  # (a queued decode still answers: cancelled at its first check)
        super().stop_and_join()

    def _batched(self, request) -> bool:
        """Whether the scheduler decodes this request (the served diffusion model, batching
        on). Images, an infill's suffix and a response_format take the serial path, whose
        decode applies them (a batch row knows none of them yet)."""
        options = self._options(request[1])
        return (
            self.scheduler is not None
            and self.model_provider.model is self.scheduler.model
            and not any(mlx_server._image_parts(getattr(request[1], "messages", None) or []))
            and all(options.get(name) is None for name in request_constraints.REQUEST_FIELDS)
        )

    def _options(self, request) -> dict:
        return merge_options(self.defaults, getattr(request, "options", {}))

    def _tokenize(self, tokenizer, request, args):
        try:
            ids = getattr(request, "image_prompt", None)
            if ids is None:
                ids = getattr(request, "prompt_ids", None)
            if ids is None:
                ids = self._client_template_prompt(tokenizer, request, args)
            result = (
                (ids, [ids], ["assistant"], "normal", None)
                if ids is not None
                else super()._tokenize(tokenizer, request, args)
            )
        except template_sandbox.RenderersBusy as e:
            raise RequestError(str(e), status=503, param="chat_template_kwargs", code="busy") from e
        except template_sandbox.TemplateError as e:
            raise RequestError(str(e), param="chat_template_kwargs") from e
        except Exception as e:
            raise RequestError(f"cannot build a prompt from this request: {scrubbed(e, tokenizer)}") from e
        model = self.model_provider.model
        if not is_diffusion_model(model):  # mlx-lm's own decode would ignore them
            check_sampling_against_vocabulary(args, adapter_for(model, tokenizer).vocab_size)
            try:
                request_constraints.refuse_unserved(self._options(request))
            except ValueError as e:
                raise RequestError(str(e)) from e
            return result
        # The request's Decode, built once here on its own path: the batch's row takes it
        # (prepare_job: request.decode), the serial decode's stream_generate is handed it
        decode = request_decode(
            model,
            tokenizer,
            result[0],
            args,
            self._options(request),
            self.max_forwards,
            vision=getattr(request, "vision_inputs", None),
        )
        request.decode = decode
        compat.hand_decode(decode)
        return result

    def _client_template_prompt(self, tokenizer, request, args) -> Optional[List[int]]:
        """A chat's prompt under the client's own chat template (allowed by the operator),
        or None when the request brings no template (see `client_template_prompt`)."""
        return self.client_template_prompt(tokenizer, request, args.chat_template_kwargs)

    def client_template_prompt(self, tokenizer, request, chat_template_kwargs) -> Optional[List[int]]:
        """The prompt ids of a chat under the client's own chat template, rendered in a
        child process with a memory and a time cap (serving.template_sandbox); None when
        the request brings no template. The handler renders it on its own thread (a
        render may take seconds: the generation thread must not wait for it)."""
        kwargs = dict(getattr(self.model_provider.cli_args, "chat_template_args", None) or {})
        kwargs.update(chat_template_kwargs or {})
        template = (chat_template_kwargs or {}).get("chat_template")
        if request.request_type != "chat" or template is None:
            return None
        messages = [dict(m) for m in request.messages]
        mlx_server.process_message_content(messages, keep_images=False)
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        specials = {k: v for k, v in getattr(hf, "special_tokens_map", {}).items() if isinstance(v, str)}
        text = template_sandbox.render(kwargs.pop("chat_template"), messages, request.tools, kwargs, specials)
        return tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def _canceller(req) -> Callable[[], None]:
        """Raises when the request was cancelled or its client left."""
        cancel = getattr(req, "cancel", None)
        sock = getattr(req, "connection", None)

        probe = getattr(req, "peer_probe", None)
        probed = []

        def check(peer_closed: Any = None) -> None:
            """`peer_closed`: the client's state (peers.closed), when the caller polled it already."""
            if cancel is not None and cancel.is_set():
                raise req.cancel_error or Cancelled()
            state = (peers.closed([sock])[0] if peer_closed is None else peer_closed) if sock is not None else False
            if state is True:
                raise ClientGone("the client closed its connection")
            if state == peers.HALF and probe is not None and not probed:
                probed.append(True)  # (once: a client that closed entirely answers it with a reset)
                try:
                    probe()
                except OSError:
                    raise ClientGone("the client closed its connection") from None

        check.socket = sock  # (a running batch polls every row's socket at once: mlx_lm_diffusion.serving.peers)
        return check

    def _serve_single(self, request, stream):
        if self._batched(request):  # joins a running batch at its next step; returns at once
            job = prepare_job(self, request)
            if job is not None:
                self.scheduler.submit(job)
            return
        if self._lone_beside_batch(request):  # (the generation thread goes on to the next request)
            self.lone_worker.submit(self._serve_lone, request)
            return
        self._serve_alone(request, stream)

    def _lone_beside_batch(self, request) -> bool:
        """Whether a request the batch cannot take is decoded on the lone-decode thread,
        taking turns with the batch (serving.turns): the served model when it is the only
        one (a request for another model would load it on the generation thread meanwhile)."""
        return (
            self.scheduler is not None
            and self.model_provider.model is self.scheduler.model
            and not getattr(self.cli_args, "allowed_models", None)
        )

    def _serve_lone(self, request) -> None:
        try:
            self._serve_alone(request, mx.default_stream(mx.default_device()))
        except Exception as e:  # noqa: BLE001 (its client gets the error; the thread serves the next)
            request[0].put(e)

    def _serve_alone(self, request, stream):
        rqueue, req, _ = request
        options = self._options(req)
        check = self.agreed(self._canceller(req))  # (mlx.launch: rank 0 decides for every rank)
        if is_diffusion_model(self.model_provider.model):
            # usage's cached_tokens: the prompt positions whose KV the decode reused
            tap = CachedTokensTap(rqueue)
            request = (tap, *request[1:])
            options["cached_tokens_callback"] = tap.report
            drafts = self._draft_sender(rqueue, req) if getattr(req, "drafts", False) else None

            def on_step(step: Step) -> None:
                check()  # a cancelled request or a gone client stops at the next forward
                if drafts is not None:
                    drafts(step)
                self.decode_lock.pass_turn()  # (the batch's rows step between this decode's forwards)

            options["draft_callback"] = on_step
            if getattr(req, "images", None):
                try:
                    req.vision_inputs = self._image_prompt(req, request[2])  # (for its Decode: _tokenize)
                except (RequestError, ValueError) as e:
                    rqueue.put(
                        e if isinstance(e, RequestError) else RequestError(str(e), status=getattr(e, "status", 400))
                    )
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
            self.model_provider, self.model_provider.tokenizer, req.messages, req.images, template_kwargs
        )
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

    def _draft_sender(self, rqueue, req) -> Callable[[Step], None]:
        """The request's draft frames onto `rqueue` (its Decode, `req.decode`, is built by
        the time the first step lands: its adapter names the mask)."""
        tokenizer = self.model_provider.tokenizer
        texts: dict = {}  # (each token id decoded once per request)

        def send(step: Step) -> None:
            rqueue.put((DRAFT_EVENT, draft_frame(tokenizer, step, req.decode.adapter.mask_id, texts)))

        return send
