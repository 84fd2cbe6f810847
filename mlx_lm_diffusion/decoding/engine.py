"""The one decoding loop shared by every family: the driver.

A batched canvas (B, P + N) starts as the prompt followed by what the decoder fills in
(mask tokens, or noise). Blocks are walked left to right; each is handed to the decoder
the adapter chose (model_adapters: `Adapter.decoder`; mlx_lm_diffusion.decoding.decoders), which
yields one queued step per model forward. The driver turns those into `Step`s: the
draft canvas, how many generated tokens per row are final (can no longer change), which
rows are done, and the forward count. A decoder asks for each model forward by yielding a
`Forward` request: `run()` answers it at once with `Adapter.predict`; a running batch of
many single-row decodes (`row_steps`, mlx_lm_diffusion.decoding.batch) answers all rows' requests
with one `Adapter.predict_batch`.

Pipelining (as mlx-lm's generate_step does with async_eval): each step's arrays are
queued with `mx.async_eval`, and when the decoder's control flow needs no step's tokens
on the host (`Decoder.may_run_ahead`: the rule knows its commit counts beforehand,
`CommitRule.known_commits`), the next step is queued before this one is read back, so
the Python work of a step overlaps the model's compute. It applies to single-row decodes;
the steps yielded are the same either way (`pipeline=False` reads every step back). A
step queued after the one that ends the decode (an EOS, the max_tokens-th token) is
dropped and not counted, as mlx-lm's generate_step computes one token past the end.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.decoders import Canvas, Forward, Queued, ReadBack, decoder_class
from mlx_lm_diffusion.decoding.decoders.kept_logprobs import KeptLogprobs, kept_arrays
from mlx_lm_diffusion.decoding.interpreter_exit import computing
from mlx_lm_diffusion.decoding.options import ResolvedOptions
from model_adapters import Adapter, DecodeSetup


@dataclass
class Step:
    """The state of a decode after one model forward."""

    canvas: np.ndarray  # (B, P + N) draft: committed tokens and mask ids (uniform noise:
    # the argmax drafts up to the end of the current canvas)
    prompt_len: int
    final: np.ndarray  # (B,) generated tokens per row that can no longer change
    done: np.ndarray  # (B,) rows that finished (EOS in their final prefix, or full)
    forwards: int  # model forwards so far
    block: tuple[int, int]
    step: int  # step index within the block
    # each token's log-probs at commit: a KeptLogprobs (the masked decoder's records of its
    # commits) or a (B, block, V) array; read them with `logprobs` (`block_logprobs`: dense)
    kept: Any = None
    ran_forward: bool = True  # False: a block-over event without a model forward
    block_confidence: Optional[mx.array] = None  # (B, block) each token's confidence at commit
    edits: Any = None  # a step's structural edits (DELETE / SPLIT), from a decoder that makes them: BlockEdits
    # canvas positions [start, end) of row 0 that show a speculative decoder's drafts, not
    # committed tokens (self-speculation, I-DLM); None: none
    drafted: Optional[tuple] = None
    # (B, block) the block positions whose drawn token this step accepted (a uniform canvas:
    # DiffusionGemma's rule keeps them, the rest is noised again); None: the decoder accepts none
    accepted: Optional[np.ndarray] = None
    # (positions (K,), ids (K, k), probabilities (K, k)): row 0's k most likely tokens at the
    # canvas positions of this step's forward, when the engine was asked (Engine(proposals=k))
    proposals: Optional[tuple] = None

    @property
    def block_logprobs(self) -> Optional[mx.array]:
        """(B, block, V) log-probs each token had at commit (zeros where none committed),
        built from the records when read."""
        return self.kept.dense() if isinstance(self.kept, KeptLogprobs) else self.kept

    @property
    def forward(self) -> bool:
        """The earlier name of `ran_forward` (easy to confuse with `forwards`)."""
        return self.ran_forward

    def logprobs(self, row: int, position: int) -> Optional[mx.array]:
        """(V,) log-probs of the token at `position` when it was committed. Every token
        becomes final while its block is current, so this covers every emitted token."""
        start, end = self.block
        if self.kept is None or not start <= position < end:
            return None
        if isinstance(self.kept, KeptLogprobs):
            return self.kept.row(row, position - start)
        return self.kept[row, position - start]

    def token_logprobs(self, row: int, lo: int, hi: int) -> dict:
        """{position: log-prob of its token} for the positions [lo, hi) of the block, read
        on the host (an MLX op per token would wait for the device each time)."""
        start, end = self.block
        lo, hi = max(lo, start), min(hi, end)
        if self.kept is None or lo >= hi:
            return {}
        tokens = np.asarray(self.canvas[row, lo:hi], dtype=np.int64)
        if isinstance(self.kept, KeptLogprobs):
            return dict(zip(range(lo, hi), self.kept.values(row, range(lo - start, hi - start), tokens)))
        rows = np.asarray(self.kept)[row, lo - start : hi - start]  # (hi - lo, V), sliced on the host
        return dict(zip(range(lo, hi), rows[np.arange(hi - lo), tokens].tolist()))


def pipelined(queued: Iterator[Queued], land: Callable[[Queued], Step], finished: Callable[[], bool]) -> Iterator[Step]:
    """mlx-lm's y / next_y: read step t back (`land`) only once step t + 1 is queued, so
    the host's work on t overlaps the model's on t + 1. Once the decode is `finished`,
    the step queued after it is dropped."""
    pending = next(queued, None)
    for next_step in queued:
        yield land(pending)
        if finished():
            return
        pending = next_step
    if pending is not None:
        yield land(pending)


def answered(requests: Iterator, predict: Callable[[Forward], mx.array]) -> Iterator[Queued]:
    """The queued steps of a decoder's generator, its forward requests answered at once
    by `predict` (one decode: nothing to batch them with)."""
    reply = None
    while True:
        try:
            item = requests.send(reply)
        except StopIteration:
            return
        if isinstance(item, Forward):
            reply = predict(item)
        elif isinstance(item, ReadBack):
            reply = None
        else:
            reply = None
            yield item


def exit_guarded(steps: Iterator[Step]) -> Iterator[Step]:
    """`steps`, each made inside interpreter_exit.computing() (the interpreter's exit waits
    for it to land; none starts once it is exiting)."""
    while True:
        with computing():
            step = next(steps, None)
        if step is None:
            return
        yield step


MAX_PROPOSALS = 20  # (the most proposals a Step carries per position: the studio asks for 5)


class Engine:
    """Runs one resolved decode through an adapter; iterate `run()` for the steps."""

    def __init__(
        self,
        adapter: Adapter,
        options: ResolvedOptions,
        keep_logprobs: bool = True,
        pipeline: bool = True,
        gather_rows: bool = True,
        proposals: int = 0,
        vision: Any = None,
    ):
        self.adapter = adapter
        self.options = options
        # what the adapter's `start` reads of this decode (its family options, its images'
        # vision inputs): kept in the decode's state, never on the shared adapter
        self.setup = DecodeSetup(options, vision)
        # Step.proposals: the model's `proposals` most likely tokens at each position of row 0's
        # latest forward (the studio's hover: what it hesitated between); 0: none
        self.proposals = min(max(int(proposals), 0), MAX_PROPOSALS)
        self._proposed: collections.deque = collections.deque(maxlen=8)  # (one per forward, in order)
        self.decoder = decoder_class(adapter, options.family)(adapter, options, keep_logprobs)
        self.pipeline = pipeline  # False: read every step back before building the next
        # True: a step asks for the logits of the positions it reads only (Forward.rows,
        # answered by Adapter.predict_rows); False: the whole block at every step.
        self.gather_rows = gather_rows
        self.state: Any = None  # the adapter's state of the latest run
        self.canvas: Optional[Canvas] = None  # ... and its canvas

    def run(self, prompt: mx.array, seed: Optional[np.ndarray] = None, reuse: Any = None) -> Iterator[Step]:
        """The decode's steps. `seed` (B, W), optional: the canvas after the prompt with
        pinned tokens (FREE where the decoder fills in; see Canvas), built by
        mlx_lm_diffusion.output.infill. `reuse`: a PrefixKV of the prompt's leading positions that the
        adapter accepted (`Adapter.reuse_length`); the adapter's state stays in `self.state`
        and its canvas in `self.canvas` (for `Adapter.export_prefix`)."""
        if prompt.ndim != 2 or prompt.shape[1] < 1:
            raise ValueError("prompt must be a (B, P) array of token ids with P >= 1")
        B, P = prompt.shape
        if self.options.seed is not None:
            mx.random.seed(self.options.seed)
        canvas = Canvas(prompt, self.decoder.canvas_length(P), self.decoder.fill, seed)
        state = self.adapter.start(prompt, reuse=reuse, setup=self.setup)
        self.state, self.canvas = state, canvas
        self.decoder.gather_rows = self.gather_rows
        queued = answered(self._blocks(state, canvas), self._predict)
        land = lambda q: self._land(canvas, q)  # noqa: E731
        # A queued step runs ahead of the host only where a stale `done` cannot change it:
        # one row (its decode ends when it is done) and a decoder that reads nothing back.
        if self.pipeline and B == 1 and self.decoder.may_run_ahead():
            yield from exit_guarded(pipelined(queued, land, lambda: canvas.done.all()))
        else:
            yield from exit_guarded(map(land, queued))

    def row_steps(self, prompt: mx.array, seed: Optional[np.ndarray] = None, reuse: Any = None):
        """One row's decode for a driver that batches forwards (mlx_lm_diffusion.decoding.batch):
        a generator yielding `Forward` requests, each to be answered with `send(logits)`,
        `ReadBack`s (the arrays it reads back next: evaluate them with every other row's)
        and `Step`s (both resumed with `send(None)`). No pipelining, no seeding: the
        driver owns the PRNG (a key per row). `seed` (1, W): pinned tokens, and `reuse`: a
        prompt prefix's KV, as for `run` (the state and canvas stay in `self.state`, `self.canvas`)."""
        if prompt.ndim != 2 or prompt.shape != (1, prompt.shape[1]) or prompt.shape[1] < 1:
            raise ValueError("a batch row's prompt must be a (1, P) array of token ids with P >= 1")
        canvas = Canvas(prompt, self.decoder.canvas_length(prompt.shape[1]), self.decoder.fill, seed)
        self.decoder.gather_rows = False  # (the batch driver answers whole blocks: predict_batch)
        state = self.adapter.start(prompt, reuse=reuse, setup=self.setup)
        self.state, self.canvas = state, canvas
        requests = self._blocks(state, canvas)
        reply = None
        while True:
            try:
                item = requests.send(reply)
            except StopIteration:
                return
            if isinstance(item, (Forward, ReadBack)):
                reply = yield item
            else:
                reply = None
                yield ReadBack((item.tokens, *kept_arrays(item.kept), item.confidence))
                yield self._land(canvas, item)

    def _predict(self, f: Forward) -> mx.array:
        if f.verify:
            logits = self.adapter.verify(f.state, f.canvas[:, f.start : f.end], f.clean)
        elif f.rows is None:
            logits = self.adapter.predict(f.state, f.canvas, f.start, f.end)
        else:
            logits = self.adapter.predict_rows(f.state, f.canvas, f.start, f.end, f.rows)
        self.note_proposals(f, logits)
        return logits

    def note_proposals(self, f: Forward, logits: Any) -> None:
        """Keep the top `proposals` tokens and probabilities of row 0's logits of forward `f`
        (when asked for) for its Step. A verify pass's row i proposes position start + i + 1."""
        if not self.proposals or not isinstance(logits, mx.array) or logits.ndim != 3:
            return
        first = f.start + (1 if f.verify else 0)
        positions = np.arange(first, first + logits.shape[1]) if f.rows is None else np.array(f.rows[0]) + f.start
        probs = mx.softmax(logits[0].astype(mx.float32), axis=-1)
        k = min(self.proposals, probs.shape[-1])
        ids = mx.argsort(-probs, axis=-1)[:, :k]
        self._proposed.append((positions, ids, mx.take_along_axis(probs, ids, axis=-1)))

    def _take_proposals(self) -> Optional[tuple]:
        """The oldest forward's proposals: a pipelined decode asks for its next forward before
        the step of the last one lands, and every forward lands as one Step."""
        if not self._proposed:
            return None
        positions, ids, probs = self._proposed.popleft()
        return positions, np.array(ids), np.array(probs)

    def _blocks(self, state, canvas: Canvas) -> Iterator[Queued]:
        a = self.adapter
        for start, end in self.decoder.blocks(canvas.prompt_len):  # (the decoder's own spans)
            if canvas.done.all():
                break
            yield from self.decoder.decode_block(state, canvas, start, end)
            a.finish_block(state, canvas.tokens, start, end)

    def _land(self, canvas: Canvas, q: Queued) -> Step:
        """The Step of a queued step, once its tokens are read back."""
        host = canvas.host_of(q.tokens)
        start, end = q.block
        # While tokens of the current block can change, only earlier blocks (and this one
        # once it is over) are final.
        horizon = end if (q.block_over or not self.decoder.changing()) else start
        self._finality(canvas, host, horizon)
        return Step(
            self.decoder.draft(host, end),
            canvas.prompt_len,
            canvas.final,
            canvas.done.copy(),
            q.forwards,
            q.block,
            q.step,
            q.kept,
            q.ran_forward,
            q.confidence,
            q.edits,
            self.decoder.drafted(),
            None if q.accepted is None else np.array(q.accepted),
            self._take_proposals() if q.ran_forward else None,
        )

    def _finality(self, canvas: Canvas, host: np.ndarray, horizon: int) -> None:
        """Final = the committed prefix of the generation before `horizon`, up to and
        including its first EOS; a row is done once that prefix holds an EOS or covers
        max_tokens. Final tokens never change, so each call scans only the tokens after
        the last call's final prefix."""
        P, a, eos_ids = canvas.prompt_len, self.adapter, self.options.eos_ids
        N = min(canvas.generated, self.options.max_tokens)  # (a canvas may run past it)
        limit = min(horizon - P, N)
        final, done = canvas.final.copy(), canvas.done.copy()
        for b in range(len(done)):
            if done[b]:
                continue
            # (plain lists: a step usually adds one token, too few for numpy to pay off)
            for token in host[b, P + final[b] : P + limit].tolist():
                if token == a.mask_id:
                    break
                final[b] += 1
                if token in eos_ids:
                    done[b] = True
                    break
            done[b] = done[b] or final[b] == N
        canvas.final, canvas.done = final, done
