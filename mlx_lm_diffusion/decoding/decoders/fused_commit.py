"""A running batch's commit step, fused across rows.

A masked-block step is a model forward and then, per row, its commit: the LM head at the
block's positions, log-softmax, the proposal and its confidence, the commit rule's
selection and the writes (MaskedBlockDecoder._step). At test sizes each of those is a
small op, and a batch of R rows decoded row by row builds about thirty of them per row
and step. Here rows whose step is plain (greedy proposal, no logits processors, no
editing, no temperature schedule: `fusable`) hand their step to the batch instead
(`row_step` yields a `FusedForward`); the batch answers all of them at once
(`commit_rows`): one log-softmax and proposal over the stacked logits (R, W, V), one rule
selection per group of rows that share a rule (the rule's per-row state, a quota, stacked
as a per-row count), one set of writes, so the op count of a step no longer grows with R
but for each row's slice of the result.

A fused row commits exactly what MaskedBlockDecoder._step commits for it alone: the same
log-probs, proposal, candidates and rule (`select` sees the rows' quotas at their own
steps, `StepInputs.step` is then 0 of a one-column quota). Dream's deterministic rules
(their state: timesteps) are selected row by row, still on the stacked proposal; rules
that draw random numbers (random remasking, Dream's with alg_temp, origin) are not fused:
a row's draws come from its own key.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.commit_rules import (
    DreamConfidence,
    DreamOrigin,
    Quota,
    StepInputs,
)
from mlx_lm_diffusion.decoding.decoders.base import Forward, greedy_proposal, log_softmax, normalized_entropy
from mlx_lm_diffusion.decoding.decoders.gathered_rows import bucket, read_positions, take_rows
from mlx_lm_diffusion.decoding.decoders.kept_logprobs import KeptRows
from model_adapters import ThreadTables, bounded_compile

# Which rules select for several rows at once, and how, each rule declares on itself
# (CommitRule.joint: "quota", a per-row count at the step, stacked over rows here, or
# "stateless", no state and no step; CommitRule.compiled: through one compiled function).


@dataclass
class RowCommit:
    """One row's step, everything but its logits: what `commit_rows` needs."""

    rule: Any
    rule_state: Any
    step: int
    steps: int
    masked: np.ndarray  # (1,) masks left in the block (host)
    # (1, W) masked positions that may commit, and the block's tokens now: numpy arrays
    # when the row's host copy of its canvas is current (the batch stacks them on the host
    # and hands the device one array, instead of a slice and a compare per row)
    candidates: Any
    block: Any
    kept: Any  # the row's kept log-probs (decoders.kept_logprobs), or None: none are kept
    confidence: mx.array  # (1, W)
    takes_all: bool  # every candidate commits (the rule's count covers the masks)
    bias: Optional[mx.array]  # (V,) added to the float32 logits (suppressed / disallowed ids)
    committed: Optional[np.ndarray] = None  # (1,) how many it commits, when the rule knows beforehand


@dataclass
class FusedForward(Forward):
    """A forward request whose commit the batch does (reply: a `Committed`). `host`: the
    host copy of `canvas` when it is current (a batched forward builds its token matrix
    from it on the host), else None."""

    commit: Optional[RowCommit] = None
    host: Optional[np.ndarray] = None


@dataclass
class Committed:
    """A fused row's step, answered: the block's new tokens and confidence, what it
    committed (1, W) and, when log-probs are kept, `take(slots (1, k))`: the row's
    log-probs at those block positions (the row records its commits' only)."""

    block: mx.array
    confidence: mx.array
    commit: mx.array
    take: Optional[Callable[[mx.array], mx.array]] = None
    # the record of its commits' log-probs (a view of one record for every such row of its
    # group, kept_logprobs.KeptRows), built when first asked; None: use `take`
    record: Optional[Callable[[], Any]] = None


def fusable(decoder: Any) -> bool:
    """Whether the decoder's steps are plain enough to be committed by the batch."""
    o = decoder.options
    return (
        o.sampler is None
        and o.temperature_schedule is None
        and decoder.ordered is None
        and not decoder.editing
        and deterministic_rule(o.rule)
    )


def deterministic_rule(rule: Any) -> bool:
    """Rules that draw no random numbers: a row's draws come from its own key, which only
    its own code holds (mlx_lm_diffusion.decoding.batch)."""
    if _joint(rule):
        return True
    return isinstance(rule, DreamConfidence) and not isinstance(rule, DreamOrigin) and rule.alg_temp == 0


def row_step(decoder: Any, state: Any, canvas: Any, b: Any):
    """MaskedBlockDecoder._step for a fusable row of a running batch (a generator: it
    yields a FusedForward and receives its Committed). Returns False (nothing edited)."""
    o, rule = decoder.options, decoder.options.rule
    committed = rule.known_commits(b.rule_state, b.step, o.steps, b.masked)
    takes_all = committed is not None and bool((committed == b.masked).all())
    host = canvas.host if canvas.synced is canvas.tokens else None  # (None: a write not read back yet)
    if host is not None:  # (what decoder._candidates builds on the device, from the host copy)
        candidates = b.first_open if b.step == 0 else canvas.open_rows(b.start, b.end, decoder.adapter.mask_id)
        block = host[:, b.start : b.end]
    else:
        candidates, block = decoder._candidates(canvas, b), canvas.tokens[:, b.start : b.end]
    plan = RowCommit(
        rule,
        b.rule_state,
        b.step,
        o.steps,
        b.masked,
        candidates,
        block,
        b.kept,
        b.confidence,
        takes_all,
        _bias(decoder),
        committed,
    )
    result = yield FusedForward(state, canvas.tokens, b.start, b.end, commit=plan, host=host)
    canvas.forwards += 1
    canvas.write(result.block, b.start)
    b.confidence = result.confidence
    yield from decoder._count_open(canvas, b, committed)
    if result.record is not None:  # (after the read-back: a count only the commits tell is read then)
        b.kept = b.kept.add(result.record())
    elif result.take is not None:
        decoder._keep(b, result.commit, None, committed, result.take)
    return False


def _bias(decoder: Any) -> Optional[mx.array]:
    """What `process` and `_suppressed` add to float32 logits, as one (V,) vector."""
    parts = [p for p in (decoder.allowed_bias, decoder.suppress) if p is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def commit_rows(plans: Sequence[RowCommit], logits: Sequence[mx.array], origins: Optional[Sequence] = None) -> list:
    """Every fused row's Committed, from its plan and its logits (1, W_i, V). Rows of
    one block width are stacked and committed together. `origins`, optional: per row,
    (stacked, index) when its logits are stacked[index : index + 1, :W_i] (one head call
    for the batch, model_adapters.runtime.batched.RowLogits), so the stack is taken, not rebuilt."""
    out: list = [None] * len(plans)
    groups: dict = {}
    for i, plan in enumerate(plans):
        groups.setdefault(plan.block.shape[1], []).append(i)
    for rows in groups.values():
        stacked = _from_origin([origins[i] for i in rows], plans[rows[0]].block.shape[1]) if origins else None
        if stacked is None:
            stacked = _stack([logits[i] for i in rows])
        for i, result in zip(rows, _commit_group([plans[i] for i in rows], stacked)):
            out[i] = result
    return out


def _from_origin(origins: list, width: int) -> Optional[mx.array]:
    """The rows' logits (R, width, V) read off their common stacked array, or None."""
    if any(o is None for o in origins) or any(o[0] is not origins[0][0] for o in origins):
        return None
    source, index = origins[0][0], [o[1] for o in origins]
    if index != list(range(source.shape[0])):
        source = mx.take(source, mx.array(index), axis=0)
    return source if source.shape[1] == width else source[:, :width]


def _stack(arrays: list) -> mx.array:
    if all(isinstance(a, np.ndarray) for a in arrays):  # (host copies: one array for the device)
        return mx.array(arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0))
    arrays = [mx.array(a) if isinstance(a, np.ndarray) else a for a in arrays]
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=0)


def _commit_group(plans: list, stacked: mx.array) -> list:
    keep = any(p.kept is not None for p in plans)
    compiled = _compiled_commit(plans, stacked, keep) if COMPILE_COMMITS else None
    if compiled is not None:
        block, confidence, commit, *rest = compiled
        logprobs = rest[0] if keep else None
    else:
        block, confidence, commit, logprobs = _commit_ops(plans, stacked)
    records = _shared_records(plans, commit, logprobs) if keep else [None] * len(plans)
    return [
        Committed(
            block[i : i + 1],
            confidence[i : i + 1],
            commit[i : i + 1],
            partial(_row_logprobs, logprobs, i) if p.kept is not None else None,  # (rows whose caller reads log-probs)
            records[i],
        )
        for i, p in enumerate(plans)
    ]


def _commit_ops(plans: list, stacked: mx.array) -> tuple:
    """The group's (block, confidence, commit, logprobs), op by op."""
    if stacked.dtype != mx.float32:
        stacked = stacked.astype(mx.float32)
    biases = [p.bias for p in plans]
    if any(bias is not None for bias in biases):
        if all(bias is biases[0] for bias in biases):
            stacked = stacked + biases[0]
        else:
            zeros = mx.zeros((stacked.shape[-1],), mx.float32)
            stacked = stacked + mx.stack([zeros if bias is None else bias for bias in biases])[:, None, :]
    logprobs = log_softmax(stacked)
    x0, prob = greedy_proposal(logprobs)
    candidates = _stack([p.candidates for p in plans])
    commit = _select(plans, x0, prob, logprobs, candidates)
    block = mx.where(commit, x0, _stack([p.block for p in plans]))
    confidence = mx.where(commit, prob, _stack([p.confidence for p in plans]))
    return block, confidence, commit, logprobs


# Commit a group whose rows share one rule through mx.compile (`_compiled_commit`)
COMPILE_COMMITS = True
MAX_COMMIT_FUNCTIONS = 32  # compiled commit functions kept (per rule, quota and bias kind)
# distinct input shapes (rows, block width, vocabulary, dtype) one compiled commit keeps
# traced before it is made afresh (its traces freed with it), as batched._compiled's forwards
MAX_COMMIT_TRACES = 64
# per thread (thread_compiled): key -> (compiled function, the input shapes it has traced)
_commit_functions = ThreadTables()


def _compiled_commit(plans: list, stacked: mx.array, keep: bool) -> Optional[tuple]:
    """`_commit_ops`' (block, confidence, commit[, logprobs]) through one compiled
    function, or None where the group does not fit one: its rows must share one joint
    rule (or take all their candidates), one bias (or none) and, for a quota rule, one
    quota at their steps (a plain int: the trace holds it). On MLX's CPU backend each op
    of a step is dispatched from the caller's thread: compiled, the commit's elementwise
    runs are fused and its graph is not rebuilt in Python each step (the same values bit
    for bit: tests/decoding/test_batch_ops.py). MLX keeps one trace per input shape."""
    selecting = [p for p in plans if not p.takes_all]
    rule = (selecting or plans)[0].rule
    if not type(rule).compiled or any(_rule_key(p.rule) != _rule_key(rule) for p in selecting):
        return None
    bias = plans[0].bias
    if any(p.bias is not bias for p in plans):
        return None
    quota = None
    if _quota(rule):
        quotas = {int(p.rule_state.host[0, p.step]) for p in selecting}
        if len(quotas) > 1:
            return None
        quota = quotas.pop() if quotas else 0
    steps = (selecting or plans)[0].steps  # (the step budget StepInputs shows, as _select's)
    key = (_rule_key(rule), quota, bias is not None, keep, steps)
    table = _commit_functions.table()
    if key not in table and len(table) >= MAX_COMMIT_FUNCTIONS:
        table.clear()
    function = bounded_compile(
        table,
        key,
        lambda: _pure_commit(rule, quota, steps, keep),
        (tuple(stacked.shape), stacked.dtype),
        MAX_COMMIT_TRACES,
    )
    takes_all = mx.array(np.array([p.takes_all for p in plans]))
    inputs = [
        stacked,
        _stack([p.candidates for p in plans]),
        _stack([p.block for p in plans]),
        _stack([p.confidence for p in plans]),
        takes_all,
    ]
    return function(*inputs, *([bias] if bias is not None else []))


def _pure_commit(rule: Any, quota: Optional[int], steps: int, keep: bool) -> Callable:
    """`_commit_ops` for rows sharing `rule` as a pure function of arrays (what mx.compile
    traces): the rule selects at step 0 of a one-column quota holding `quota`."""

    def commit(stacked, candidates, block, confidence, takes_all, *bias):
        if stacked.dtype != mx.float32:
            stacked = stacked.astype(mx.float32)
        if bias:
            stacked = stacked + bias[0]
        logprobs = log_softmax(stacked)
        x0, prob = greedy_proposal(logprobs)
        state = None
        if quota is not None:
            column = np.full((candidates.shape[0], 1), quota, dtype=np.int32)
            state = Quota(mx.array(column), column)
        inputs = StepInputs(x0, prob, normalized_entropy(logprobs), logprobs, candidates, 0, steps, None)
        selected = mx.where(takes_all[:, None], candidates, rule.select(inputs, state))
        block = mx.where(selected, x0, block)
        confidence = mx.where(selected, prob, confidence)
        return (block, confidence, selected, logprobs) if keep else (block, confidence, selected)

    return commit


class SharedRecord:
    """The kept log-probs of the commits of every row of a commit group that keeps them, as
    one record (kept_logprobs.committed_rows over the stacked commits: one gather of the
    positions and one of the log-probs for all rows, each row's record a view of it),
    built when the first row asks, once the commit counts are known on the host. Each
    row's committed positions and their vectors are those of its own record: its slots
    are the first of the same per-row order, and the more slots another row needs are
    padding (not valid) in this one."""

    def __init__(self, rows: list, counts: list, commit: mx.array, logprobs: mx.array):
        self.rows = rows  # the group's rows that keep log-probs, in order
        self.counts = counts  # per such row, (1,) host commit counts, or None: read from `commit`
        self.commit, self.logprobs = commit, logprobs
        self.views: Optional[dict] = None

    def view(self, row: int):
        if self.views is None:
            self.views = self._build()
        return self.views[row]

    def _build(self) -> dict:
        take = None if self.rows == list(range(self.commit.shape[0])) else mx.array(self.rows)
        commit = _pick_rows(self.commit, take)
        if any(c is None for c in self.counts):  # (the rows' counts: their step was read back)
            counts = np.array(self.commit)[self.rows].sum(axis=1)
        else:
            counts = np.concatenate([np.asarray(c).reshape(-1) for c in self.counts])
        most = int(counts.max()) if counts.size else 0
        if most <= 0:
            return dict.fromkeys(self.rows)
        slots = read_positions(commit, bucket(most, commit.shape[1]))
        stacked = (slots, mx.take_along_axis(commit, slots, axis=1), take_rows(_pick_rows(self.logprobs, take), slots))
        return {
            row: KeptRows(*stacked, row_offset=j, rows=1) if counts[j] > 0 else None for j, row in enumerate(self.rows)
        }


def _shared_records(plans: list, commit: mx.array, logprobs: mx.array) -> list:
    """Per row, a thunk giving its record of a SharedRecord, or None (the row keeps no
    log-probs, or it is the only one of its kind: it records them itself). Rows whose
    commit counts are known beforehand share one record, and rows whose counts the commits
    tell share another: those read their step back before they record, and a record for
    both kinds would make the first kind wait for the second's read-back."""
    keeping = [i for i, p in enumerate(plans) if p.kept is not None]
    out: list = [None] * len(plans)
    for known in (True, False):
        rows = [i for i in keeping if (plans[i].committed is not None) == known]
        if len(rows) < 2:
            continue
        shared = SharedRecord(rows, [plans[i].committed for i in rows], commit, logprobs)
        for i in rows:
            out[i] = partial(shared.view, i)
    return out


def _pick_rows(a: mx.array, take: Optional[mx.array]) -> mx.array:
    """Rows `take` of `a` (along its first axis); all of `a` when `take` is None."""
    return a if take is None else mx.take(a, take, axis=0)


def _row_logprobs(logprobs: mx.array, row: int, slots: mx.array) -> mx.array:
    """(1, k, V) row `row` of the stacked log-probs (R, W, V) at the block positions `slots` (1, k)."""
    return take_rows(logprobs[row : row + 1], slots)


def _select(plans: list, x0, prob, logprobs, candidates) -> mx.array:
    """(R, W) commits: candidates where the rule takes them all, else the rule's
    selection, one call per group of rows with equal rules."""
    entropy = normalized_entropy(logprobs)  # (built lazily: only rules that read it evaluate it)
    parts: list = [None] * len(plans)
    groups: dict = {}
    for i, plan in enumerate(plans):
        if plan.takes_all:
            parts[i] = "all"
        elif _joint(plan.rule):
            groups.setdefault(_rule_key(plan.rule), []).append(i)
        else:
            groups.setdefault(("row", i), []).append(i)
    if not groups:
        return candidates
    masks = []
    index = {}
    for rows in groups.values():
        take = mx.array(rows) if len(rows) < len(plans) else None
        pick = partial(_pick_rows, take=take)
        first = plans[rows[0]]
        state, step = _joint_state([plans[i] for i in rows]) if _joint(first.rule) else (first.rule_state, first.step)
        masked = np.concatenate([plans[i].masked for i in rows])
        inputs = StepInputs(
            pick(x0), pick(prob), pick(entropy), pick(logprobs), pick(candidates), step, first.steps, masked
        )
        selected = first.rule.select(inputs, state)
        for j, i in enumerate(rows):
            index[i] = (len(masks), j)
        masks.append(selected)
    if len(masks) == 1 and len(groups[next(iter(groups))]) == len(plans):
        return masks[0]
    rows = []
    for i in range(len(plans)):
        if parts[i] == "all":
            rows.append(candidates[i : i + 1])
        else:
            m, j = index[i]
            rows.append(masks[m][j : j + 1])
    return mx.concatenate(rows, axis=0)


def _joint(rule: Any) -> bool:
    return type(rule).joint is not None


def _quota(rule: Any) -> bool:
    return type(rule).joint == "quota"


def _rule_key(rule: Any) -> tuple:
    return (type(rule), repr(rule))


def _joint_state(plans: list) -> tuple:
    """A state and step under which the rule selects every row as at its own step: the
    rows' quotas at their steps, as a one-column Quota read at step 0."""
    if not _quota(plans[0].rule):
        return None, 0
    quotas = np.array([[int(p.rule_state.host[0, p.step])] for p in plans], dtype=np.int32)
    return Quota(mx.array(quotas), quotas), 0
