"""The log-probs each committed token had at its commit, kept per step for the rows
that committed only.

mlx-lm's GenerationResponse carries a full-vocabulary log-prob vector per token: the
log-softmax of the step that committed it. Keeping one (B, width, V) array per block and
rewriting it at every step (a `where` over the block, or a gather and a scatter that
copies it) costs width x V per step, as much as a bare forward of a small model at a
32k vocabulary, even when the step commits one token. Here a step adds a `KeptRows`
record instead: the log-probs of the positions it committed only (k per row, k the
most any row committed, rounded up to a `gathered_rows.bucket`), gathered from the
step's logits before the log-softmax's last subtraction runs (so nothing else pays a
pass over the vocabulary). A block's `KeptLogprobs` is the tuple of its records so far;
a position's vector is the one of the latest record that committed it (an edit commits
again), zeros where none did (as the block's dense array started). `dense()` builds
that array, for a reader that wants the whole block; emission reads single rows.

Memory: the records of a block hold about one vector per committed token (the padding of
the bucket aside), no step holds width x V.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.decoders.gathered_rows import bucket, read_positions, take_rows


class KeptRows:
    """One step's commits: `logprobs` (B, k, V) of the block positions `positions`
    (B, k, start-relative); `valid` (B, k): the position committed at this step (False:
    padding, a position of the row that did not). A record may be a view of a record
    stacked over more rows (a running batch's fused rows, one gather for all of them:
    mlx_lm_diffusion.decoding.decoders.fused_commit): the decode's rows are then the arrays' rows
    [row_offset, row_offset + rows)."""

    __slots__ = ("positions", "valid", "logprobs", "_index", "row_offset", "rows")

    def __init__(
        self, positions: mx.array, valid: mx.array, logprobs: mx.array, row_offset: int = 0, rows: Optional[int] = None
    ):
        self.positions, self.valid, self.logprobs = positions, valid, logprobs
        self.row_offset, self.rows = row_offset, rows
        self._index: Optional[dict] = None  # {(row, position): slot}, built on the first lookup

    def arrays(self) -> tuple:
        return self.positions, self.valid, self.logprobs

    def own(self) -> tuple:
        """(positions, valid, logprobs) of the decode's rows only (sliced from a stacked record)."""
        if self.row_offset == 0 and self.rows in (None, self.positions.shape[0]):
            return self.arrays()
        lo, hi = self.row_offset, self.row_offset + self.rows
        return self.positions[lo:hi], self.valid[lo:hi], self.logprobs[lo:hi]

    def index(self) -> dict:
        """{(row, position): slot} of the committed positions (read back once; by then
        the step that built them has been evaluated)."""
        if self._index is None:
            positions, valid, _ = self.own()
            positions, valid = np.array(positions), np.array(valid)
            rows, slots = np.nonzero(valid)
            self._index = {(int(r), int(positions[r, s])): int(s) for r, s in zip(rows, slots)}
        return self._index


class KeptLogprobs:
    """A block's kept log-probs: its steps' records, oldest first (immutable: `add`
    returns a new one, so a step that was handed out never changes)."""

    __slots__ = ("rows", "width", "vocab", "records", "_dense")

    def __init__(self, rows: int, width: int, vocab: int, records: tuple = ()):
        self.rows, self.width, self.vocab, self.records = rows, width, vocab, records
        self._dense: Optional[mx.array] = None

    def add(self, record: Optional[KeptRows]) -> "KeptLogprobs":
        if record is None:
            return self
        return KeptLogprobs(self.rows, self.width, self.vocab, self.records + (record,))

    def latest_arrays(self) -> tuple:
        """The newest record's arrays (what a step queues; older ones are evaluated)."""
        return self.records[-1].arrays() if self.records else ()

    def find(self, row: int, position: int) -> Optional[tuple]:
        """(record, slot) of the latest commit of block `position` in `row`, or None."""
        for record in reversed(self.records):
            slot = record.index().get((row, position))
            if slot is not None:
                return record, slot
        return None

    def row(self, row: int, position: int) -> mx.array:
        """(V,) the log-probs of block `position` at its latest commit (zeros: never committed)."""
        found = self.find(row, position)
        if found is None:
            return mx.zeros((self.vocab,), mx.float32)
        record, slot = found
        return record.logprobs[record.row_offset + row, slot]

    def values(self, row: int, positions: range, tokens: np.ndarray) -> list[float]:
        """The log-prob of `tokens[i]` at block position `positions[i]`, on the host (each
        record's array is read as numpy once: an MLX op per token would wait each time)."""
        host: dict = {}
        out = []
        for position, token in zip(positions, tokens.tolist()):
            found = self.find(row, position)
            if found is None:
                out.append(0.0)
                continue
            record, slot = found
            if id(record) not in host:
                host[id(record)] = np.asarray(record.logprobs)
            out.append(float(host[id(record)][record.row_offset + row, slot, token]))
        return out

    def dense(self) -> mx.array:
        """(B, width, V) every position's log-probs at its latest commit, zeros elsewhere."""
        if self._dense is None:
            dense = mx.zeros((self.rows, self.width, self.vocab), mx.float32)
            for record in self.records:
                positions, valid, logprobs = record.own()
                index = positions[..., None]
                now = mx.take_along_axis(dense, index, axis=1)
                new = mx.where(valid[..., None], logprobs, now)
                dense = mx.put_along_axis(dense, index, new, axis=1)
            self._dense = dense
        return self._dense


def committed_rows(
    commit: mx.array, rows: Optional[mx.array], count: int, take_logprobs: Callable[[mx.array], mx.array]
) -> Optional[KeptRows]:
    """The record of a step that committed `commit` (B, W) (at most `count` per row,
    known on the host). `rows` (B, R): the block positions the step's log-probs cover
    (None: all W, in order); `take_logprobs(slots (B, k))` gives their log-probs at
    those slots (B, k, V)."""
    if count <= 0:
        return None
    read = commit if rows is None else take_rows(commit, rows)  # (B, R): the committed slots
    slots = read_positions(read, bucket(count, read.shape[1]))
    positions = slots if rows is None else mx.take_along_axis(rows, slots, axis=1)
    return KeptRows(positions, mx.take_along_axis(read, slots, axis=1), take_logprobs(slots))


def committed_rows_read_back(
    commit: np.ndarray, rows: Optional[np.ndarray], take_logprobs: Callable[[mx.array], mx.array]
) -> Optional[KeptRows]:
    """`committed_rows` for a step whose commits were read back (host arrays: `commit`
    (B, W), `rows` (B, R) or None): the same record, slot for slot, its positions and
    slots found on the host; the device gathers the log-probs only (a step of the
    threshold rule, whose commit count only its commits tell, built some thirty small
    MLX operations for positions it had already read back)."""
    read = commit if rows is None else np.take_along_axis(commit, rows, axis=1)  # (B, R): the committed slots
    count = int(read.sum(axis=1).max()) if read.size else 0
    if count <= 0:
        return None
    # read_positions' order: each row's committed slots in order, then the others in order
    slots = np.argsort(~read, axis=1, kind="stable")[:, : bucket(count, read.shape[1])].astype(np.int32)
    positions = slots if rows is None else np.take_along_axis(rows, slots, axis=1)
    return KeptRows(
        mx.array(positions.astype(np.int32)),
        mx.array(np.take_along_axis(read, slots, axis=1)),
        take_logprobs(mx.array(slots)),
    )


def whole_block(logprobs: mx.array) -> KeptRows:
    """The record of a step that committed every position of the block (B, W, V)."""
    B, W = logprobs.shape[:2]
    positions = mx.broadcast_to(mx.arange(W, dtype=mx.int32)[None], (B, W))
    return KeptRows(positions, mx.ones((B, W), dtype=mx.bool_), logprobs)


def kept_arrays(kept) -> tuple:
    """The arrays to evaluate for a step's kept log-probs (a KeptLogprobs's newest
    record, or a dense array)."""
    if kept is None:
        return ()
    return kept.latest_arrays() if isinstance(kept, KeptLogprobs) else (kept,)


__all__ = ["KeptRows", "KeptLogprobs", "committed_rows", "committed_rows_read_back", "whole_block", "kept_arrays"]
