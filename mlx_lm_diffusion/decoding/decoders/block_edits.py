"""LLaDA2.2's joint decoder: mask-to-token commits (M2T), token-to-token edits (T2T) and the
structural DELETE / SPLIT edits, which a scan consumes inside the block.

Reference: the released checkpoint's `modeling_llada2_moe.py`, `generate` ->
`_joint_decode_block` (read through FLX-OSS/FluxServe
`dev-notes/llada2.2-model-support-development-guide.md` section 5 and its decoder
`python/fluxserve/backend/execution/decoders/levenshtein.py`, and sgl-project/sglang PR
#31773). Per row and block, from the block's N original masks (the masks at block entry,
tracked through the edits), S steps, a step counter t and a post-mask counter:

- proposals: the argmax of the step's logits, the mask id never proposed, confidence its
  float32 softmax probability;
- M2T: need = floor(N / S) + (t < N mod S) + the masks edits created; every mask above
  `threshold` (strictly) if at least `need` pass, else the `need` most confident
  (mlx-arsenal's threshold_transfer / topk_transfer); every mask once t >= S;
- T2T: generated non-mask positions whose proposal differs, above `editing_threshold`
  (strictly; mlx-arsenal's edit_transfer). A proposal may be DELETE or SPLIT;
- the scan (mlx-arsenal's apply_block_edits): DELETE drops its position, SPLIT becomes
  [mask, the position's token before the step]; the prompt's part of the block is never
  touched; the block keeps its length (cut, or padded with masks, which count as new);
- the post-mask counter is 0 while an original mask remains and grows by one a step after;
  the final round comes when it reaches `max_post_steps` (with 0: the step that resolves the
  last original mask) or at `max_steps_per_block`: it commits every mask and takes the best
  token other than DELETE and SPLIT where it writes one. The block is then final;
- a block also ends when a step changes nothing and it holds no mask;
- anti-loop: when the block after a step's writes equals a state it already had in this
  block, the changed position of lowest confidence takes its next-best token, at most
  ESCAPE_TRIES times (the reference picks the position at random: docs/deviations.md).

Rows are independent: each keeps its own counters and ends its block on its own (a row
whose block is over writes nothing while the others go on). Tokens of a block are final,
and stream, once the block is over (`changing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import mlx.core as mx
import numpy as np
from mlx_arsenal.diffusion import apply_block_edits, edit_transfer, threshold_transfer, topk_transfer

from mlx_lm_diffusion.decoding.decoders.base import (
    BlockEdits,
    Canvas,
    Decoder,
    Forward,
    Queued,
    ReadBack,
    aligned_canvas_length,
    log_softmax,
)

ESCAPE_TRIES = 5  # the reference's bound on anti-loop resamples per step
MAX_STEPS_PER_BLOCK = 1000  # the reference's hard cap on steps per block
THRESHOLD_RULE = "low_confidence_dynamic"  # LLaDA2.x's threshold rule: its threshold is M2T's
# options that do not apply to a greedy decoder with its own commit rule
UNREAD = ("sampler", "temperature_schedule", "logits_processors", "schedule", "factor", "entropy_bound", "alg_temp")


@dataclass
class EditRows:
    """One block's per-row state (host arrays, B rows)."""

    original: np.ndarray  # (B, W) bool: the masks at block entry, tracked through the edits
    count: np.ndarray  # (B,) N: how many original masks the block started with
    step: np.ndarray  # (B,) t: steps taken in this block
    post: np.ndarray  # (B,) steps since the last original mask was resolved
    live: np.ndarray  # (B,) bool: rows still decoding this block
    seen: list  # per row: the block states after a step's writes (bytes)


class BlockEditsDecoder(Decoder):
    name = "block_edits"

    def __init__(self, adapter: Any, options: Any, keep_logprobs: bool = True):
        if adapter.mask_id is None or getattr(adapter, "edit_ids", None) is None:
            raise ValueError(f"{adapter.family}: edit decoding needs a mask token and DELETE / SPLIT ids")
        super().__init__(adapter, options, keep_logprobs)
        self.delete_id, self.split_id = adapter.edit_ids
        self.threshold = float(options.rule.threshold)
        self.editing_threshold = 0.0 if options.editing_threshold is None else float(options.editing_threshold)
        self.max_steps = int(options.family.get("max_steps_per_block") or MAX_STEPS_PER_BLOCK)
        V = adapter.vocab_size
        self.mask_bias = _minus_inf_at(V, [adapter.mask_id])  # (the mask is never proposed: a deviation)
        self.edit_bias = _minus_inf_at(V, [self.delete_id, self.split_id])
        self.escapes = 0  # anti-loop resamples so far (tests exclude the decodes where it fired)

    @classmethod
    def check_options(cls, values: dict, adapter: Any) -> None:
        given = [name for name in UNREAD if values.get(name) is not None and values.get(name) != ()]
        if given:
            raise ValueError(
                f"{given[0]} does not apply to LLaDA2.2's edit decoding (greedy, with its own commit rule); "
                "pass edit_ops=[] (no edits) or ['substitute'] to decode with it"
            )
        strategy = values.get("strategy")
        if strategy is not None and strategy != THRESHOLD_RULE:
            raise ValueError(
                f"LLaDA2.2's edit decoding commits masks by its threshold rule ({THRESHOLD_RULE}); for "
                f"strategy {strategy!r} pass edit_ops=[] (no edits) or ['substitute']"
            )

    def canvas_length(self, prompt_len: int) -> int:
        return aligned_canvas_length(self.adapter, self.options, prompt_len)

    @property
    def fill(self) -> int:
        return self.adapter.mask_id

    def block_step_bound(self, width: int) -> int:
        return self.max_steps

    def changing(self) -> bool:
        return True  # an edit can change any generated token until its block is over

    def decode_block(self, state: Any, canvas: Canvas, start: int, end: int) -> Iterator[Queued]:
        if canvas.pinned is not None:
            raise ValueError(
                "LLaDA2.2's edit decoding moves tokens inside a block, so it cannot keep pinned "
                "positions (a seeded canvas or a suffix): pass edit_ops=[]"
            )
        mask, W = self.adapter.mask_id, end - start
        held = max(canvas.prompt_len - start, 0)  # the prompt's tail at the start of the block
        generated = np.arange(W) >= held
        yield ReadBack((canvas.tokens,))
        canvas.sync()
        original = (canvas.host[:, start:end] == mask) & generated
        B = canvas.rows
        rows = EditRows(
            original,
            original.sum(axis=1),
            np.zeros(B, np.int64),
            np.zeros(B, np.int64),
            ~canvas.done & original.any(axis=1),
            [set() for _ in range(B)],
        )
        confidence = np.zeros((B, W), np.float32)
        last_logprobs: list = [None] * B  # per row: the log-probs of the forward that ended its block
        step = 0
        while rows.live.any():
            logits = yield Forward(state, canvas.tokens, start, end)
            canvas.forwards += 1
            logprobs = log_softmax(self.process(logits) + self.mask_bias)
            proposal = mx.argmax(logprobs, axis=-1).astype(mx.int32)
            prob = mx.exp(mx.max(logprobs, axis=-1))
            beaten = mx.put_along_axis(logprobs, proposal[..., None], mx.array(-mx.inf), axis=-1)
            runner_up = mx.argmax(beaten, axis=-1).astype(mx.int32)  # (the anti-loop's next-best token)
            clean = mx.argmax(logprobs + self.edit_bias, axis=-1).astype(mx.int32)  # (the final round's)
            yield ReadBack((proposal, prob, runner_up, clean))
            before = canvas.host[:, start:end].copy()
            live = rows.live.copy()
            written, final = self._writes(rows, before, generated, *map(np.array, (proposal, prob, runner_up, clean)))
            tokens, tracked = apply_block_edits(
                mx.array(before),
                mx.array(written),
                mx.array(rows.original),
                prompt_len=held,
                mask_id=mask,
                delete_id=self.delete_id,
                split_id=self.split_id,
            )
            canvas.write(mx.where(mx.array(live)[:, None], tokens, mx.array(before)), start)
            yield ReadBack((canvas.tokens, tracked))
            canvas.sync()
            rows.original = np.where(live[:, None], np.array(tracked), rows.original)
            after = canvas.host[:, start:end]
            still_masked = ((after == mask) & generated).any(axis=1)
            ended = live & (final | (~(after != before).any(axis=1) & ~still_masked))
            confidence[live] = np.array(prob)[live]
            for b in np.flatnonzero(live):
                last_logprobs[b] = (logprobs, b)
            rows.step += live
            rows.live = live & ~ended
            over = not rows.live.any()
            kept = self._kept(last_logprobs, W) if over and self.keep_logprobs else None
            edits = self._marks(written, generated)
            yield Queued(
                canvas.tokens, kept, mx.array(confidence), canvas.forwards, (start, end), step, over, True, edits
            )
            step += 1
        if step == 0:  # (no row decoded this block: an event releases it)
            yield Queued(canvas.tokens, None, mx.array(confidence), canvas.forwards, (start, end), 0, True, False)

    def _writes(
        self,
        rows: EditRows,
        before: np.ndarray,
        generated: np.ndarray,
        proposal: np.ndarray,
        prob: np.ndarray,
        runner_up: np.ndarray,
        clean: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The block after this step's writes (before the scan) and which rows took their
        final round; updates the post-mask counters and the states seen."""
        masks = (before == self.adapter.mask_id) & generated & rows.live[:, None]
        m2t = self._mask_commits(rows, masks, prob)
        editable = mx.array(~masks & generated & rows.live[:, None])
        t2t = np.array(
            edit_transfer(mx.array(proposal), mx.array(prob), mx.array(before), editable, self.editing_threshold)
        )
        written, final = before.copy(), np.zeros(len(before), dtype=bool)
        for b in np.flatnonzero(rows.live):
            left = masks[b] & rows.original[b]  # original masks still open
            rows.post[b] = 0 if left.any() else rows.post[b] + 1
            if self.options.max_post_steps > 0:
                last = rows.post[b] >= self.options.max_post_steps
            else:  # the step that resolves the last original mask
                last = not (left & ~m2t[b]).any()
            final[b] = last or rows.step[b] >= self.max_steps - 1
            tokens = proposal[b]
            commit = m2t[b] | t2t[b]
            if final[b]:  # every mask, and no DELETE or SPLIT left behind
                commit = masks[b] | t2t[b]
                tokens = np.where((tokens == self.delete_id) | (tokens == self.split_id), clean[b], tokens)
            row = np.where(commit, tokens, before[b]).astype(np.int32)
            if not final[b]:
                row = self._escape(row, before[b], proposal[b], runner_up[b], prob[b], rows.seen[b])
            rows.seen[b].add(row.tobytes())
            written[b] = row
        return written, final

    def _marks(self, written: np.ndarray, generated: np.ndarray) -> BlockEdits:
        """Where the step's DELETEs were (before the scan) and its SPLITs' masks landed
        (after it: each position moves by the widths before it, 0 a DELETE, 2 a SPLIT)."""
        deleted = (written == self.delete_id) & generated
        split = (written == self.split_id) & generated
        first_slot = np.cumsum(np.where(deleted, 0, np.where(split, 2, 1)), axis=1) - np.where(split, 2, 1)
        inserted = np.zeros_like(split)
        for b, i in zip(*np.nonzero(split)):
            if first_slot[b, i] < written.shape[1]:
                inserted[b, first_slot[b, i]] = True
        return BlockEdits(deleted, inserted)

    def _mask_commits(self, rows: EditRows, masks: np.ndarray, prob: np.ndarray) -> np.ndarray:
        """M2T per row: the masks above the threshold if at least `need` pass, else the
        `need` most confident (ties: the first position); every mask once t >= S."""
        S = self.options.steps
        made = (masks & ~rows.original).sum(axis=1)  # masks the edits created
        need = rows.count // S + (rows.step < rows.count % S) + made
        open_count = masks.sum(axis=1)
        confidence, candidates = mx.array(prob), mx.array(masks)
        passing = threshold_transfer(confidence, candidates, self.threshold, force_one=False, strict=True)
        best = topk_transfer(confidence, candidates, mx.array(np.minimum(need, open_count).astype(np.int32)))
        enough = mx.array(np.array(passing).sum(axis=1) >= need)[:, None]
        chosen = np.array(mx.where(enough, passing, best))
        return np.where((rows.step >= S)[:, None], masks, chosen)

    def _escape(
        self,
        row: np.ndarray,
        before: np.ndarray,
        proposal: np.ndarray,
        runner_up: np.ndarray,
        prob: np.ndarray,
        seen: set,
    ) -> np.ndarray:
        """A state seen before in this block: the changed position of lowest confidence
        (the first on ties) takes its next-best token, until the state is new (bounded)."""
        for _ in range(ESCAPE_TRIES):
            if row.tobytes() not in seen:
                break
            changed = np.flatnonzero(row != before)
            if not changed.size:
                break
            at = changed[np.argmin(prob[changed])]
            row[at] = runner_up[at] if row[at] == proposal[at] else proposal[at]
            self.escapes += 1
        return row

    def _kept(self, last_logprobs: list, width: int) -> Optional[mx.array]:
        """(B, W, V): each row's log-probs from the forward that ended its block (a final
        block's tokens sit where that forward saw them: the last step moved none)."""
        V = self.adapter.vocab_size
        return mx.stack(
            [
                logprobs[b] if logprobs is not None else mx.zeros((width, V))
                for logprobs, b in (item or (None, 0) for item in last_logprobs)
            ]
        )


def _minus_inf_at(size: int, ids: list) -> mx.array:
    bias = np.zeros((size,), np.float32)
    bias[[i for i in ids if 0 <= i < size]] = -np.inf
    return mx.array(bias)
