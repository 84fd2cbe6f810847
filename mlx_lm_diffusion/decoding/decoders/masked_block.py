"""The masked-block decoder: LLaDA, Dream, SDAR, LLaDA2.x, Nemotron-Labs Diffusion, ar.

A block starts as mask tokens (or with its first token seeded by the adapter's causal
pass, `Adapter.block_seed`). Each step the adapter predicts the block, the proposals are
scored, the commit rule selects masked positions and they are written into the canvas;
with an editing threshold, committed tokens may also be revised (LLaDA2.1 editing). A
block ends once it has no masks (and, with editing, no more edits or `max_post_steps`
passes).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import numpy as np
from mlx_arsenal.diffusion import edit_transfer
from mlx_lm.sample_utils import apply_top_p

from mlx_lm_diffusion.decoding.commit_rules import StepInputs
from mlx_lm_diffusion.decoding.decoders import fused_commit
from mlx_lm_diffusion.decoding.decoders.base import (
    BlockState,
    Canvas,
    Decoder,
    Forward,
    Queued,
    ReadBack,
    aligned_canvas_length,
    greedy_proposal,
    log_softmax,
    normalized_entropy,
    queue,
)
from mlx_lm_diffusion.decoding.decoders.constraints import LeftToRight
from mlx_lm_diffusion.decoding.decoders.gathered_rows import bucket, read_positions, spread, spread_filled, take_rows
from mlx_lm_diffusion.decoding.decoders.kept_logprobs import (
    KeptLogprobs,
    KeptRows,
    committed_rows,
    committed_rows_read_back,
    kept_arrays,
    whole_block,
)
from mlx_lm_diffusion.decoding.decoders.vocab_stats import greedy_parts, logprob_rows
from model_adapters import model_cache

# Temperatures below this decode greedily: log-probs divided by less can overflow float32.
MIN_TEMPERATURE = 1e-4


def suppress_bias(adapter: Any) -> Optional[mx.array]:
    """(V,) -inf at the adapter's suppressed ids, 0 elsewhere (None: none), one array per
    model and ids (model_adapters.runtime.model_cache): the rows of a running batch then
    share it, and their fused commit adds one vector for all of them (fused_commit)
    instead of stacking one per row."""
    if not adapter.suppress_ids:
        return None
    key = (adapter.vocab_size, tuple(sorted(adapter.suppress_ids)))
    biases = model_cache(adapter.model).setdefault("suppress bias", {})
    bias = biases.get(key)
    if bias is None:
        bias = mx.zeros((adapter.vocab_size,), mx.float32)
        bias[mx.array(sorted(adapter.suppress_ids))] = -mx.inf
        mx.eval(bias)
        biases[key] = bias
    return bias


class MaskedBlockDecoder(Decoder):
    name = "masked_block"

    def __init__(self, adapter: Any, options: Any, keep_logprobs: bool = True):
        if adapter.mask_id is None:
            raise ValueError(f"{adapter.family} has no mask token; it cannot use a masked canvas")
        super().__init__(adapter, options, keep_logprobs)
        # Logits processors are fed each committed token once and for good, and their commits
        # only extend the left-to-right prefix: no committed token is left that an edit could
        # revise, so editing (editing_threshold) does not run under them.
        self.editing = options.editing_threshold is not None and not options.logits_processors
        self.suppress = suppress_bias(adapter)  # added to the logits: the suppressed ids are never proposed
        # mlx-lm logits processors: fed the committed prefix in order (constraints.py)
        self.ordered = None
        if options.logits_processors:
            greedy = options.sampler is None and options.temperature_schedule is None
            self.ordered = LeftToRight(options.logits_processors, options.eos_ids, greedy)

    def canvas_length(self, prompt_len: int) -> int:
        return aligned_canvas_length(self.adapter, self.options, prompt_len)

    @property
    def fill(self) -> int:
        return self.adapter.mask_id

    def may_run_ahead(self) -> bool:
        return not (self.options.logits_processors or self.editing)

    def block_step_bound(self, width: int) -> int:
        # the rule's own bound, plus at most max_post_steps + 1 editing passes once the
        # block is full
        o = self.options
        bound = o.rule.step_bound(o.steps, width) + (o.max_post_steps + 1) * self.editing
        # logits processors: at least one commit per step and row, so at most `width` steps
        return max(bound, width) if o.logits_processors else bound

    def changing(self) -> bool:
        return self.editing  # an edit can revise a committed token until its block is over

    def decode_block(self, state: Any, canvas: Canvas, start: int, end: int) -> Iterator[Queued]:
        """Steps until the block has no masks (and, with editing, no more edits)."""
        o, rule = self.options, self.options.rule
        b = self._start_block(state, canvas, start, end)
        limit = self.block_step_bound(end - start)
        while True:
            if canvas.done.any():  # rows that finished commit nothing more
                b.masked = b.masked * ~canvas.done
            has_mask = bool(b.masked.any())
            if not has_mask:
                b.post_steps += 1
                if not self.editing or b.post_steps > o.max_post_steps:
                    break
            if b.step >= limit:
                raise RuntimeError(f"{rule.name} did not finish a block within {limit} steps")
            edited = yield from self._step(state, canvas, b, has_mask)
            block_over = self.editing and not has_mask and not edited
            yield queue(canvas, b, b.kept, block_over)
            b.step += 1
            if block_over:
                return
        if self.editing or b.step == 0:  # the block is final now: an event releases its tokens
            yield queue(canvas, b, b.kept, True, ran_forward=False)

    def _start_block(self, state: Any, canvas: Canvas, start: int, end: int) -> BlockState:
        B, width = canvas.rows, end - start
        # (the log-probs of the tokens this block commits, recorded per step: kept_logprobs)
        kept = KeptLogprobs(B, width, self.adapter.vocab_size) if self.keep_logprobs else None
        b = BlockState(start, end, confidence=mx.zeros((B, width)), kept=kept)
        self._seed_first_token(state, canvas, b)
        # Nothing has written into this block since the canvas was built (or since the seed
        # read it back), so the host copy shows its masks even while a step is in flight.
        b.first_open = canvas.open_rows(start, end, self.adapter.mask_id)
        b.masked = b.first_open.sum(axis=1)  # per row, kept on the host without reading tokens back
        b.rule_state = self.options.rule.start_block(b.masked, self.options.steps)
        return b

    def _step(self, state: Any, canvas: Canvas, b: BlockState, has_mask: bool):
        """One forward and its commits (a generator: it yields the forward it needs);
        returns whether a committed token was edited."""
        if self.fuse_commits and has_mask and fused_commit.fusable(self):  # a running batch commits it
            return (yield from fused_commit.row_step(self, state, canvas, b))
        o, rule, mask_id = self.options, self.options.rule, self.adapter.mask_id
        candidates = self._candidates(canvas, b)
        rows = self._rows_read(b, candidates, has_mask)
        read = None if rows is None else self._read_count(b)
        x0, prob, logprobs, logits, entropy, take = yield from self._predict(state, canvas, b, rows, read)
        if rows is not None:
            rows = rows[:, :read]  # (the positions the step's statistics cover: _predict)
        # Under processors a block may outlast the rule's schedule (one commit per step at
        # least): past it the rule selects nothing and the walk commits the next token.
        past_rule = self.ordered is not None and b.step >= rule.step_bound(o.steps, b.end - b.start)
        committed = rule.known_commits(b.rule_state, b.step, o.steps, b.masked) if has_mask and not past_rule else 0
        if self.ordered is not None and has_mask:
            committed = None  # the processors decide how far the commits go
        takes_all = has_mask and committed is not None and (committed == b.masked).all()
        edited = False
        if takes_all and b.step == 0 and b.first_open.all() and not self.editing:
            # the step fills the whole block (at block length 1, every step): it is the proposal
            self._apply(canvas, b, None, x0, prob, None if b.kept is None else whole_block(logprobs))
            commit = None
        else:
            if not has_mask or past_rule:
                commit = mx.zeros(candidates.shape, dtype=mx.bool_)
            elif takes_all:
                commit = candidates  # every candidate commits: no ranking can change that
            else:
                entropy = normalized_entropy(logprobs) if entropy is None else entropy
                entropy = spread_filled(entropy, rows, b.end - b.start)
                inputs = StepInputs(x0, prob, entropy, logprobs, candidates, b.step, o.steps, b.masked, rows)
                commit = rule.select(inputs, b.rule_state)
            if self.ordered is not None and has_mask:
                commit, x0, logprobs = self.ordered.verify(
                    canvas, b.start, commit, x0, logits, logprobs, self._correction(b), mask_id
                )
                take = partial(take_rows, logprobs)  # (the processed log-probs are kept)
                prob = mx.exp(mx.take_along_axis(logprobs, x0[..., None], axis=-1)[..., 0])
            if self.editing:
                block = canvas.tokens[:, b.start : b.end]
                editable = (block != mask_id) & canvas.live_rows()
                unpinned = canvas.unpinned(b.start, b.end)
                if unpinned is not None:  # a pinned token is never edited
                    editable = editable & unpinned
                edit = edit_transfer(x0, prob, block, editable, o.editing_threshold)
                commit = commit | edit
                edited = bool(mx.any(edit).item())
            self._apply(canvas, b, commit, x0, prob)
        yield from self._count_open(canvas, b, committed)
        if commit is not None:  # (after the read-back: a count only the commits tell is read then)
            self._keep(b, commit, rows, None if committed is None or self.editing else committed, take)
        return edited

    def _keep(
        self,
        b: BlockState,
        commit: mx.array,
        rows: Optional[mx.array],
        committed: Any,
        take: Callable[[mx.array], mx.array],
    ) -> None:
        """Record the log-probs of the positions the step committed (kept_logprobs). The
        commit count per row is the rule's (`committed`, host) or, where edits or the
        processors decide (None), read from `commit` (evaluated by the step's read-back)."""
        if b.kept is None:
            return
        if committed is None:  # (the commits are on the host: so are the record's positions)
            record = committed_rows_read_back(np.array(commit), None if rows is None else np.array(rows), take)
        else:
            counts = np.asarray(committed)
            record = committed_rows(commit, rows, int(counts.max()) if counts.size else 0, take)
        b.kept = b.kept.add(record)
        if record is not None and self.queue_eagerly:
            mx.async_eval(*record.arrays())

    def _count_open(self, canvas: Canvas, b: BlockState, committed: Optional[mx.array]):
        """Update `b.masked` after a step: from the rule's known commit counts, or, when
        this step's tokens decide, by reading them back (a generator: it may yield ReadBack)."""
        if committed is None:
            yield ReadBack((canvas.tokens,))
            canvas.sync()
            b.masked = canvas.open_rows(b.start, b.end, self.adapter.mask_id).sum(axis=1)
        else:
            b.masked = b.masked - committed

    def _seed_first_token(self, state: Any, canvas: Canvas, b: BlockState) -> None:
        """Commit the block's first token when a causal pass already proposed it (the
        adapter's `block_seed`), in rows still decoding, unless the rule schedules every
        position itself (the step-schedule protocol's: `seeds_blocks` False)."""
        if not getattr(self.options.rule, "seeds_blocks", True):
            return
        logits = self.adapter.block_seed(state, canvas.tokens, b.start)
        if logits is None:
            return
        start = b.start
        open_row = canvas.live_rows()[:, 0] & (canvas.tokens[:, start] == self.adapter.mask_id)
        logits = self._suppressed(self.process(logits[:, None]))
        if self.ordered is not None:  # the seed commits `start`: the processors are fed it
            logits = self.ordered.seed(canvas, logits, start, np.array(open_row))
        logprobs = log_softmax(logits)
        x0, prob = self._propose(logprobs)
        seeded = mx.where(open_row, x0[:, 0], canvas.tokens[:, start])[:, None]
        canvas.write(seeded, start)
        b.confidence[:, 0] = mx.where(open_row, prob[:, 0], b.confidence[:, 0])
        if b.kept is not None:  # (position 0, in the rows it was seeded in)
            first = mx.zeros((canvas.rows, 1), mx.int32)
            b.kept = b.kept.add(KeptRows(first, mx.array(open_row)[:, None], logprobs[:, :1]))
        mx.eval(canvas.tokens, *kept_arrays(b.kept), b.confidence)
        canvas.sync()

    def _candidates(self, canvas: Canvas, b: BlockState) -> mx.array:
        """(B, width) the masked positions of the rows still decoding."""
        if b.step == 0:  # (the host copy of the block is current until its first commit)
            return mx.array(b.first_open)
        return (canvas.tokens[:, b.start : b.end] == self.adapter.mask_id) & canvas.live_rows()

    def _rows_read(self, b: BlockState, candidates: mx.array, has_mask: bool) -> Optional[mx.array]:
        """(B, K) the block positions this step reads, padded to a bucket (gathered_rows),
        or None: every position. Only the candidates are read, unless editing (committed
        tokens are revised too) or logits processors (fed logits per position) run, or the
        proposal is drawn at random (the draw's shape, hence its random stream, would
        change). A bucket as wide as the block (K = width) still names the rows read: the
        head then runs over the whole block (`_predict`: gathering hidden states pays only
        below the block's width) and the statistics over the rows read only."""
        if not (self.gather_rows and has_mask) or self.editing or self.ordered is not None:
            return None
        temperature = self._temperature(b)
        if self.options.sampler is not None or (temperature is not None and temperature >= MIN_TEMPERATURE):
            return None
        width, read = b.end - b.start, self._read_count(b)
        return None if read >= width else read_positions(candidates, bucket(read, width))

    def _read_count(self, b: BlockState) -> int:
        """The most candidates a row has, from the host (at the first step: the block's
        masks): a step's gathered rows past it are a bucket's padding."""
        return int(b.first_open.sum(axis=1).max() if b.step == 0 else b.masked.max())

    def _predict(
        self, state: Any, canvas: Canvas, b: BlockState, rows: Optional[mx.array] = None, read: Optional[int] = None
    ):
        """The step's (x0, prob) per block position, its log-probs and logits (per row of
        `rows` when given: the proposal of an unread position is its current token, at
        probability 0), for a greedy proposal the entropy per row (else None), and
        `take(slots (B, k))`: the log-probs at k of their rows, computed at those only.
        With `rows`, the head runs over the whole bucket (a few shapes for the model) and
        the statistics over the first `read` rows only (the others are padding: each pass
        over the vocabulary costs per row; nothing here is compiled, so their varying
        shape recompiles nothing). A bucket as wide as the block asks for the whole block
        (`predict`, the head in position order) and takes the rows read from its logits,
        as a loop that gathers after the head does: a step that reads 100 of 128 rows
        then pays the passes over the vocabulary on 100, not 128."""
        whole = rows is not None and rows.shape[1] >= b.end - b.start
        logits = yield Forward(state, canvas.tokens, b.start, b.end, None if whole else rows)  # the driver answers it
        canvas.forwards += 1
        if rows is not None and read is not None and read < rows.shape[1]:
            rows = rows[:, :read]
            logits = take_rows(logits, rows) if whole else logits[:, :read]
        logits = self._suppressed(self.process(logits))
        temperature = self._temperature(b)
        if self.options.sampler is None and (temperature is None or temperature < MIN_TEMPERATURE):
            x0, prob, entropy, shifted, log_total = greedy_parts(logits)
            if rows is not None:
                x0 = spread(x0, rows, canvas.tokens[:, b.start : b.end])
                prob = spread_filled(prob, rows, b.end - b.start)
            # (the full log-probs stay lazy: only a rule that reads them computes them)
            return x0, prob, shifted - log_total, logits, entropy, partial(logprob_rows, shifted, log_total)
        logprobs = log_softmax(logits)  # (_rows_read gathers under a greedy proposal only)
        take = partial(take_rows, logprobs)
        if temperature is not None:
            return (*self._propose_tempered(logprobs, temperature), logprobs, logits, None, take)
        return (*self._propose(logprobs), logprobs, logits, None, take)

    def _temperature(self, b: BlockState) -> Optional[float]:
        temperatures = self.options.temperature_schedule
        return None if temperatures is None else temperatures[min(b.step, len(temperatures) - 1)]

    def _correction(self, b: BlockState):
        """A token from processed log-probs (1, 1, V), proposed as this step proposes."""
        temperature = self._temperature(b)
        if temperature is not None:
            return lambda logprobs: self._propose_tempered(logprobs, temperature)[0]
        return lambda logprobs: self._propose(logprobs)[0]

    def _apply(
        self, canvas: Canvas, b: BlockState, commit: Optional[mx.array], x0, prob, whole: Optional[KeptRows] = None
    ) -> None:
        """Write the committed proposals into the canvas (commit None: the whole block,
        whose log-probs `whole` records)."""
        if commit is None:
            block, b.confidence = x0, prob
            b.kept = None if b.kept is None else b.kept.add(whole)
        else:
            block = mx.where(commit, x0, canvas.tokens[:, b.start : b.end])
            b.confidence = mx.where(commit, prob, b.confidence)
        canvas.write(block, b.start)
        if self.queue_eagerly:  # computes while the host goes on
            mx.async_eval(canvas.tokens, b.confidence, *(whole.arrays() if whole is not None else ()))

    def _suppressed(self, logits: mx.array) -> mx.array:
        return logits if self.suppress is None else logits + self.suppress

    def _propose(self, logprobs: mx.array):
        """Proposed tokens with their temperature-1 probability."""
        if self.options.sampler is None:
            return greedy_proposal(logprobs)
        x0 = self.sample(logprobs)
        prob = mx.exp(mx.take_along_axis(logprobs, x0[..., None], axis=-1)[..., 0])
        return x0, prob

    def _propose_tempered(self, logprobs: mx.array, temperature: float):
        """The step-schedule protocol's proposal: logits / temperature (greedy at 0),
        confidence = the largest tempered probability, tokens drawn with nucleus top_p.
        A temperature below MIN_TEMPERATURE decodes greedily, as 0 does."""
        if temperature < MIN_TEMPERATURE:  # (dividing by less overflows float32 to inf / NaN)
            return greedy_proposal(logprobs)
        tempered = log_softmax(logprobs / temperature)
        confidence = mx.exp(mx.max(tempered, axis=-1))
        if self.options.top_p < 1.0:
            tempered = apply_top_p(tempered, self.options.top_p)
        x0 = mx.random.categorical(tempered).astype(mx.int32)
        return x0, confidence
