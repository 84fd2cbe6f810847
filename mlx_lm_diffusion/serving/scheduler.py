"""Continuous batching for the server: one running batch per compatible group.

mlx_lm.server's generation thread hands each diffusion request to `Scheduler.submit`
(the server's `_serve_single` hook) instead of decoding it there; the scheduler's own
thread keeps one `RunningBatch` per group of requests that can share a forward (the
completions, and the step-schedule protocol's requests: each job's `group`; every option,
the family's own ones too, may differ per row). Each turn:

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
from typing import Any, Callable, Optional

from mlx_lm_diffusion.decoding import RowEvent, RunningBatch, thread_streams
from mlx_lm_diffusion.serving import peers
from mlx_lm_diffusion.serving.errors import Cancelled, ClientGone
from mlx_lm_diffusion.serving.jobs import Job, ProtocolJob

MAX_ADAPTERS = 16  # groups whose adapter (and the forwards it compiled) the scheduler keeps


def lane_of(job: Any) -> tuple:
    """(group, size class): jobs whose forward bounds are within a factor of 4 of each
    other share a lane (a batch); a short request never steps with canvases 100 times
    its own."""
    return job.group, max(0, (max(job.forwards, 1) - 1).bit_length() + 1) // 2


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
        job = ProtocolJob(decode, check, forwards=decode.decode.forwards)  # (its Decode's forward bound)
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
            if batch is None:  # (a lane's jobs are of one kind: its group says so)
                batch = self.batches[lane] = RunningBatch(self.adapter(job), keep_logprobs=job.keeps_logprobs)
            job.join(batch)
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
        rising (issue 55.8). A row's options live in its decode's state, not on the adapter
        (model_adapters.base.DecodeSetup): any row of the group can use it."""
        adapter = self.adapters.pop(job.group, None)
        if adapter is None:  # (the first job's decode's)
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
        if event.step is not None and job.take(event.step, job.options.eos_ids, self.tokenizer):
            self._end(batch, job, None)
            return
        if event.finished and not job.ended:
            self._end(batch, job, None)

    def _end(self, batch: RunningBatch, job: Job, error: Optional[BaseException]) -> None:
        job.ended = True
        if isinstance(error, (Cancelled, ClientGone)):  # (the operator sees what stopped a decode)
            last = job.row.last if job.row is not None else None
            logging.info(f"a decode stopped: {error} (after {last.forwards if last is not None else 0} forwards)")
        batch.remove(job.row)
        job.finish(error)

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
                job.finish(Cancelled())
