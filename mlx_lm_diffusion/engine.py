"""The one decoding loop shared by every family.

A batched canvas (B, P + N) starts as the prompt followed by N masks. Blocks are
walked left to right; at each step the adapter predicts the block, normalized_stats
proposes, a commit rule selects, and the selection is written into the canvas.
The loop yields a `Step` after every forward: the draft canvas, how many
generated tokens per row are final (can no longer change), and the forward count.

Pipelining (as mlx-lm's generate_step does with async_eval): each step's arrays are
queued with `mx.async_eval`, and when the host can tell before a forward how many
tokens every row commits (quota rules, one-mask blocks: `CommitRule.known_commits`),
the next step's forward is queued before this step's tokens are read back, so the
Python work of a step overlaps the model's compute. It applies to single-row decodes
without logits processors or editing (their control flow reads every step's tokens);
the steps yielded are the same either way. A forward queued after the step that ends
the decode (an EOS, the max_tokens-th token) is dropped and not counted, as mlx-lm's
generate_step computes one token past the end.

Uniform-noise families (DiffusionGemma: no mask token, `options.uniform` set) walk
whole canvases instead, with the step body `_decode_canvas`; a canvas's tokens are
final once the canvas is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np
from mlx_arsenal.diffusion import (
    StableConfidentStopping,
    TokenStats,
    block_ranges,
    edit_transfer,
    linear_temperature,
    renoise,
    uniform_canvas,
)
from mlx_lm.sample_utils import apply_top_p

from model_adapters import Adapter

from .commit_rules import StepInputs
from .options import ResolvedOptions


@dataclass
class Step:
    """The state of a decode after one model forward."""

    canvas: np.ndarray  # (B, P + N) draft: committed tokens and mask ids (uniform noise:
    # the argmax drafts up to the end of the current canvas)
    prompt_len: int
    final: np.ndarray  # (B,) generated tokens per row that can no longer change
    done: np.ndarray  # (B,) rows that finished (EOS in their final prefix, or full)
    forwards: int
    block: tuple[int, int]
    step: int  # step index within the block
    block_logprobs: Optional[mx.array] = None  # (B, block, V) log-probs each token had at commit
    forward: bool = True  # False: a block-over event without a model forward
    block_confidence: Optional[mx.array] = None  # (B, block) each token's confidence at commit

    def logprobs(self, row: int, position: int) -> Optional[mx.array]:
        """(V,) log-probs of the token at `position` when it was committed. Every token
        becomes final while its block is current, so this covers every emitted token."""
        start, end = self.block
        if self.block_logprobs is None or not start <= position < end:
            return None
        return self.block_logprobs[row, position - start]


def normalized_stats(logprobs: mx.array) -> TokenStats:
    """mlx-arsenal's `token_stats` (argmax proposal, its probability and the entropy of
    the temperature-1 softmax) for log-probabilities that are already normalized:
    token_stats would normalize them again, a second exp pass over the vocabulary per
    position, which on CPU is the largest cost of a step at real vocabulary sizes."""
    x0, prob = greedy_proposal(logprobs)
    return TokenStats(x0, prob, normalized_entropy(logprobs))


def greedy_proposal(logprobs: mx.array) -> tuple[mx.array, mx.array]:
    x0 = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    return x0, mx.exp(mx.max(logprobs, axis=-1))  # (the probability at the argmax)


def normalized_entropy(logprobs: mx.array) -> mx.array:
    """Entropy of the temperature-1 softmax, built only where a rule reads it."""
    p = mx.exp(logprobs)
    return -mx.sum(mx.where(p > 0, p * logprobs, 0.0), axis=-1)


@dataclass
class _Queued:
    """A step whose arrays may still be computing (the Step's fields, canvas on device)."""

    canvas: mx.array
    kept: Optional[mx.array]
    confidence: mx.array
    forwards: int
    block: tuple[int, int]
    step: int
    block_over: bool
    forward: bool


class Engine:
    """Runs one resolved decode through an adapter; iterate `run()` for the steps."""

    def __init__(
        self, adapter: Adapter, options: ResolvedOptions, keep_logprobs: bool = True, pipeline: bool = True
    ):
        if adapter.mask_id is None and options.uniform is None:
            raise ValueError(f"{adapter.family} has no mask token; it cannot use a masked canvas")
        self.adapter = adapter
        self.options = options
        self.keep_logprobs = keep_logprobs
        self.pipeline = pipeline  # False: read every step back before building the next
        adapter.configure(options)  # family switches (e.g. Nemotron's causal_context)

    def run(self, prompt: mx.array) -> Iterator[Step]:
        a, o = self.adapter, self.options
        if prompt.ndim != 2 or prompt.shape[1] < 1:
            raise ValueError("prompt must be a (B, P) array of token ids with P >= 1")
        B, P = prompt.shape
        if o.seed is not None:
            mx.random.seed(o.seed)
        uniform = o.uniform is not None
        # a uniform-noise canvas is decoded whole (positions not reached yet hold 0)
        N = -(-o.max_tokens // o.block_length) * o.block_length if uniform else o.max_tokens
        if a.align_blocks and not uniform:  # block-diffusion references decode whole blocks
            whole = -(-(P + N) // o.block_length) * o.block_length
            N = max(N, min(whole, a.max_length or whole) - P)
        mask = mx.full((B, N), 0 if uniform else a.mask_id, mx.int32)
        self.canvas = mx.concatenate([prompt.astype(mx.int32), mask], axis=1)
        self.host = np.array(self.canvas)  # the host copy of the latest canvas read back
        self.synced = self.canvas  # ... which is this array
        self.prompt_len = P
        self.done = np.zeros(B, dtype=bool)
        self.final = np.zeros(B, dtype=np.int64)  # per row: generated tokens that are final
        self.forwards = 0
        self.suppress = None  # added to the logits: the mask token is never proposed
        if a.mask_id is not None and 0 <= a.mask_id < a.vocab_size:  # ("ar": outside the vocabulary)
            self.suppress = mx.zeros((a.vocab_size,), mx.float32)
            self.suppress[a.mask_id] = -mx.inf
        state = a.start(prompt)
        # A queued step runs ahead of the host only where a stale `done` cannot change it:
        # one row (its decode ends when it is done) and no per-step host reads.
        ahead = self.pipeline and B == 1 and not (o.logits_processors or o.editing_threshold or uniform)
        pending = None
        for queued in self._blocks(state, P, N):
            if pending is not None:
                yield self._land(pending)
                if self.done.all():
                    return  # the step queued after the row finished is dropped
            pending = queued
            if not ahead:
                yield self._land(pending)
                pending = None
        if pending is not None:
            yield self._land(pending)

    def _blocks(self, state, P: int, N: int) -> Iterator["_Queued"]:
        a, o = self.adapter, self.options
        decode = self._decode_canvas if o.uniform is not None else self._decode_block
        for start, end in block_ranges(P, N, o.block_length, align=a.align_blocks):
            if self.done.all():
                break
            yield from decode(state, start, end)
            a.finish_block(state, self.canvas, start, end)

    def _decode_block(self, state, start: int, end: int) -> Iterator["_Queued"]:
        """Steps until the block has no masks (and, with editing, no more edits)."""
        a, o, rule = self.adapter, self.options, self.options.rule
        editing = o.editing_threshold is not None
        B = self.host.shape[0]
        kept = mx.zeros((B, end - start, a.vocab_size)) if self.keep_logprobs else None
        self.confidence = mx.zeros((B, end - start))
        kept = self._seed(state, start, kept)
        # Nothing has written into this block since the canvas was built (or since _seed
        # read it back), so the host copy shows its masks even while a step is in flight.
        open_rows = self._open_rows(start, end)
        first_candidates = mx.array(open_rows)
        rule.start_block(first_candidates, o.steps)
        masked = open_rows.sum(axis=1)  # per row, kept on the host without reading tokens back
        # A bound no rule may exceed: a fixed schedule ends within its steps, the others
        # commit at least one token per step; editing adds at most max_post_steps passes.
        limit = (o.steps if rule.fixed_steps else end - start) + (o.max_post_steps + 1) * editing
        step = post_steps = 0
        while True:
            if self.done.any():  # rows that finished commit nothing more
                masked = np.where(self.done, 0, masked)
            has_mask = bool(masked.any())
            if not has_mask:
                post_steps += 1
                if not editing or post_steps > o.max_post_steps:
                    break
            if step >= limit:
                raise RuntimeError(f"{rule.name} did not finish a block within {limit} steps")
            x0, prob, logprobs = self._predict(state, start, end, step)
            committed = rule.known_commits(step, o.steps, masked) if has_mask else 0
            takes_all = has_mask and committed is not None and (committed == masked).all()
            edited = False
            if takes_all and step == 0 and open_rows.all() and not editing:
                # the step fills the whole block (at block length 1, every step): it is the proposal
                kept = self._apply(None, x0, prob, logprobs, kept, start, end)
            else:
                if step == 0:  # (the host copy of the block is current until its first commit)
                    candidates = first_candidates
                else:
                    candidates = (self.canvas[:, start:end] == a.mask_id) & mx.array(~self.done)[:, None]
                if not has_mask:
                    commit = mx.zeros(candidates.shape, dtype=mx.bool_)
                elif takes_all:
                    commit = candidates  # every candidate commits: no ranking can change that
                else:
                    entropy = normalized_entropy(logprobs)
                    commit = rule.select(StepInputs(x0, prob, entropy, logprobs, candidates, step, o.steps, masked))
                if editing:
                    block = self.canvas[:, start:end]
                    editable = (block != a.mask_id) & mx.array(~self.done)[:, None]
                    edit = edit_transfer(x0, prob, block, editable, o.editing_threshold)
                    commit = commit | edit
                    edited = bool(mx.any(edit).item())
                kept = self._apply(commit, x0, prob, logprobs, kept, start, end)
            if committed is None:  # this step's tokens decide: read them back
                self._sync()
                masked = self._open_rows(start, end).sum(axis=1)
            else:
                masked = masked - committed
            block_over = editing and not has_mask and not edited
            yield self._queue(start, end, step, kept, block_over)
            step += 1
            if block_over:
                return
        if editing or step == 0:  # the block is final now: an event releases its tokens
            yield self._queue(start, end, step, kept, True, forward=False)

    def _seed(self, state, start: int, kept):
        """Commit the block's first token when a causal pass already proposed it (the
        adapter's `block_seed`: Nemotron's causal context), in rows still decoding."""
        logits = self.adapter.block_seed(state, self.canvas, start)
        if logits is None:
            return kept
        logits = self._suppress(self._process(logits[:, None], start))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        x0, prob = self._propose(logprobs)
        open_row = mx.array(~self.done) & (self.canvas[:, start] == self.adapter.mask_id)
        seeded = mx.where(open_row, x0[:, 0], self.canvas[:, start])[:, None]
        # a new array, not an in-place write: a queued step may still hold the old canvas
        self.canvas = mx.concatenate([self.canvas[:, :start], seeded, self.canvas[:, start + 1 :]], axis=1)
        self.confidence[:, 0] = mx.where(open_row, prob[:, 0], self.confidence[:, 0])
        if kept is not None:
            kept[:, 0] = mx.where(open_row[:, None], logprobs[:, 0], kept[:, 0])
        mx.eval(self.canvas, kept, self.confidence)
        self._sync()
        return kept

    def _decode_canvas(self, state, start: int, end: int) -> Iterator["_Queued"]:
        """One uniform-noise canvas (Hugging Face's generation_diffusion_gemma.py): each
        step the model predicts every position of the noisy canvas, the logits are divided
        by a temperature linear in the remaining steps, a token is drawn everywhere, the
        rule accepts some of them (entropy_bound_transfer over all positions by default)
        and every other position is re-noised. A row stops once its argmax canvas is stable
        and confident (frozen from then on, as in the reference), the canvas once every row
        stopped or after `steps` steps; the argmax canvas is the draft and the output.
        Random draws follow the reference: the canvas, then per step the sample and the noise."""
        a, o, u = self.adapter, self.options, self.options.uniform
        B, L = self.host.shape[0], end - start
        stop = StableConfidentStopping(u.stability_threshold, u.confidence_threshold)
        noisy = uniform_canvas((B, L), a.vocab_size)
        stopped = mx.array(self.done)
        argmax, kept, self.confidence = self.canvas[:, start:end], None, mx.zeros((B, L))
        o.rule.start_block(mx.ones((B, L), dtype=mx.bool_), o.steps)
        for step in range(o.steps):
            canvas = mx.concatenate([self.canvas[:, :start], noisy, self.canvas[:, end:]], axis=1)
            logits = self._process(a.predict(state, canvas, start, end), start)
            self.forwards += 1
            z = logits / linear_temperature(o.steps - step, o.steps, t_min=u.t_min, t_max=u.t_max)
            a.condition(state, z)  # the model's self-conditioning input at the next step
            logprobs = z - mx.logsumexp(z, axis=-1, keepdims=True)
            stats = normalized_stats(logprobs)
            sample = self._draw(z, logprobs)
            prob = mx.exp(mx.take_along_axis(logprobs, sample[..., None], axis=-1)[..., 0])
            rows = mx.broadcast_to(~stopped[:, None], (B, L))
            accepted = o.rule.select(StepInputs(sample, prob, stats.entropy, logprobs, rows, step, o.steps))
            fresh = renoise(sample, accepted, uniform_canvas((B, L), a.vocab_size))
            frozen = stopped[:, None]
            argmax = mx.where(frozen, argmax, stats.x0)
            noisy = mx.where(frozen, noisy, fresh)
            self.confidence = mx.where(frozen, self.confidence, stats.prob)
            kept = logprobs if kept is None else mx.where(frozen[..., None], kept, logprobs)
            stopped = stopped | stop(argmax, stats.entropy)
            self.canvas = mx.concatenate([self.canvas[:, :start], argmax, self.canvas[:, end:]], axis=1)
            mx.eval(self.canvas, noisy, stopped, kept, self.confidence)
            self._sync()
            yield self._queue(start, end, step, kept if self.keep_logprobs else None, False)
            if bool(mx.all(stopped).item()):
                break
        # the canvas is final: one more event releases its tokens
        yield self._queue(start, end, step + 1, kept if self.keep_logprobs else None, True, forward=False)

    def _draw(self, z: mx.array, logprobs: mx.array) -> mx.array:
        """A token per position from softmax(z), as the reference draws; or the caller's sampler."""
        if self.options.sampler is None:
            return mx.random.categorical(z).astype(mx.int32)
        B, L, V = logprobs.shape
        return self.options.sampler(logprobs.reshape(B * L, V)).reshape(B, L).astype(mx.int32)

    def _predict(self, state, start: int, end: int, step: int):
        logits = self.adapter.predict(state, self.canvas, start, end)
        self.forwards += 1
        logits = self._suppress(self._process(logits, None))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        temperatures = self.options.temperature_schedule
        if temperatures is not None:
            temperature = temperatures[min(step, len(temperatures) - 1)]
            return (*self._propose_tempered(logprobs, temperature), logprobs)
        return (*self._propose(logprobs), logprobs)

    def _apply(self, commit: Optional[mx.array], x0, prob, logprobs, kept, start: int, end: int):
        """Write the committed proposals into the canvas (commit None: the whole block)."""
        if commit is None:
            block, kept, self.confidence = x0, None if kept is None else logprobs, prob
        else:
            block = mx.where(commit, x0, self.canvas[:, start:end])
            if kept is not None:
                kept = mx.where(commit[..., None], logprobs, kept)
            self.confidence = mx.where(commit, prob, self.confidence)
        self.canvas = mx.slice_update(self.canvas, block, mx.array([0, start]), axes=(0, 1))
        mx.async_eval(self.canvas, kept, self.confidence)  # computes while the host goes on
        return kept

    def _sync(self) -> np.ndarray:
        """Read the latest canvas back to the host (waits for the steps queued so far)."""
        if self.synced is not self.canvas:
            self.host, self.synced = np.array(self.canvas), self.canvas
        return self.host

    def _queue(self, start, end, step, kept, block_over: bool, forward: bool = True) -> "_Queued":
        return _Queued(self.canvas, kept, self.confidence, self.forwards, (start, end), step,
                       block_over, forward)

    def _land(self, q: "_Queued") -> Step:
        """The Step of a queued step, once its tokens are read back."""
        if q.canvas is self.canvas:  # the latest step: keep its host copy
            host = self._sync()
        else:  # an earlier step, read back while a later one is queued
            host = self.host if q.canvas is self.synced else np.array(q.canvas)
        start, end = q.block
        # With editing a token can change until its block is over: only earlier blocks
        # (and this one once it is over) are final.
        uniform = self.options.uniform is not None
        changing = self.options.editing_threshold is not None or uniform
        horizon = end if (q.block_over or not changing) else start
        final, self.done = self._finality(host, horizon)
        return Step(host[:, :end] if uniform else host, self.prompt_len, final, self.done.copy(),
                    q.forwards, q.block, q.step, q.kept, q.forward, q.confidence)

    def _open_rows(self, start: int, end: int) -> np.ndarray:
        """Masked positions of the block in rows still decoding, from the host copy."""
        return (self.host[:, start:end] == self.adapter.mask_id) & ~self.done[:, None]

    def _suppress(self, logits: mx.array) -> mx.array:
        return logits if self.suppress is None else logits + self.suppress

    def _process(self, logits: mx.array, stop: Optional[int]) -> mx.array:
        """mlx-lm logits processors, per row, over the row's committed tokens before `stop`."""
        if logits.dtype != mx.float32:
            logits = logits.astype(mx.float32)
        if not self.options.logits_processors:
            return logits
        host = self._sync()[:, :stop]
        rows = []
        for b in range(logits.shape[0]):
            row = host[b]
            history = mx.array(row[row != self.adapter.mask_id])
            out = logits[b]
            for processor in self.options.logits_processors:
                out = processor(history, out)
            rows.append(out)
        return mx.stack(rows)

    def _propose(self, logprobs: mx.array):
        """Proposed tokens with their temperature-1 probability."""
        sampler = self.options.sampler
        if sampler is None:
            return greedy_proposal(logprobs)
        B, L, V = logprobs.shape
        x0 = sampler(logprobs.reshape(B * L, V)).reshape(B, L).astype(mx.int32)
        prob = mx.exp(mx.take_along_axis(logprobs, x0[..., None], axis=-1)[..., 0])
        return x0, prob

    def _propose_tempered(self, logprobs: mx.array, temperature: float):
        """The step-schedule protocol's proposal: logits / temperature (greedy at 0),
        confidence = the largest tempered probability, tokens drawn with nucleus top_p."""
        if temperature == 0:
            return greedy_proposal(logprobs)
        tempered = logprobs / temperature
        tempered = tempered - mx.logsumexp(tempered, axis=-1, keepdims=True)
        confidence = mx.exp(mx.max(tempered, axis=-1))
        if self.options.top_p < 1.0:
            tempered = apply_top_p(tempered, self.options.top_p)
        x0 = mx.random.categorical(tempered).astype(mx.int32)
        return x0, confidence

    def _finality(self, host: np.ndarray, horizon: int) -> tuple[np.ndarray, np.ndarray]:
        """Final = the committed prefix of the generation before `horizon`, up to and
        including its first EOS; a row is done once that prefix holds an EOS or covers
        the whole canvas. Final tokens never change, so each call scans only the tokens
        after the last call's final prefix."""
        P, a = self.prompt_len, self.adapter
        N = min(host.shape[1] - P, self.options.max_tokens)  # (a uniform canvas may run past it)
        limit = min(horizon - P, N)
        final, done = self.final.copy(), self.done.copy()
        for b in range(len(done)):
            if done[b]:
                continue
            # (plain lists: a step usually adds one token, too few for numpy to pay off)
            for token in host[b, P + final[b] : P + limit].tolist():
                if token == a.mask_id:
                    break
                final[b] += 1
                if token in a.eos_ids:
                    done[b] = True
                    break
            done[b] = done[b] or final[b] == N
        self.final = final
        return final, done
