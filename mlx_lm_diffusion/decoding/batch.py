"""A running batch: many decodes, one model forward per step for all of them.

Each row is its own single-row decode (`Engine.row_steps`): its own prompt length,
canvas, blocks, cache, options (max_tokens, steps, commit rule, sampler, seed) and
stopping. Only the model forwards are shared: every `step()` advances each live row to
its next forward request and answers all of them with one `Adapter.predict_batch` call
(model_adapters.runtime.batched: padded to a common width, per-row masks and positions), and the
rows whose steps are plain get their commits from one call too (mlx_lm_diffusion.decoding.decoders.fused_commit:
the log-softmax, proposal and rule selection of every such row over the stacked logits). A row
therefore gives exactly the tokens and forward count of its decode alone (greedy; up to
the floating-point effect of padding on the attention's reduction order).

Rows join with `add` (or `add_decode`: a request's Decode) at any step (their prefill,
`Adapter.start`, runs when they first advance) and leave as soon as they are done (first
done, first out) or with `remove` (a client that went away). Every option may differ per
row, the family's own ones too (`options.family`): the adapter keeps what a row's decode
reads of them in the row's state (`Adapter.start`, model_adapters.base.DecodeSetup), and
its `predict_batch` puts rows that need different forwards (LLaDA's and Dream's cache
modes, DiffusionGemma's top-k steps, Nemotron's verify passes) in calls of their own.

Pipelining (as Engine.run pipelines one decode): with `pipeline` on, `step()` queues the
forward and commits it builds with `mx.async_eval` and returns at once; the next `step()`
reads them back. The events a call returns are therefore those of the step queued by
the call before, and the caller's host work on them (a server streaming the rows' new
tokens) runs while the device computes the next step. The steps, tokens and forward
counts are the same either way: only the point at which the host waits moves. A row
removed while its step is in flight simply drops it.

Randomness: a seeded row draws from its own PRNG key (`mx.random.key(seed)`, split per
draw as MLX's global generator splits its key), swapped into MLX's global generator
while the row's code runs, so its draws do not depend on the other rows, and it draws
exactly what `Engine.run` with that seed draws. Rows without a seed draw from the
global generator (swapping costs a read-back of the key per resume).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.decoders import Forward, ReadBack
from mlx_lm_diffusion.decoding.decoders.fused_commit import FusedForward, commit_rows, deterministic_rule
from mlx_lm_diffusion.decoding.engine import Engine, Step
from mlx_lm_diffusion.decoding.interpreter_exit import computing
from mlx_lm_diffusion.decoding.kv_reuse import PromptReuse
from mlx_lm_diffusion.decoding.options import ResolvedOptions
from model_adapters import Adapter, PrefixKV


@dataclass
class BatchRow:
    """One decode in a running batch."""

    id: int
    prompt_len: int
    options: ResolvedOptions
    steps: Iterator  # Engine.row_steps: yields Forward requests and Steps
    key: Optional[mx.array]  # this row's PRNG key (None: the global generator's)
    pending: Optional[Forward] = None  # the forward request waiting for the batch's forward
    reading: Optional[ReadBack] = None  # the arrays it reads back next, evaluated with the others
    last: Optional[Step] = None
    payload: Any = None  # the caller's (a server request)
    prompt_kv: Optional[PromptReuse] = None  # the prompt KV it reused, and the KV it leaves
    error: Optional[BaseException] = None
    engine: Optional[Engine] = None  # (its Steps' proposals are noted here: Engine.note_proposals)


@dataclass
class RowEvent:
    """What happened to a row during a step: a Step (its tokens so far), or an error
    (the row is gone). `finished`: the row left the batch."""

    row: BatchRow
    step: Optional[Step] = None
    error: Optional[BaseException] = None
    finished: bool = False


@dataclass
class RunningBatch:
    """Rows decoding together over one adapter; `step()` runs one forward for all."""

    adapter: Adapter
    keep_logprobs: bool = False
    rows: dict = field(default_factory=dict)  # id -> BatchRow, in joining order
    forwards: int = 0  # batched forward calls so far
    fuse_commits: bool = True  # commit the rows' plain steps together (mlx_lm_diffusion.decoding.decoders.fused_commit)
    pipeline: bool = True  # step() returns with its forward in flight (see the module's docstring)
    _next_id: int = 0

    def __len__(self) -> int:
        return len(self.rows)

    def add(
        self,
        prompt: Sequence[int],
        options: ResolvedOptions,
        payload: Any = None,
        seed: Optional[np.ndarray] = None,
        prefix: Optional[PrefixKV] = None,
        keep_logprobs: Optional[bool] = None,
        proposals: int = 0,
        vision: Any = None,
    ) -> BatchRow:
        """A new row; it first advances at the next `step()`. `seed` (1, W): its canvas's
        pinned tokens (an infill's suffix; Engine.run). `prefix`: the KV of leading prompt
        tokens from an earlier decode (a prompt cache's), which the row starts from where
        the family's KV is exact (`row.prompt_kv.reused` positions; kv_reuse.PromptReuse);
        `row.prompt_kv.export(tokens)` is the KV the row leaves. `keep_logprobs`: whether
        its Steps carry each token's log-probs (None: the batch's `keep_logprobs`); a row
        whose caller reads none saves their writes and read-backs. `proposals`: the k most likely
        tokens per position of each forward on its Steps (Step.proposals; 0: none). `vision`:
        its images' vision inputs (DiffusionGemma), encoded with its prompt."""
        keep = self.keep_logprobs if keep_logprobs is None else keep_logprobs
        engine = Engine(self.adapter, options, keep_logprobs=keep, pipeline=False, proposals=proposals, vision=vision)
        engine.decoder.queue_eagerly = False  # every row's step is evaluated at once (_settle)
        engine.decoder.fuse_commits = self.fuse_commits  # plain steps are committed by the batch
        # (a decode that draws nothing needs no key: swapping one in costs a read-back per resume)
        key = mx.random.key(options.seed) if options.seed is not None and draws(engine.decoder) else None
        ids = mx.array([list(prompt)])
        prompt_kv = PromptReuse(prefix)
        reuse = prompt_kv.plan(self.adapter, engine, ids)
        row = BatchRow(
            self._next_id,
            len(prompt),
            options,
            engine.row_steps(ids, seed, reuse),
            key,
            payload=payload,
            prompt_kv=prompt_kv,
            engine=engine,
        )
        self._next_id += 1
        self.rows[row.id] = row
        return row

    def add_decode(self, decode: Any, **row: Any) -> BatchRow:
        """A row for a request built once (mlx_lm_diffusion.api.decode.Decode: its `ids`,
        `options`, `seed` and `vision`, read by name: decoding does not import the API);
        `row`: `add`'s other keywords (payload, prefix, keep_logprobs, proposals)."""
        return self.add(decode.ids, decode.options, seed=decode.seed, vision=decode.vision, **row)

    def remove(self, row: BatchRow) -> None:
        """Drop a row now (its client left); its generator is closed."""
        if self.rows.pop(row.id, None) is not None:
            row.steps.close()

    def stats(self) -> dict:
        return {"running_rows": len(self.rows), "batched_forwards": self.forwards}

    def step(self) -> list[RowEvent]:
        """Advance every row to its next forward request, answer them all with one
        batched forward, and advance each row to the request after (with `pipeline`:
        queue that forward and its commits, which the next call reads back). Returns the
        rows' events in order (a row that finished is out of the batch)."""
        with computing():  # (the interpreter's exit waits for it: interpreter_exit)
            return self._step()

    def _step(self) -> list[RowEvent]:
        events: list[RowEvent] = []
        self._settle(events)  # (the step the previous call left in flight)
        for row in list(self.rows.values()):
            if row.pending is None and row.reading is None:  # (a row that joined: its prefill)
                self._advance(row, None, events)
        self._settle(events)
        waiting = [row for row in self.rows.values() if row.pending is not None]
        if not waiting:
            return events
        queued = self._forward(waiting, events)
        if self.pipeline:
            # (what the rows read back next, and what their next read-back reads: one wait)
            mx.async_eval(
                *queued, *[a for row in self.rows.values() if row.reading is not None for a in row.reading.arrays]
            )
        else:
            self._settle(events)
        return events

    def _forward(self, waiting: list, events: list) -> list:
        """One batched forward (and the fused rows' commits) for the waiting rows, each
        row then advanced to its next read-back. Returns the commits' arrays."""
        try:
            logits = self.adapter.predict_batch([row.pending for row in waiting])
        except Exception as error:  # noqa: BLE001 (every waiting row fails, the batch goes on)
            for row in waiting:
                self._fail(row, error, events)
            return []
        self.forwards += 1
        replies = list(logits)
        for row, reply in zip(waiting, replies):  # (before a fused commit replaces the logits)
            if row.engine is not None and row.engine.proposals:
                row.engine.note_proposals(row.pending, reply)
        queued: list = []
        fused = [i for i, row in enumerate(waiting) if isinstance(row.pending, FusedForward)]
        if fused:  # their commits, all at once
            try:
                source = getattr(logits, "source", None)  # (one head call for every row)
                origins = [(source, i) if source is not None else None for i in fused]
                committed = commit_rows(
                    [waiting[i].pending.commit for i in fused], [replies[i] for i in fused], origins
                )
            except Exception as error:  # noqa: BLE001 (as a failed forward: those rows fail)
                for i in fused:
                    self._fail(waiting[i], error, events)
                failed = set(fused)
                waiting = [row for i, row in enumerate(waiting) if i not in failed]
                replies = [r for i, r in enumerate(replies) if i not in failed]
            else:
                for i, reply in zip(fused, committed):
                    replies[i] = reply
                    # (its kept log-probs are read when emitted; a row that keeps none reads
                    # its commit nowhere: it is not evaluated, nor its slice built)
                    queued += [reply.confidence] + ([reply.commit] if reply.take or reply.record else [])
        for row, reply in zip(waiting, replies):
            row.pending = None
            self._advance(row, reply, events)
        return queued

    def _settle(self, events: list) -> None:
        """Rows about to read arrays back: evaluate every row's at once (one wait for the
        device, not one per row), then let them go on; repeat while some read again."""
        for _ in range(64):  # (a row reads back at most twice between two forwards)
            reading = [row for row in self.rows.values() if row.reading is not None]
            if not reading:
                return
            mx.eval(*[a for row in reading for a in row.reading.arrays])
            for row in reading:
                row.reading = None
                self._advance(row, None, events)
        raise RuntimeError("batch rows kept reading back without a forward")

    def _advance(self, row: BatchRow, reply: Optional[mx.array], events: list) -> None:
        """Resume the row (with its own PRNG key) until its next forward request, its
        end, or the step that makes it done."""
        if row.key is not None:
            _use_key(row.key)
        try:
            while True:
                try:
                    item = row.steps.send(reply)
                except StopIteration:
                    self._finish(row, events)
                    return
                reply = None
                if isinstance(item, Forward):
                    row.pending = item
                    return
                if isinstance(item, ReadBack):
                    row.reading = item
                    return
                row.last = item
                done = bool(item.done[0])
                events.append(RowEvent(row, step=item, finished=done))
                if done:  # first done, first out
                    self.remove(row)
                    return
        except Exception as error:  # noqa: BLE001 (this row fails alone)
            self._fail(row, error, events)
        finally:
            if row.key is not None:
                row.key = mx.random.state[0]

    def _finish(self, row: BatchRow, events: list) -> None:
        self.rows.pop(row.id, None)
        if events and events[-1].row is row:
            events[-1].finished = True
        else:
            events.append(RowEvent(row, step=row.last, finished=True))

    def _fail(self, row: BatchRow, error: BaseException, events: list) -> None:
        row.error = error
        self.remove(row)
        events.append(RowEvent(row, error=error, finished=True))


def draws(decoder) -> bool:
    """Whether a decode may draw random numbers: anything but a masked-block decode with a
    greedy proposal and a rule that draws none (fused_commit's plain steps)."""
    o = decoder.options
    return not (
        decoder.name == "masked_block"
        and o.sampler is None
        and o.temperature_schedule is None
        and deterministic_rule(o.rule)
    )


def _use_key(key: mx.array) -> None:
    """Make `key` MLX's global PRNG state (mx.random.seed(s) sets the key (s >> 32, s & 0xffffffff))."""
    high, low = key.tolist()
    mx.random.seed((int(high) << 32) | int(low))
