"""The one decoding loop shared by every family.

A batched canvas (B, P + N) starts as the prompt followed by N masks. Blocks are
walked left to right; at each step the adapter predicts the block, token_stats
proposes, a commit rule selects, and the selection is written into the canvas.
The loop yields a `Step` after every forward: the draft canvas, how many
generated tokens per row are final (can no longer change), and the forward count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np
from mlx_arsenal.diffusion import block_ranges, token_stats

from model_adapters import Adapter

from .commit_rules import StepInputs
from .options import ResolvedOptions


@dataclass
class Step:
    """The state of a decode after one model forward."""

    canvas: np.ndarray  # (B, P + N) draft: committed tokens and mask ids
    prompt_len: int
    final: np.ndarray  # (B,) generated tokens per row that can no longer change
    done: np.ndarray  # (B,) rows that finished (EOS in their final prefix, or full)
    forwards: int
    block: tuple[int, int]
    step: int  # step index within the block
    block_logprobs: Optional[mx.array] = None  # (B, block, V) log-probs each token had at commit

    def logprobs(self, row: int, position: int) -> Optional[mx.array]:
        """(V,) log-probs of the token at `position` when it was committed. Every token
        becomes final while its block is current, so this covers every emitted token."""
        start, end = self.block
        if self.block_logprobs is None or not start <= position < end:
            return None
        return self.block_logprobs[row, position - start]


class Engine:
    """Runs one resolved decode through an adapter; iterate `run()` for the steps."""

    def __init__(self, adapter: Adapter, options: ResolvedOptions, keep_logprobs: bool = True):
        if adapter.mask_id is None:
            raise ValueError(f"{adapter.family} has no mask token; it cannot use a masked canvas")
        self.adapter = adapter
        self.options = options
        self.keep_logprobs = keep_logprobs

    def run(self, prompt: mx.array) -> Iterator[Step]:
        a, o = self.adapter, self.options
        if prompt.ndim != 2 or prompt.shape[1] < 1:
            raise ValueError("prompt must be a (B, P) array of token ids with P >= 1")
        B, P = prompt.shape
        N = o.max_tokens
        if o.seed is not None:
            mx.random.seed(o.seed)
        canvas = mx.concatenate([prompt.astype(mx.int32), mx.full((B, N), a.mask_id, mx.int32)], 1)
        state = a.start(prompt)
        host = np.array(canvas)
        final = np.zeros(B, dtype=np.int64)
        done = np.zeros(B, dtype=bool)
        forwards = 0
        suppress = mx.zeros((a.vocab_size,), mx.float32)
        suppress[a.mask_id] = -mx.inf  # the mask token is never proposed

        for start, end in block_ranges(P, N, o.block_length, align=a.align_blocks):
            if done.all():
                break
            rule = o.rule
            rule.start_block(mx.array(self._candidates(host, start, end, done)), o.steps)
            kept = mx.zeros((B, end - start, a.vocab_size)) if self.keep_logprobs else None
            step = 0
            while True:
                open_rows = self._candidates(host, start, end, done)
                if not open_rows.any():
                    break
                candidates = mx.array(open_rows)
                if o.rule.fixed_steps and step >= o.steps:
                    raise RuntimeError(f"{rule.name} left masks after its {o.steps} steps")
                if not o.rule.fixed_steps and step >= end - start:
                    raise RuntimeError(f"{rule.name} made no progress in a step")
                logits = a.predict(state, canvas, start, end)
                forwards += 1
                logits = self._process(logits, host, P) + suppress
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                x0, prob, entropy = self._propose(logprobs)
                commit = rule.select(
                    StepInputs(x0, prob, entropy, logprobs, candidates, step, o.steps)
                )
                block = mx.where(commit, x0, canvas[:, start:end])
                canvas = mx.concatenate([canvas[:, :start], block, canvas[:, end:]], axis=1)
                if kept is not None:
                    kept = mx.where(commit[..., None], logprobs, kept)
                mx.eval(canvas, kept)  # the one host sync of a step
                host = np.array(canvas)
                final, done = self._finality(host, P)
                yield Step(host, P, final, done, forwards, (start, end), step, kept)
                step += 1
            a.finish_block(state, canvas, start, end)

    def _candidates(self, host: np.ndarray, start: int, end: int, done: np.ndarray) -> np.ndarray:
        """Masked positions of the block in rows that are still decoding."""
        return (host[:, start:end] == self.adapter.mask_id) & ~done[:, None]

    def _process(self, logits: mx.array, host: np.ndarray, P: int) -> mx.array:
        """mlx-lm logits processors, per row, over the row's committed tokens."""
        logits = logits.astype(mx.float32)
        if not self.options.logits_processors:
            return logits
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
        """Proposed tokens with their temperature-1 probability and the entropy."""
        stats = token_stats(logprobs)
        sampler = self.options.sampler
        if sampler is None:
            return stats.x0, stats.prob, stats.entropy
        B, L, V = logprobs.shape
        x0 = sampler(logprobs.reshape(B * L, V)).reshape(B, L).astype(mx.int32)
        prob = mx.exp(mx.take_along_axis(logprobs, x0[..., None], axis=-1)[..., 0])
        return x0, prob, stats.entropy

    def _finality(self, host: np.ndarray, P: int) -> tuple[np.ndarray, np.ndarray]:
        """Final = the committed prefix of the generation, up to and including its first
        EOS; a row is done once that prefix holds an EOS or covers the whole canvas."""
        gen = host[:, P:]
        masked = gen == self.adapter.mask_id
        N = gen.shape[1]
        prefix = np.where(masked.any(axis=1), masked.argmax(axis=1), N)
        final = prefix.copy()
        done = prefix == N
        eos = np.isin(gen, list(self.adapter.eos_ids)) if self.adapter.eos_ids else None
        for b in range(gen.shape[0]):
            if eos is not None:
                hits = np.flatnonzero(eos[b, : prefix[b]])
                if hits.size:
                    final[b] = hits[0] + 1
                    done[b] = True
        return final, done
