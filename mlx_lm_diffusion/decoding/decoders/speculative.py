"""Self-speculative decoding: a bidirectional draft and a causal verify pass per window.

Nemotron-Labs Diffusion is trained both as a diffusion model (a block attends to itself
bidirectionally over a causal prefix) and as an autoregressive one (causal attention), with
one set of weights. mlx-vlm's `linear_spec_generate` (0.7.10) uses the two modes as draft and
target of speculative decoding; this decoder does what it does:

- the prompt is encoded causally into the adapter's KV cache and its last position proposes
  the first token (`Adapter.block_seed`);
- each window is [the latest token, masks...]: one bidirectional forward over it, on top of
  the cache and without storing it, drafts every mask (its argmax); one causal forward over
  the drafted window, storing its keys and values, gives the autoregressive argmax after each
  window position;
- the longest prefix of the draft that equals the causal argmaxes is accepted, plus the
  causal pass's next token (so each window yields at least one token); the cache keeps the
  keys and values of the accepted positions and the rejected draft's are trimmed;
- the window starts at min(block_length, 8) positions and adapts as mlx-vlm's does: it
  doubles (up to min(block_length, 32)) after a window is accepted whole and halves (down to
  its start) after half of it or less is accepted; the last windows shrink to what
  max_tokens leaves. A window of one token (the last) needs no draft.

Every accepted token is the causal argmax after a prefix equal to the autoregressive one, so
the output is autoregressive greedy decoding token for token (block length 1, no self_spec),
whatever the draft. `forwards` counts every draft and every verify forward (the prompt's
causal pass is not counted, as for every family), so tokens per forward is honest.

Greedy only: a sampler, a temperature schedule, a commit rule and its settings (strategy,
threshold, factor, ...), steps, editing and logits processors are refused. allowed_tokens
applies (a per-position bias: the autoregressive decode applies it the same way); the mask
token is never proposed, as everywhere in the engine. One row per decode; a running batch of self-speculative decodes shares one forward for its
rows' drafts and one for their verify passes (`Verify` requests: model_adapters.runtime.batched.causal_verify_batch).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.decoders.base import (
    Canvas,
    Decoder,
    Forward,
    Queued,
    ReadBack,
    Verify,
    greedy_proposal,
    log_softmax,
)

# mlx-vlm's windows: the first (and the smallest), and the largest.
BASE_WINDOW, MAX_WINDOW = 8, 32

# Options that cannot apply to a greedy speculative decode, and why.
REFUSED = {
    "steps": "there are no denoising steps",
    "strategy": "there is no commit rule",
    "threshold": "there is no commit rule",
    "factor": "there is no commit rule",
    "entropy_bound": "there is no commit rule",
    "alg_temp": "there is no commit rule",
    "schedule": "there is no mask schedule",
    "editing_threshold": "accepted tokens are never revised",
    "max_post_steps": "accepted tokens are never revised",
    "temperature_schedule": "it decodes greedily (the verify pass's argmax)",
    "sampler": "it decodes greedily (the verify pass's argmax); sampling (temperature > 0) is not supported",
    "logits_processors": "the verify pass accepts several tokens at once and would need them one by one",
}


def check_greedy(temperature: float, logits_processors: bool) -> None:
    """A server request's sampling settings (mlx-lm's, outside the decoding fields), refused
    up front as `check_options` refuses the sampler and processors they become."""
    if temperature > 0:
        raise ValueError(f"self_spec decodes greedily: temperature must be 0, got {temperature:g}")
    if logits_processors:
        raise ValueError(
            "self_spec takes no logits processors (logit_bias, repetition, presence or "
            "frequency penalties): drop them or self_spec"
        )


class SpeculativeDecoder(Decoder):
    name = "speculative"
    # what it refuses, and how its refusals name the decoding (`{family}`: the adapter's) and the
    # option to drop instead
    refused = REFUSED
    decoding, or_drop = "self_spec decoding", " or self_spec"
    one_token_refusal = (
        "self_spec drafts at least one token per window: give block_length >= 2 "
        "(block_length 1 without self_spec is autoregressive decoding)"
    )
    # (a checkpoint's own commit rule or steps belong to its diffusion decode)
    unread_defaults = frozenset(REFUSED)

    def __init__(self, adapter: Any, options: Any, keep_logprobs: bool = True):
        if adapter.mask_id is None:
            raise ValueError(f"{adapter.family} has no mask token; it cannot draft")
        super().__init__(adapter, options, keep_logprobs)
        self.suppress = mx.zeros((adapter.vocab_size,), mx.float32)
        self.suppress[mx.array(sorted(adapter.suppress_ids))] = -mx.inf
        self.shown: Optional[tuple] = None  # (position, host tokens) of the draft a Step shows

    @classmethod
    def check_options(cls, values: dict, adapter: Any) -> None:
        for name, why in cls.refused.items():
            if values.get(name) not in (None, ()):
                raise ValueError(
                    f"{name} does not apply to {cls.decoding.format(family=adapter.family)}: {why}; "
                    f"drop {name}{cls.or_drop}"
                )
        if values.get("block_length") == 1:
            raise ValueError(cls.one_token_refusal.format(family=adapter.family))

    @property
    def fill(self) -> int:
        return self.adapter.mask_id

    def blocks(self, prompt_len: int) -> list:
        # One span: windows follow the accepted lengths, not a fixed grid.
        return [(prompt_len, prompt_len + self.options.max_tokens)]

    def block_step_bound(self, width: int) -> int:
        # the first token is the prompt's seed; every later window yields at least one
        # token for at most two forwards
        return 2 * max(width - 1, 0)

    def draft(self, host: np.ndarray, end: int) -> np.ndarray:
        if self.shown is None:
            return host
        position, tokens = self.shown
        canvas = host.copy()
        canvas[0, position : position + tokens.size] = tokens
        return canvas

    def drafted(self) -> Optional[tuple]:
        return None if self.shown is None else (self.shown[0], self.shown[0] + self.shown[1].size)

    def decode_block(self, state: Any, canvas: Canvas, start: int, end: int) -> Iterator:
        if canvas.rows != 1:
            raise ValueError("self_spec decodes one row at a time (its windows follow each row's accepted tokens)")
        yield self._seed(state, canvas, start)
        smallest = min(self.options.block_length, BASE_WINDOW)
        largest = min(self.options.block_length, MAX_WINDOW)
        window, position = smallest, start  # position: the latest token, not yet in the cache
        for _ in range(end - start):  # (each window yields a token at least: bounded by the span)
            if canvas.done.all():
                return
            width = min(window, end - position - 1)
            accepted = yield from self._window(state, canvas, position, width)
            position += accepted
            if accepted == width and window < largest:
                window = min(largest, window * 2)
            elif accepted <= max(1, width // 2) and window > smallest:
                window = max(smallest, window // 2)
        if not canvas.done.all():
            raise RuntimeError(f"self_spec did not fill {end - start} positions")

    def _seed(self, state: Any, canvas: Canvas, start: int) -> Queued:
        """The first token: the causal pass over the prompt proposes it."""
        logprobs = log_softmax(self._scores(self.adapter.block_seed(state, canvas.tokens, start)[:, None]))
        token, prob = greedy_proposal(logprobs)
        canvas.write(token, start)
        return Queued(
            canvas.tokens,
            logprobs if self.keep_logprobs else None,
            prob,
            canvas.forwards,
            (start, start + 1),
            0,
            True,
            False,
        )

    def _window(self, state: Any, canvas: Canvas, position: int, width: int):
        """Draft, verify and accept one window [position, position + width) (a generator:
        it yields the draft's forward request and a Step per forward); returns how many
        tokens it accepted."""
        a, step = self.adapter, canvas.forwards
        window = canvas.tokens[:, position : position + width]
        if width > 1:  # the draft: one bidirectional forward over [latest token, masks...]
            logits = yield Forward(state, canvas.tokens, position, position + width)
            canvas.forwards += 1
            drafted = mx.argmax(self._scores(logits), axis=-1).astype(mx.int32)  # (no softmax: argmax only)
            window = mx.concatenate([window[:, :1], drafted[:, 1:]], axis=1)
        causal = yield Verify(state, window, 0, width)  # (Adapter.verify; a batch's rows share one)
        scores = self._scores(causal)  # row i: the token after position + i
        canvas.forwards += 1
        logprobs, proposed, prob = self._propose(scores)
        yield ReadBack((window, proposed))
        drafts, verified = np.array(window)[0], np.array(proposed)[0]
        block = (position + 1, position + 1 + width)
        if width > 1:
            self.shown = (position + 1, drafts[1:])
            yield Queued(canvas.tokens, None, None, step + 1, block, step, False, True)
            self.shown = None
        accepted = 1
        while accepted < width and verified[accepted - 1] == drafts[accepted]:
            accepted += 1
        tokens = verified[:accepted]
        stops = [i for i, t in enumerate(tokens.tolist()) if t in self.options.eos_ids]
        if stops:  # nothing is written past an EOS
            tokens = tokens[: stops[0] + 1]
        canvas.write(mx.array(tokens[None].astype(np.int32)), position + 1)
        a.keep(state, position + accepted)  # the accepted positions' keys and values stay
        yield Queued(canvas.tokens, logprobs, prob, canvas.forwards, block, step + (width > 1), True, True)
        return accepted

    def _propose(self, scores: mx.array) -> tuple:
        """(log-probs kept or None, (1, L) each row's argmax, (1, L) their probabilities or
        None): the streamed tokens' log-probs and confidences only where they are kept."""
        if self.keep_logprobs:
            logprobs = log_softmax(scores)
            proposed, prob = greedy_proposal(logprobs)
            return logprobs, proposed, prob
        return None, mx.argmax(scores, axis=-1).astype(mx.int32), None

    def _scores(self, logits: mx.array) -> mx.array:
        """float32 logits with the allowed-token bias and the mask token suppressed."""
        return self.process(logits) + self.suppress
