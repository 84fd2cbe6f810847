"""Introspective Strided Decoding (I-DLM): one causal forward per round drafts and verifies.

I-DLM's model is causal with the autoregressive shift (row i of a forward predicts position
i + 1), trained so that mask tokens after the last real one predict tokens further ahead. The
reference loop (thuEcstasy/I-DLM's SGLang `idlm_blockN.py`; the same loop as diffusers'
`IDLMPipeline` with `IDLMBlockDiffusionScheduler.step`), greedy, as done here:

- the prompt is encoded into the KV cache; its last row gives the first token, the *pending*
  one (final: it is the autoregressive argmax);
- each round is one causal forward over [pending, K drafts, N - 1 masks] on top of the cache.
  Row j < K verifies draft j (accepted while it equals the row's argmax, left to right); the
  first row that disagrees gives the correction. All K accepted: row K gives the next pending
  token and rows K + 1 .. K + N - 1 (the masks) the next N - 1 drafts. A rejection: the
  correction is the next pending token and the next round is cold (no drafts: [pending, N - 1
  masks]);
- the cache keeps the pending token and the accepted drafts; the rejected drafts' and the
  masks' keys and values are trimmed (the reference's `crop`).

Every token written is the argmax after a prefix of final tokens, on a causal model: the output
is greedy autoregressive decoding token for token (whatever the drafts), and a round commits
1 to N tokens. `block_length` is N. `forwards` counts the rounds (the prompt's pass is not
counted, as for every family).

Sampled (a sampler: temperature > 0, top_p, ...): every row of a round draws with the request's
sampler, the drafts are the mask rows' draws, and a draft is accepted while it equals its verify
row's draw; the first that differs is replaced by that draw. Each token written is then a draw
from the model's distribution after the tokens before it, exactly as autoregressive sampling with
the same sampler (tested by the distance between the two distributions), for any sampler, since
no probability ratio is needed. It accepts less often than the reference's rule (min(1, p / q)
with a residual resample, thuEcstasy/I-DLM `idlm_blockN.py`, which needs the proposal's
probabilities that an mlx-lm sampler does not expose): a draft drawn from q is kept with
probability sum_x q(x) p(x) rather than sum_x min(p(x), q(x)).

Trida2.0 / FLARE (model_adapters.families.qwen3_5_diffusion: the Qwen3.5 hybrid) decode with these rounds
too. Their mask rows see the whole window and read the gated-delta state at its end, so each
round's request says which leading rows are the causal ones (`Verify.clean`: the pending token
and the drafts; every row in a cold round, as trillion-labs/trida-stack's `selfspec_generate`).

The checks, scores and draft display are SpeculativeDecoder's (temperature schedules, commit
rules and logits processors are refused as there).
"""

from __future__ import annotations

from typing import Any, Iterator

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.decoders.base import Canvas, Queued, ReadBack, Verify, log_softmax
from mlx_lm_diffusion.decoding.decoders.speculative import REFUSED, SpeculativeDecoder

# what the rounds refuse: self-speculation's list, less the sampler (rows draw with it)
ISD_REFUSED = {name: why for name, why in REFUSED.items() if name != "sampler"}


class IntrospectiveDecoder(SpeculativeDecoder):
    name = "introspective"
    refused = ISD_REFUSED
    decoding, or_drop = "{family}'s introspective strided decoding", ""
    one_token_refusal = "{family} commits up to block_length tokens per round (N): give block_length >= 2"

    def block_step_bound(self, width: int) -> int:
        # the first token is the prompt's; every round writes one token at least
        return max(width - 1, 0)

    def decode_block(self, state: Any, canvas: Canvas, start: int, end: int) -> Iterator:
        if canvas.rows != 1:
            raise ValueError("I-DLM decodes one row at a time (each row accepts its own drafts)")
        yield self._seed(state, canvas, start)
        strides = self.options.block_length  # N
        position, drafts = start, np.zeros(0, dtype=np.int32)  # position: the pending token, not in the cache
        for _ in range(end - start):  # (each round writes a token at least: bounded by the span)
            if canvas.done.all() or position + 1 >= end:
                return
            position, drafts = yield from self._round(state, canvas, position, drafts, end, strides)
        if not canvas.done.all() and position + 1 < end:
            raise RuntimeError(f"I-DLM did not fill {end - start} positions")

    def _round(self, state: Any, canvas: Canvas, position: int, drafts: np.ndarray, end: int, strides: int):
        """One forward over [pending, drafts, masks] (a generator: it yields the forward's
        request and its Steps); returns the next pending token's position and drafts."""
        a, step = self.adapter, canvas.forwards
        drafts = drafts[: max(end - position - 2, 0)]  # (the window's rows stay inside the span)
        K = drafts.size
        masks = min(strides - 1, end - position - 2 - K)
        pending = canvas.tokens[:, position : position + 1]
        window = mx.concatenate(
            [pending, mx.array(drafts[None]), mx.full((1, masks), a.mask_id, mx.int32)], axis=1
        ).astype(mx.int32)
        width = window.shape[1]
        # (Adapter.verify; a batch's rows share one). The pending token and the drafts are the
        # causal rows; a cold round (no drafts) is causal in every row, as the references'
        logits = yield Verify(state, window, 0, width, clean=1 + K if K else width)
        scores = self._scores(logits)  # row i: the token at position + 1 + i
        canvas.forwards += 1
        logprobs, proposed, prob = self._propose(scores)
        yield ReadBack((proposed,))
        verified = np.array(proposed)[0]
        accepted = 0
        while accepted < K and verified[accepted] == drafts[accepted]:
            accepted += 1
        # the accepted drafts are the verify rows' own argmaxes; the next pending token (the
        # row after the last accepted: the full acceptance's next token or the correction) too
        tokens = verified[: min(accepted + 1, end - position - 1)]
        stops = [i for i, t in enumerate(tokens.tolist()) if t in self.options.eos_ids]
        if stops:  # nothing is written past an EOS
            tokens = tokens[: stops[0] + 1]
        canvas.write(mx.array(tokens[None].astype(np.int32)), position + 1)
        a.keep(state, position + 1 + accepted)  # the pending token's and the accepted drafts' keys and values
        following = verified[K + 1 : K + 1 + masks] if accepted == K and not stops else np.zeros(0, np.int32)
        block = (position + 1, position + 1 + width)  # (the rows' positions: their log-probs)
        position += accepted + 1
        self.shown = (position + 1, following) if following.size else None  # (drawn as drafts: draft_callback)
        yield Queued(canvas.tokens, logprobs, prob, canvas.forwards, block, step, True, True)
        self.shown = None
        return position, following.astype(np.int32)

    def _seed(self, state: Any, canvas: Canvas, start: int) -> Queued:
        """The first token: the prompt's last row proposes it (its argmax, or a draw)."""
        logprobs, token, prob = self._propose(
            self._scores(self.adapter.block_seed(state, canvas.tokens, start)[:, None])
        )
        canvas.write(token, start)
        return Queued(canvas.tokens, logprobs, prob, canvas.forwards, (start, start + 1), 0, True, False)

    def _propose(self, scores: mx.array) -> tuple:
        """(log-probs kept or None, (1, L) tokens, (1, L) their probabilities or None): each
        row's argmax, or its draw with the request's sampler."""
        if self.options.sampler is None:
            return super()._propose(scores)
        logprobs = log_softmax(scores)
        tokens = self.sample(logprobs)
        prob = mx.exp(mx.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0])
        return (logprobs if self.keep_logprobs else None), tokens, prob
