"""The scheduler's jobs: a served request (`Job`, built by `prepare_job` from the
request's Decode) and a step-schedule protocol request (`ProtocolJob`). Both show the
scheduler one interface: `group` and `forwards` (its lane), `looked_up` / `prefix` (the
prompt cache), `join(batch)` (its row), `take(step, eos_ids, tokenizer)` (what a step of
its row makes: True once its answer ended), `finish(error)` (its end), `check()` (raises
once it was cancelled or its client left)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import Queue
from typing import Any, Callable, ClassVar, Optional

import mlx.core as mx
from mlx_lm.server import GenerationContext, Response, _format_top_logprobs, _make_logits_processors, _make_sampler

from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.api.decode import Decode
from mlx_lm_diffusion.decoding import ResolvedOptions, RunningBatch, Step, check_greedy
from mlx_lm_diffusion.output.detokenize import answer_detokenizer
from mlx_lm_diffusion.serving.errors import RequestError
from mlx_lm_diffusion.serving.openai_requests import check_sampling_against_vocabulary
from mlx_lm_diffusion.serving.stream_batching import ResponseSender
from model_adapters import TokenCache


@dataclass
class Job:
    """One request in the scheduler: where its responses go and how to make them."""

    rqueue: Queue
    ctx: GenerationContext
    decode: Decode  # the request, resolved once (mlx_lm_diffusion.api.decode)
    check: Callable[[], None]  # raises when the request was cancelled or its client left
    drafts: Optional[Callable[[Step], None]]
    stop_matcher: Any
    top_logprobs: int
    detokenizer: Any
    cache_entry: Optional[Callable[..., None]] = None  # stores prompt + tokens (and their KV) in the prompt cache
    cache_lookup: Optional[Callable[[list], Any]] = None  # the prompt cache's KV of a prompt's prefix
    logprobs: bool = False  # the client asked for each token's log-prob
    prefix: Any = None  # ... this prompt's (a PrefixKV, or None), once looked up
    looked_up: bool = False
    tokens: list = field(default_factory=list)  # the tokens sent
    emitted: int = 0
    ended: bool = False
    row: Any = None
    submitted: float = field(default_factory=time.monotonic)
    sender: Optional[ResponseSender] = None  # the way to rqueue: tokens in mailboxes (stream_batching)
    proposals: int = 0  # its draft frames carry the k most likely tokens per position (the studio's hover)

    def __post_init__(self):
        if self.sender is None:
            self.sender = ResponseSender(self.rqueue)

    @property
    def prompt(self) -> list:
        return self.decode.ids

    @property
    def options(self) -> ResolvedOptions:
        return self.decode.options

    @property
    def forwards(self) -> int:
        """The most forwards its decode can take (options.forward_bound)."""
        return self.decode.forwards

    # The scheduler's group: jobs that may share a running batch (and its adapter). Every
    # completion does, whatever its options (mlx_lm_diffusion.decoding.batch).
    group: ClassVar[tuple] = ("completions",)

    @property
    def keeps_logprobs(self) -> bool:
        """Whether its row keeps each token's log-probs (else none are written or read back)."""
        return self.logprobs or self.top_logprobs > 0

    def join(self, batch: RunningBatch) -> None:
        """Its row in `batch`: from its cached prompt prefix, keeping the log-probs it sends."""
        self.row = batch.add_decode(
            self.decode,
            payload=self,
            prefix=self.prefix,
            keep_logprobs=self.keeps_logprobs,
            proposals=self.proposals,
        )
        self.prefix = None
        self.ctx.prompt_cache_count = self.row.prompt_kv.reused  # (usage's cached_tokens)

    def take(self, step: Step, eos_ids: Any, tokenizer: Any) -> bool:
        """Its row's step: the draft frame, then the newly final tokens, one Response each (as
        stream_generate yields them), handed to its client together (stream_batching).
        Returns whether its answer ended (EOS, max_tokens, a stop word)."""
        if self.drafts is not None and step.ran_forward:
            self.drafts(step)
        P = len(self.prompt)
        top = self.top_logprobs > 0
        values = step.token_logprobs(0, P + self.emitted, P + int(step.final[0])) if self.logprobs and not top else None
        out = []
        try:
            while self.emitted < step.final[0]:
                position = P + self.emitted
                token = int(step.canvas[0, position])
                logprobs = step.logprobs(0, position) if top else None
                self.emitted += 1
                stop = token in eos_ids
                finish = "stop" if stop else ("length" if self.emitted == self.options.max_tokens else None)
                if not stop:
                    self.detokenizer.add_token(token)
                if finish is not None:
                    self.detokenizer.finalize()
                if self.stop_matcher.advance(token):
                    finish = "stop"
                if values is not None:
                    logprob = values.get(position, 0.0)
                else:
                    logprob = logprobs[token].item() if logprobs is not None else 0.0
                ranked = _format_top_logprobs(logprobs, self.top_logprobs, tokenizer) if logprobs is not None else ()
                self.tokens.append(token)
                out.append(Response(self.detokenizer.last_segment, token, logprob, finish, ranked))
                if finish is not None or self.ctx._should_stop:
                    return True
            return False
        finally:
            self.sender.send(out)  # (the tokens made before an error too)

    def finish(self, error: Optional[BaseException]) -> None:
        """Its end: prompt + tokens (and their KV) into the prompt cache when it answered
        (before its client can send its next turn), then the end of its stream (or the error)."""
        self.ended = True
        if error is None and self.cache_entry is not None:
            self.cache_entry(self.prompt + self.tokens, self.row.prompt_kv.export if self.row is not None else None)
        self.sender.put(error)  # None: the end of the stream


@dataclass
class ProtocolJob:
    """A step-schedule protocol request (mlx_lm_diffusion.api.protocol) in the scheduler: its
    row decodes in a batch of protocol rows (each ignoring EOS: options.eos_ids), its steps are
    kept, and `future` gets the InferenceResponse (or the error) once it ends."""

    decode: Any  # protocol.ProtocolDecode
    check: Callable[[], None]  # raises when the request was cancelled
    future: Future = field(default_factory=Future)
    steps: list = field(default_factory=list)
    ended: bool = False
    row: Any = None
    looked_up: bool = True  # (no prompt cache: the protocol's requests neither read nor write it)
    prefix: Any = None
    submitted: float = field(default_factory=time.monotonic)
    forwards: int = 0
    keeps_logprobs = False  # (its response is built from its steps' tokens)

    def join(self, batch: RunningBatch) -> None:
        self.row = batch.add_decode(self.decode.decode, payload=self)  # (the protocol decode's Decode)

    def take(self, step: Step, eos_ids: Any, tokenizer: Any) -> bool:
        """Its steps make its response, at its end; a cancelled request stops at its next step."""
        self.steps.append(step)
        self.check()
        return False

    @property
    def prompt(self) -> list:
        return self.decode.prompt

    @property
    def options(self) -> ResolvedOptions:
        return self.decode.options

    group: ClassVar[tuple] = ("step-schedule protocol",)  # (lanes of their own, beside the completions')

    def finish(self, error: Optional[BaseException]) -> None:
        self.ended = True
        if error is not None:
            self.future.set_exception(error)
            return
        try:
            self.future.set_result(self.decode.response(self.steps))
        except Exception as e:  # noqa: BLE001 (the response could not be built: the request's error)
            self.future.set_exception(e)


def prepare_job(generator: Any, request: tuple) -> Optional[Job]:
    """mlx_lm.server's `_serve_single` up to the decode: tokenize and build the request's
    Decode (the generator's `_tokenize`), context (sent to the client's queue), stop
    words. A request that cannot be served gets its error on its queue (None returned)."""
    rqueue, req, args = request
    try:
        tokenizer = generator.model_provider.tokenizer
        prompt, _, _, initial_state, vision = generator._tokenize(tokenizer, req, args)
        if vision is not None:
            raise ValueError("images are not supported for diffusion models")
        decode = req.decode  # (built by _tokenize: options resolved once, with the sampler and processors)
        stop_sequences, text_sm = generator._make_state_machine(
            generator.model_provider.model_key, tokenizer, args.stop_words
        )
        ctx = GenerationContext(
            has_thinking=tokenizer.has_thinking,
            has_tool_calling=tokenizer.has_tool_calling,
            tool_parser=tokenizer.tool_parser,
            text_sm=text_sm,
            initial_state=initial_state,
            prompt=prompt,
        )
        ctx.prompt_cache_count = 0  # usage's cached_tokens: set when the row starts (the KV it reused)
        sender = ResponseSender(rqueue)  # (drafts and tokens keep their order through it)
        drafts = generator._draft_sender(sender, req) if getattr(req, "drafts", False) else None
        job = Job(
            rqueue,
            ctx,
            decode,
            generator._canceller(req),
            drafts,
            stop_sequences.matcher(),
            args.top_logprobs,
            answer_detokenizer(tokenizer),
            cache_entry=_cache_writer(generator),
            cache_lookup=_cache_reader(generator),
            logprobs=bool(args.logprobs),
            sender=sender,
            proposals=getattr(req, "proposals", 0) if drafts is not None else 0,
        )
    except Exception as e:  # noqa: BLE001 (answered on the request's queue, as mlx_lm.server does)
        rqueue.put(e)
        return None
    rqueue.put(ctx)
    return job


class _NoStops:
    """A stop-word matcher that never matches (mlx_lm.server's interface)."""

    def advance(self, token: int) -> bool:
        return False


def direct_job(decode: Decode, rqueue: Queue, top_logprobs: int = 0) -> Job:
    """A Job for a Decode with no HTTP request around it (the scheduler driven directly:
    its tests): no stop words, drafts or prompt cache, never cancelled. Its Responses come
    on `rqueue` in mailboxes (stream_batching.runs opens them), then None (or the error)."""
    ctx = GenerationContext(False, False, None, None, "normal", list(decode.ids))
    return Job(
        rqueue,
        ctx,
        decode,
        lambda *_: None,
        None,
        _NoStops(),
        top_logprobs,
        answer_detokenizer(decode.tokenizer),
        logprobs=True,
    )


def request_decode(
    model: Any,
    tokenizer: Any,
    prompt: list,
    args: Any,
    options: dict,
    max_forwards: Optional[int] = None,
    vision: Any = None,
) -> Decode:
    """A served request's Decode: its decoding fields (`options`, the server's defaults
    under the request's) with mlx_lm.server's sampler, logits processors and seed from
    `args`. What they reveal (self_spec under a sampler, an id past the vocabulary) is
    the client's request too: a RequestError (400), not a 500."""
    try:
        processors = _make_logits_processors(args)
        decode = compat.check_request(
            model,
            tokenizer,
            prompt,
            args.max_tokens,
            options,
            max_forwards=max_forwards,
            sampler=request_sampler(args, tokenizer),
            logits_processors=processors,
            seed=args.seed,
            vision=vision,
        )
        check_sampling_against_vocabulary(args, decode.adapter.vocab_size)
        if options.get("self_spec"):  # (sampling is in mlx-lm's args, not the fields)
            check_greedy(args.sampling.temperature, bool(processors))
    except (ValueError, TypeError) as e:
        if isinstance(e, RequestError):
            raise
        raise RequestError(str(e)) from e
    return decode


def request_sampler(args: Any, tokenizer: Any) -> Optional[Callable]:
    """mlx_lm.server's sampler; None (the decoder's own argmax) at temperature 0, where
    mlx-lm's is an argmax too, so that a greedy row reads nothing back to check it."""
    return None if args.sampling.temperature == 0 else _make_sampler(args, tokenizer)


_cache_lock = threading.Lock()  # the prompt cache is read on the generation thread, written here


def _cache_writer(generator: Any) -> Callable[..., None]:
    key = generator.model_provider.model_key

    def write(tokens: list, kv_source: Optional[Callable] = None) -> None:
        """`kv_source(tokens)`: the KV of their leading positions (PromptReuse.export)."""
        cache = TokenCache(tokens)
        if kv_source is not None:
            cache.hold_kv(kv_source)
            kv = cache.kv  # (evaluated here: a lazy array would name this thread's stream, which the
            if kv is not None:  # serial path's thread cannot run)
                mx.eval(kv.keys, kv.values)
        with _cache_lock:
            generator.prompt_cache.insert_cache(key, list(tokens), [cache])

    return write


def _cache_reader(generator: Any) -> Callable[[list], Any]:
    """`lookup(prompt)`: the KV of the longest cached prefix of `prompt` (mlx-lm's
    fetch_nearest_cache, as the serial path fetches it), or None. Called on the
    scheduler's thread under the decode lock: reading a cache's KV may run MLX work (an
    export, a trim), which must run on the thread whose stream decodes the rows and not
    overlap a serial decode."""
    key = generator.model_provider.model_key

    def lookup(prompt: list) -> Any:
        with _cache_lock:
            cache, _ = generator.prompt_cache.fetch_nearest_cache(key, list(prompt))
            if not cache or not isinstance(cache[0], TokenCache):
                return None
            return cache[0].kv

    return lookup
