"""Constrained decoding: an allowed-token set, and left-to-right logits processors.

Two kinds of constraint reach the decoders:

- `allowed_tokens` (a set of ids): every other id gets -inf before any proposal, in
  every decoder, so each generated token lies in the set. EOS ids are always allowed
  (a decode must be able to end); the mask token never is.
- mlx-lm logits processors, `processor(tokens, logits) -> logits`, called as mlx-lm's
  generate_step calls them: `tokens` the 1-D prompt plus every generated token so far,
  `logits` (1, V) for the next position. Many track a left-to-right state (outlines'
  JSON-schema and regex processors advance their automaton by the last token of each
  call; mlx-lm's repetition penalty reads the tokens), so they must be fed the canvas
  in order, one committed token per call, and never a token that is later retracted.

`LeftToRight.verify` keeps a masked-block step parallel under such processors, as a
draft is verified in speculative decoding. The model proposes every masked position
of the block at once and the commit rule selects the confident ones; then, per row,
from the first masked position on, the processors are fed the committed prefix and
score the next position: a proposal they accept is committed and fed, and the walk
goes on to the next position while the rule selected it; the first proposal they
reject is replaced by a token proposed from the processed logits (the correction,
committed too) and the walk stops. The first masked position always commits, so a
step commits at least one token per row, and commits only ever extend the
left-to-right prefix, so every token the processors were fed stays.

Accepting: greedy decoding accepts a proposal that is the processed argmax (the
output is then what left-to-right greedy decoding with the processors picks from the
same logits). Sampled decoding (a sampler, e.g. the argmax sampler mlx_lm.server passes
at temperature 0): where the processors only removed ids (grammars, allowed sets:
`masks_only`), a proposal they allow is accepted, which is exact (a draw from the
logits kept where allowed, else drawn again from the processed ones, is a draw from the
processed distribution); where they reweight (a logit bias, a repetition penalty), the
token is drawn from the processed log-probs with the sampler and the walk goes on only
if it is the proposal: each committed token is then the sampler's draw from the
processed logits, as left-to-right decoding with the processors draws it.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.decoders.base import Canvas, allowed_bias, log_softmax  # noqa: F401 (allowed_bias: the allowed-token set)


class LeftToRight:
    """Feeds mlx-lm logits processors one committed position at a time (see the module
    docstring); `propose(logprobs (1, 1, V)) -> (1, 1)` draws a correction the way the
    decoder proposes tokens, `greedy` says whether it is an argmax."""

    def __init__(self, processors: Sequence[Callable], eos_ids: frozenset, greedy: bool):
        self.processors = tuple(processors)
        self.eos_ids = eos_ids
        self.greedy = greedy

    def apply(self, history: np.ndarray, logits: mx.array) -> mx.array:
        """(1, V) processed logits of the position after `history` (prompt + committed)."""
        tokens = mx.array(history.astype(np.int32))
        for processor in self.processors:
            logits = processor(tokens, logits)
        return logits

    def seed(self, canvas: Canvas, logits: mx.array, position: int, live: np.ndarray) -> mx.array:
        """(B, 1, V) processed logits for `position` in the rows that commit it (`live`):
        a block's first token proposed by an earlier causal pass (Adapter.block_seed)."""
        host = canvas.sync()
        rows = [
            self.apply(host[r, :position], logits[r, :1]) if live[r] else logits[r, :1] for r in range(logits.shape[0])
        ]
        return mx.stack(rows)

    def verify(
        self,
        canvas: Canvas,
        start: int,
        commit: mx.array,
        x0: mx.array,
        logits: mx.array,
        logprobs: mx.array,
        propose: Callable[[mx.array], mx.array],
        mask_id: int,
    ):
        """The step's commits under the processors: (commit, tokens, logprobs) with the
        accepted proposals and corrections (their log-probs the processed ones)."""
        host = canvas.sync()
        selected, proposals = np.array(commit), np.array(x0)
        out_commit = np.zeros_like(selected)
        tokens = proposals.copy()
        for row in np.flatnonzero(~canvas.done):
            masked = np.flatnonzero(host[row, start : start + selected.shape[1]] == mask_id)
            if masked.size == 0:
                continue
            history = list(host[row, : start + masked[0]])
            for k in range(masked[0], selected.shape[1]):
                if k > masked[0] and (not selected[row, k] or host[row, start + k] != mask_id):
                    break  # the rule left it masked: the walk stops before feeding anything
                processed = log_softmax(self.apply(np.array(history), logits[row, k][None]))
                token, accepted = self._accept(logits[row, k][None], processed, int(proposals[row, k]), propose)
                logprobs[row, k] = processed[0]
                tokens[row, k], out_commit[row, k] = token, True
                history.append(token)
                if not accepted or token in self.eos_ids:
                    break
        return mx.array(out_commit), mx.array(tokens), logprobs

    def _accept(self, logits: mx.array, processed: mx.array, proposal: int, propose: Callable) -> tuple[int, bool]:
        """(the token committed, whether it is the proposal) at one position: `logits`
        (1, V) the step's, `processed` (1, V) the processors' log-probs of them."""
        if self.greedy:
            best = int(mx.argmax(processed[0]).item())
            return best, best == proposal
        if masks_only(log_softmax(logits), processed):
            if bool(mx.isfinite(processed[0, proposal]).item()):
                return proposal, True
            return int(propose(processed[None])[0, 0].item()), False
        # reweighted: the proposal came from other probabilities; draw from the processed
        # ones (as left-to-right sampling with the processors does) and walk on if it agrees
        token = int(propose(processed[None])[0, 0].item())
        return token, token == proposal


def masks_only(logprobs: mx.array, processed: mx.array, tolerance: float = 1e-3) -> bool:
    """Whether `processed` (log-probs) is `logprobs` with ids removed and nothing else: the
    same differences between the ids both allow (a constant: the renormalization), none
    allowed that `logprobs` did not. Then a proposal drawn from `logprobs` and kept where
    allowed (else drawn again from `processed`) is distributed as `processed`."""
    kept, allowed = mx.isfinite(logprobs), mx.isfinite(processed)
    both = kept & allowed
    if bool(mx.any(allowed & ~kept).item()) or not bool(mx.any(both).item()):
        return False
    shift = processed - logprobs
    spread = mx.max(mx.where(both, shift, -mx.inf)) - mx.min(mx.where(both, shift, mx.inf))
    return bool((spread <= tolerance).item())


__all__ = ["allowed_bias", "LeftToRight"]
