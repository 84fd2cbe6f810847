"""Continuous batching for the server: one running batch per compatible group.

mlx_lm.server's generation thread hands each diffusion request to `Scheduler.submit`
(the server's `_serve_single` hook) instead of decoding it there; the scheduler's own
thread keeps one `RunningBatch` per group of requests that can share a forward (the
same family options: `batch.family_key`; generic options such as block_length, steps,
max_tokens, sampler or seed differ freely per row). Each turn:

1. queued requests join their group's batch (FIFO, at most `max_rows` rows a batch:
   `--decode-concurrency`); a request whose batch is full waits for a row to leave, and
   a long request (one that could take more than `long_forwards` forwards:
   `--long-request-forwards`) waits while long rows hold half of its batch, so that
   requests at the forward bound cannot take every row: a short one behind them is
   admitted at once (a waiting job never blocks a later one that fits); and each 4x
   heavier class of long requests may hold half the rows of the class below it, so a
   long request is not stuck behind much longer ones either (`_long_room`);
2. the lane that has used the least decoding time steps next. A group's rows are split
   into lanes (one batch each) by the size of their forward bound (within a factor of 4
   of each other: `lane_of`); a lane that joins starts one step's time (the longest of
   the others' last steps) ahead of the least served, so it runs at once, builds up no
   credit for the time it was idle, and delays the others by at most one such step. A
   short request therefore runs at the pace of its own small forwards, not of the
   500-position canvases beside it (a short answer behind 32 requests at the forward
   bound waited 55-70 s when they shared every step). The lane drops the rows whose
   client left or whose request was cancelled, then runs one step (one model forward
   for all its rows) under the server's decode lock, which the step-schedule protocol
   endpoint and the serial path also take;
3. every row's new final tokens go to its client as mlx_lm.server `Response`s (its own
   detokenizer, stop words, logprobs); a row that finished (EOS, max_tokens, a stop
   word) leaves at once and its client gets the end of its stream.

A row decodes exactly as the request alone would (mlx_lm_diffusion.decoding.batch). The prompt
cache is used as the serial path uses it (mlx_lm_diffusion.api.compat, kv_reuse): a request
takes the nearest cached prefix when it is prepared; for the families whose prompt KV is
exact its row starts from that prefix's keys and values (usage's cached_tokens: the
positions it took), and a request that ends leaves prompt + tokens sent, with the KV its
row vouches for, in the cache before its client hears the end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import Queue
from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.server import GenerationContext, Response, _format_top_logprobs, _make_logits_processors, _make_sampler

from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.api.decode import Decode
from mlx_lm_diffusion.decoding.batch import RowEvent, RunningBatch, family_key
from mlx_lm_diffusion.decoding.decoders.speculative import check_greedy
from mlx_lm_diffusion.decoding.engine import Step
from mlx_lm_diffusion.decoding.interpreter_exit import thread_streams
from mlx_lm_diffusion.decoding.options import ResolvedOptions, forward_bound
from mlx_lm_diffusion.output.detokenize import answer_detokenizer
from mlx_lm_diffusion.serving import peers
from mlx_lm_diffusion.serving.errors import Cancelled, ClientGone, RequestError
from mlx_lm_diffusion.serving.openai_requests import check_sampling_against_vocabulary
from mlx_lm_diffusion.serving.stream_batching import ResponseSender
from model_adapters.runtime.prompt_cache import TokenCache

MAX_ADAPTERS = 16  # groups whose adapter (and the forwards it compiled) the scheduler keeps


def lane_of(job: Any) -> tuple:
    """(group, size class): jobs whose forward bounds are within a factor of 4 of each
    other share a lane (a batch); a short request never steps with canvases 100 times
    its own."""
    return job.group, max(0, (max(job.forwards, 1) - 1).bit_length() + 1) // 2


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

    @property
    def group(self) -> tuple:
        return family_key(self.options)

    @property
    def keeps_logprobs(self) -> bool:
        """Whether its row keeps each token's log-probs (else none are written or read back)."""
        return self.logprobs or self.top_logprobs > 0


@dataclass
class ProtocolJob:
    """A step-schedule protocol request (mlx_lm_diffusion.api.protocol) in the scheduler: its
    row decodes in a batch of protocol rows (their adapter ignores EOS), its steps are
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

    @property
    def prompt(self) -> list:
        return self.decode.prompt

    @property
    def options(self) -> ResolvedOptions:
        return self.decode.options

    @property
    def group(self) -> tuple:
        return ("step-schedule protocol", family_key(self.options))

    def end(self, error: Optional[BaseException]) -> None:
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


class Scheduler:
    """Runs the server's diffusion requests in running batches on its own thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        decode_lock: threading.Lock,
        max_rows: int = 32,
        long_forwards: Optional[int] = None,
    ):
        if max_rows < 1:
            raise ValueError(f"--decode-concurrency must be at least 1, got {max_rows}")
        self.model, self.tokenizer = model, tokenizer
        self.decode_lock = decode_lock
        self.max_rows = max_rows
        self.long_forwards = long_forwards  # None: no request counts as long
        self.max_long_rows = max(1, max_rows // 2)
        self.queued: deque = deque()  # jobs not in a batch yet, FIFO
        self.batches: dict = {}  # lane (group, size class: lane_of) -> RunningBatch
        self.turns: deque = deque()  # lanes with rows, in the order they joined
        self.used: dict = {}  # lane -> seconds of steps it has run (the fair share's measure)
        self.last: dict = {}  # lane -> seconds its latest step took
        self.peak_rows = 0  # the most rows decoded at once since the start
        self.adapters: OrderedDict = OrderedDict()  # group -> its adapter, kept across its batches (adapter)
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="diffusion-scheduler", daemon=True)
        self._thread.start()

    # -- any thread

    def submit(self, job: Job) -> None:
        with self._cond:
            self.queued.append(job)
            self._cond.notify()

    def submit_protocol(self, decode: Any, check: Callable[[], None]) -> Future:
        """A step-schedule protocol request (protocol.prepare_request's decode): its
        InferenceResponse arrives on the returned future."""
        job = ProtocolJob(decode, check, forwards=forward_bound(decode.options, decode.adapter, len(decode.prompt)))
        self.submit(job)
        return job.future

    def stats(self) -> dict:
        """Running rows and queued requests (what /v1/stats reports)."""
        with self._cond:
            running = sum(len(b) for b in self.batches.values())
            return {
                "running_rows": running,
                "queued_requests": len(self.queued),
                "groups": len(self.batches),
                "max_rows": self.max_rows,
                "peak_rows": self.peak_rows,
            }

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout)

    # -- the scheduler's thread

    def _run(self) -> None:
        with thread_streams():  # (this thread's MLX streams end with it: interpreter_exit)
            self._loop()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.queued and not self.turns:
                    self._cond.wait(0.5)
                if self._stop:
                    break
                new = [job for job in self.queued if not job.looked_up]
            self._look_up(new)  # (outside the condition: it waits for the decode lock)
            with self._cond:
                self._admit()
                group = self._next_group()
            if group is not None:
                started = time.perf_counter()
                try:
                    self._step(group)
                except Exception as e:  # noqa: BLE001 (a broken batch fails its requests, not the server)
                    self._fail_group(group, e)
                with self._cond:
                    self.last[group] = time.perf_counter() - started
                    self.used[group] = self.used.get(group, 0.0) + self.last[group]
        self._cancel_all()

    def _look_up(self, jobs: list) -> None:
        """Each new job's cached prompt prefix (the KV its row may start from)."""
        if not jobs:
            return
        with self.decode_lock:
            for job in jobs:
                job.looked_up = True
                if job.cache_lookup is None:
                    continue
                try:
                    job.prefix = job.cache_lookup(job.prompt)
                except Exception as e:  # noqa: BLE001 (a cache that cannot be read: a cold prefill)
                    logging.warning("prompt cache lookup failed, prefilling the whole prompt: %r", e)
                    job.prefix = None

    def _admit(self) -> None:
        """Queued jobs join their group's batch in FIFO order while it has room."""
        waiting = deque()
        while self.queued:
            job = self.queued.popleft()
            if not job.looked_up:  # (submitted after this turn's look-ups: it joins at the next)
                waiting.append(job)
                continue
            lane = lane_of(job)
            lanes = [b for (group, _), b in self.batches.items() if group == job.group]
            rows = sum(len(b) for b in lanes)
            if rows >= self.max_rows or not self._long_room(job, lanes):
                waiting.append(job)
                continue
            batch = self.batches.get(lane)
            if batch is None:
                batch = self.batches[lane] = RunningBatch(
                    self.adapter(job), keep_logprobs=not isinstance(job, ProtocolJob)
                )
            if isinstance(job, ProtocolJob):
                job.row = batch.add(job.prompt, job.options, payload=job, seed=job.decode.seed)
            else:
                job.row = batch.add(
                    job.prompt,
                    job.options,
                    payload=job,
                    prefix=job.prefix,
                    keep_logprobs=job.keeps_logprobs,
                    proposals=job.proposals,
                )
                job.prefix = None
                job.ctx.prompt_cache_count = job.row.prompt_kv.reused  # (usage's cached_tokens)
            if lane not in self.turns:
                # one step ahead of the least served lane: no credit for the time it was idle
                least = min((self.used.get(t, 0.0) for t in self.turns), default=0.0)
                self.used[lane] = least - max((self.last.get(t, 0.0) for t in self.turns), default=0.0)
                self.turns.append(lane)
        self.queued = waiting
        self.peak_rows = max(self.peak_rows, sum(len(b) for b in self.batches.values()))

    def adapter(self, job: Any) -> Any:
        """The adapter of `job`'s group, the same for each batch the group runs (at most
        MAX_ADAPTERS groups kept, the least recently used dropped). An adapter compiles its
        forwards once per input shape (model_adapters.runtime.batched): made afresh for each
        batch, as lanes emptied and filled again, they were compiled again and again, and the
        churn grew the server's resident memory by ~26 MB per 1,000 mixed requests, still
        rising (issue 55.8). A group's rows configure its adapter alike (`family_key`)."""
        adapter = self.adapters.pop(job.group, None)
        if adapter is None:  # (the first job's decode's: a protocol row's adapter ignores EOS)
            adapter = job.decode.adapter
        self.adapters[job.group] = adapter
        while len(self.adapters) > MAX_ADAPTERS:
            self.adapters.popitem(last=False)
        return adapter

    def _long(self, job: Any) -> bool:
        return self.long_forwards is not None and job.forwards > self.long_forwards

    def _weight(self, job: Any) -> int:
        """0 for a short request; a long one's class, k >= 1: its forward bound is within
        (4^(k-1), 4^k] times `long_forwards`."""
        if not self._long(job):
            return 0
        k, bound = 1, self.long_forwards * 4
        while job.forwards > bound:
            k, bound = k + 1, bound * 4
        return k

    def _long_room(self, job: Any, lanes: list) -> bool:
        """Whether a row is free for `job` in its class: the rows of class k and heavier
        hold at most `max_long_rows` / 2^(k-1) of the group (one at least), so that requests
        at the forward bound cannot hold every long row: a 300-forward request behind 32 of
        16,384 forwards waited 503.6 s for one of them to end."""
        k = self._weight(job)
        if k == 0:
            return True
        held = sum(1 for b in lanes for row in b.rows.values() if self._weight(row.payload) >= k)
        return held < max(1, self.max_long_rows >> (k - 1))

    def _next_group(self) -> Optional[tuple]:
        """The lane with rows that has used the least time (the earliest joined on a tie);
        lanes left without rows are dropped."""
        for lane in [t for t in self.turns if not len(self.batches.get(t) or ())]:
            self.turns.remove(lane)
            self.batches.pop(lane, None)
            self.used.pop(lane, None)
            self.last.pop(lane, None)
        if not self.turns:
            return None
        return min(self.turns, key=lambda lane: self.used.get(lane, 0.0))

    def _step(self, group: tuple) -> None:
        batch = self.batches[group]
        rows = list(batch.rows.values())
        gone = peers.closed([getattr(row.payload.check, "socket", None) for row in rows])  # (one poll for all)
        for row, closed in zip(rows, gone):  # a client that left frees its row now
            try:
                row.payload.check() if closed is None else row.payload.check(closed)
            except Exception as e:  # noqa: BLE001 (the client's error; the batch goes on)
                self._end(batch, row.payload, e)
        if not len(batch):
            return
        with self.decode_lock:  # (reading tokens and log-probs back is MLX work too)
            for event in batch.step():
                try:
                    self._dispatch(batch, event)
                except Exception as e:  # noqa: BLE001 (that request fails; the others go on)
                    if not event.row.payload.ended:
                        self._end(batch, event.row.payload, e)

    def _dispatch(self, batch: RunningBatch, event: RowEvent) -> None:
        job: Job = event.row.payload
        if job.ended:
            return
        if event.error is not None:
            self._end(batch, job, event.error)
            return
        if isinstance(job, ProtocolJob):  # its steps make its response, at its end
            if event.step is not None:
                job.steps.append(event.step)
                job.check()  # (a cancelled request stops at its next step, as alone)
            if event.finished:
                self._end(batch, job, None)
            return
        step = event.step
        if step is not None:
            if job.drafts is not None and step.ran_forward:
                job.drafts(step)
            self._emit(batch, job, step)
        if event.finished and not job.ended:
            self._end(batch, job, None)

    def _emit(self, batch: RunningBatch, job: Job, step: Step) -> None:
        """The row's newly final tokens, one Response each (as stream_generate yields
        them), handed to its client together (stream_batching)."""
        P, eos = len(job.prompt), batch.adapter.eos_ids
        top = job.top_logprobs > 0
        values = step.token_logprobs(0, P + job.emitted, P + int(step.final[0])) if job.logprobs and not top else None
        out = []
        try:
            while job.emitted < step.final[0]:
                position = P + job.emitted
                token = int(step.canvas[0, position])
                logprobs = step.logprobs(0, position) if top else None
                job.emitted += 1
                stop = token in eos
                finish = "stop" if stop else ("length" if job.emitted == job.options.max_tokens else None)
                if not stop:
                    job.detokenizer.add_token(token)
                if finish is not None:
                    job.detokenizer.finalize()
                if job.stop_matcher.advance(token):
                    finish = "stop"
                if values is not None:
                    logprob = values.get(position, 0.0)
                else:
                    logprob = logprobs[token].item() if logprobs is not None else 0.0
                ranked = (
                    _format_top_logprobs(logprobs, job.top_logprobs, self.tokenizer) if logprobs is not None else ()
                )
                job.tokens.append(token)
                out.append(Response(job.detokenizer.last_segment, token, logprob, finish, ranked))
                if finish is not None or job.ctx._should_stop:
                    job.sender.send(out)
                    out = []
                    self._end(batch, job, None)
                    return
        finally:
            job.sender.send(out)  # (the tokens made before an error too)

    def _end(self, batch: RunningBatch, job: Job, error: Optional[BaseException]) -> None:
        job.ended = True
        if isinstance(error, (Cancelled, ClientGone)):  # (the operator sees what stopped a decode)
            last = job.row.last if job.row is not None else None
            logging.info(f"a decode stopped: {error} (after {last.forwards if last is not None else 0} forwards)")
        batch.remove(job.row)
        if isinstance(job, ProtocolJob):
            job.end(error)
            return
        if error is None and job.cache_entry is not None:  # (before the client can send its next turn)
            job.cache_entry(job.prompt + job.tokens, job.row.prompt_kv.export if job.row is not None else None)
        job.sender.put(error)  # None: the end of the stream

    def _fail_group(self, group: tuple, error: BaseException) -> None:
        batch = self.batches.pop(group, None)
        for row in list(batch.rows.values()) if batch is not None else ():
            if not row.payload.ended:
                self._end(batch, row.payload, error)

    def _cancel_all(self) -> None:
        with self._cond:
            jobs = list(self.queued) + [r.payload for b in self.batches.values() for r in b.rows.values()]
            self.queued.clear()
        for job in jobs:
            if not job.ended:
                if isinstance(job, ProtocolJob):
                    job.end(Cancelled())
                    continue
                job.ended = True
                job.sender.put(Cancelled())
