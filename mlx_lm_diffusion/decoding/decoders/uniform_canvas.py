"""The uniform-canvas decoder (DiffusionGemma): no mask token, whole canvases of noise.

Hugging Face's generation_diffusion_gemma.py: a canvas starts as uniformly random
tokens; each step the model predicts every position of the noisy canvas, the logits
are divided by a temperature linear in the remaining steps, a token is drawn everywhere,
the rule accepts some of them (entropy_bound_transfer over all positions by default) and
every other position is re-noised. A row stops once its argmax canvas is stable and
confident (frozen from then on, as in the reference), the canvas once every row stopped
or after `steps` steps; the argmax canvas is the draft and the output. Random draws
follow the reference: the canvas, then per step the sample and the noise.

The adapter declares the settings as its own options: `t_min`, `t_max` (the temperature
at the last and first step), `stability_threshold` and `confidence_threshold` (the stop).

With a mask schedule as the rule (`schedule`, or the step-schedule protocol's rule) the
canvas commits: uniform noise plays the [MASK] token's part. Each step the model sees the
committed tokens and fresh noise everywhere else, the schedule's k_t most confident open
positions take their drawn token for good (the protocol's section 4), the rest are noised
again; a `temperature_schedule` gives each step's temperature (0: greedy; the linear
t_max -> t_min otherwise), `top_p` the nucleus. No stable-and-confident stop: the schedule
fills the canvas in `steps` steps. Self-conditioning gets the tempered logits, as in the
reference (at temperature 0 the raw ones).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import mlx.core as mx
import numpy as np
from mlx_arsenal.diffusion import StableConfidentStopping, TokenStats, linear_temperature, renoise, uniform_canvas
from mlx_lm.sample_utils import apply_top_p

from mlx_lm_diffusion.decoding.commit_rules import StepInputs
from mlx_lm_diffusion.decoding.decoders.base import (
    BlockState,
    Canvas,
    Decoder,
    Forward,
    Queued,
    ReadBack,
    greedy_stats,
    log_softmax,
    normalized_entropy,
    queue,
)
from mlx_lm_diffusion.decoding.schedules import ScheduleQuota

# Generic options that mean nothing when every step re-decides every position.
NOT_APPLICABLE = ("editing_threshold",)
MIN_TEMPERATURE = 1e-4  # below it a step is greedy (as the masked decoder's)


def full_logprobs(values: mx.array, ids: mx.array, vocab_size: int) -> mx.array:
    """(B, L, V) holding `values` at `ids` and -inf elsewhere (the top-k step's view of the
    vocabulary)."""
    full = mx.full((*values.shape[:-1], vocab_size), -mx.inf, dtype=values.dtype)
    return mx.put_along_axis(full, ids, values, axis=-1)


def commits(rule: Any) -> bool:
    """Whether a rule makes the canvas commit (a mask schedule's quota)."""
    return isinstance(rule, ScheduleQuota)


class UniformCanvasDecoder(Decoder):
    name = "uniform_canvas"
    whole_canvases = True

    @classmethod
    def check_options(cls, values: dict, adapter: Any) -> None:
        for name in NOT_APPLICABLE:
            if values.get(name) is not None:
                raise ValueError(
                    f"{name} does not apply to {adapter.family}, whose canvas is uniform noise "
                    "(every step re-decides every position); drop it"
                )
        scheduled = values.get("schedule") is not None or commits(values.get("strategy"))
        if values.get("temperature_schedule") is not None and not scheduled:
            raise ValueError(
                f"temperature_schedule applies to {adapter.family} only with a mask schedule "
                "(schedule=..., which makes the uniform canvas commit); otherwise its temperature "
                "runs from t_max to t_min"
            )
        if values.get("logits_processors"):
            raise ValueError(
                f"logits_processors do not apply to {adapter.family}: they are fed tokens left to "
                "right as each becomes final, and a uniform-noise canvas re-decides every position "
                "until the whole canvas is final; use allowed_tokens to restrict its tokens"
            )

    @staticmethod
    def whole(max_tokens: int, block_length: int) -> int:
        return -(-max_tokens // block_length) * block_length  # decoded whole, even past max_tokens

    @classmethod
    def fit_length(cls, max_tokens: int, block_length: int, room: int) -> int:
        if cls.whole(max_tokens, block_length) <= room:
            return max_tokens
        return room // block_length * block_length  # the whole canvases that fit

    def canvas_length(self, prompt_len: int) -> int:
        return self.whole(self.options.max_tokens, self.options.block_length)

    @property
    def fill(self) -> int:
        return 0  # (positions not reached yet hold 0)

    def block_step_bound(self, width: int) -> int:
        return self.options.steps  # every canvas runs at most its steps

    def changing(self) -> bool:
        return True  # a canvas's tokens are final once the canvas is

    def draft(self, host: np.ndarray, end: int) -> np.ndarray:
        return host[:, :end]  # the argmax drafts up to the end of the current canvas

    def decode_block(self, state: Any, canvas: Canvas, start: int, end: int) -> Iterator[Queued]:
        if commits(self.options.rule):
            yield from self._decode_scheduled(state, canvas, start, end)
            return
        a, o, settings = self.adapter, self.options, self.options.family
        B, L = canvas.rows, end - start
        stop = StableConfidentStopping(settings["stability_threshold"], settings["confidence_threshold"])
        # Pinned positions (an infill suffix, a seeded canvas) hold their token in the noisy
        # canvas and the draft at every step: they are never noised or re-decided.
        free = canvas.unpinned(start, end)
        seeded = canvas.tokens[:, start:end]
        keep = (lambda x: x) if free is None else (lambda x: mx.where(free, x, seeded))  # noqa: E731
        noisy = keep(uniform_canvas((B, L), a.vocab_size))
        stopped = mx.array(canvas.done)
        argmax, kept = seeded, None
        b = BlockState(start, end, confidence=mx.zeros((B, L)))
        open_count = np.full(B, L) if free is None else np.array(free).sum(axis=1)
        b.rule_state = o.rule.start_block(open_count, o.steps)
        for b.step in range(o.steps):
            noisy_canvas = mx.concatenate([canvas.tokens[:, :start], noisy, canvas.tokens[:, end:]], axis=1)
            reply = yield Forward(state, noisy_canvas, start, end)
            canvas.forwards += 1
            temperature = linear_temperature(
                o.steps - b.step, o.steps, t_min=settings["t_min"], t_max=settings["t_max"]
            )
            if isinstance(reply, tuple):  # the cheaper step: the top-k (values, ids)
                stats, sample, prob, logprobs = self._top_k_step(state, reply, temperature)
            else:
                z = self.process(reply) / temperature
                a.condition(state, z)  # the model's self-conditioning input at the next step
                # (one exp pass over the vocabulary for the log-softmax and the entropy)
                x0, top_prob, entropy, logprobs = greedy_stats(z)
                stats = TokenStats(x0, top_prob, entropy)
                sample = self._draw(z, logprobs)
                prob = mx.exp(mx.take_along_axis(logprobs, sample[..., None], axis=-1)[..., 0])
            rows = mx.broadcast_to(~stopped[:, None], (B, L))
            entropy = stats.entropy
            if free is not None:  # (a pinned position is no candidate and is certain)
                rows, entropy = rows & free, mx.where(free, entropy, 0.0)
            accepted = o.rule.select(
                StepInputs(sample, prob, stats.entropy, logprobs, rows, b.step, o.steps), b.rule_state
            )
            fresh = keep(renoise(sample, accepted, uniform_canvas((B, L), a.vocab_size)))
            frozen = stopped[:, None]
            argmax = mx.where(frozen, argmax, keep(stats.x0))
            noisy = mx.where(frozen, noisy, fresh)
            b.confidence = mx.where(frozen, b.confidence, stats.prob)
            if self.keep_logprobs:  # ((B, L, V) each step: only when asked for)
                kept = logprobs if kept is None else mx.where(frozen[..., None], kept, logprobs)
            stopped = stopped | stop(argmax, entropy)
            canvas.tokens = mx.concatenate([canvas.tokens[:, :start], argmax, canvas.tokens[:, end:]], axis=1)
            accepted = accepted & ~frozen  # (a stopped row accepts nothing more)
            yield ReadBack((canvas.tokens, noisy, stopped, kept, b.confidence, accepted))
            mx.eval(canvas.tokens, noisy, stopped, kept, b.confidence, accepted)
            canvas.sync()
            yield dataclasses.replace(queue(canvas, b, kept, False), accepted=accepted)
            if bool(mx.all(stopped).item()):
                break
        # the canvas is final: one more event releases its tokens
        b.step += 1
        yield queue(canvas, b, kept, True, ran_forward=False)

    def _top_k_step(self, state: Any, reply: tuple, temperature: float) -> tuple:
        """The cheaper step on the top-k logits (values, ids) only: the softmax, the
        entropy, the argmax and the sample over those k (renormalised: top-k sampling),
        the tempered values and their ids the next step's self-conditioning. The full
        (B, L, V) log-probs (-inf past the k) are built lazily: only a rule or a caller
        that reads them computes them."""
        values, ids = reply
        z = values / temperature
        self.adapter.condition(state, (z, ids))
        top = log_softmax(z)  # (B, L, k)
        best = mx.argmax(top, axis=-1)
        x0 = mx.take_along_axis(ids, best[..., None], axis=-1)[..., 0].astype(mx.int32)
        stats = TokenStats(x0, mx.exp(mx.max(top, axis=-1)), normalized_entropy(top))
        drawn = mx.random.categorical(z)
        sample = mx.take_along_axis(ids, drawn[..., None], axis=-1)[..., 0].astype(mx.int32)
        prob = mx.exp(mx.take_along_axis(top, drawn[..., None], axis=-1)[..., 0])
        return stats, sample, prob, full_logprobs(top, ids, self.adapter.vocab_size)

    def _decode_scheduled(self, state: Any, canvas: Canvas, start: int, end: int) -> Iterator[Queued]:
        """The committing canvas (see the module's note): committed tokens stay, every open
        position holds fresh noise at each step."""
        a, o = self.adapter, self.options
        B, L = canvas.rows, end - start
        free = canvas.unpinned(start, end)
        open_ = mx.ones((B, L), dtype=mx.bool_) if free is None else free
        tokens = canvas.tokens[:, start:end]  # pinned tokens, and each commit as it comes
        b = BlockState(start, end, confidence=mx.zeros((B, L)))
        b.rule_state = o.rule.start_block(np.array(open_).sum(axis=1), o.steps)
        live = mx.array(~canvas.done)[:, None]
        kept = None
        for b.step in range(o.steps):
            noisy = mx.where(open_, uniform_canvas((B, L), a.vocab_size), tokens)
            noisy_canvas = mx.concatenate([canvas.tokens[:, :start], noisy, canvas.tokens[:, end:]], axis=1)
            reply = yield Forward(state, noisy_canvas, start, end)
            logits = self.process(reply if not isinstance(reply, tuple) else full_logprobs(*reply, a.vocab_size))
            canvas.forwards += 1
            temperature = self._step_temperature(b.step)
            z = logits if temperature < MIN_TEMPERATURE else logits / temperature
            a.condition(state, z)
            logprobs = log_softmax(z)
            sample, prob = self._propose(logprobs, temperature)
            candidates = open_ & live
            commit = o.rule.select(
                StepInputs(sample, prob, normalized_entropy(logprobs), logprobs, candidates, b.step, o.steps),
                b.rule_state,
            )
            tokens = mx.where(commit, sample, tokens)
            b.confidence = mx.where(commit, prob, b.confidence)
            if self.keep_logprobs:
                kept = logprobs if kept is None else mx.where(commit[..., None], logprobs, kept)
            open_ = open_ & ~commit
            draft = mx.where(open_, mx.argmax(logprobs, axis=-1).astype(tokens.dtype), tokens)
            canvas.tokens = mx.concatenate([canvas.tokens[:, :start], draft, canvas.tokens[:, end:]], axis=1)
            yield ReadBack((canvas.tokens, open_, kept, b.confidence))
            mx.eval(canvas.tokens, open_, kept, b.confidence)
            canvas.sync()
            yield dataclasses.replace(queue(canvas, b, kept, False), accepted=~open_)  # (committed for good)
            if not bool(mx.any(open_ & live).item()):
                break
        b.step += 1
        yield queue(canvas, b, kept, True, ran_forward=False)

    def _step_temperature(self, step: int) -> float:
        o = self.options
        if o.temperature_schedule is not None:
            return float(o.temperature_schedule[min(step, len(o.temperature_schedule) - 1)])
        return float(linear_temperature(o.steps - step, o.steps, t_min=o.family["t_min"], t_max=o.family["t_max"]))

    def _propose(self, logprobs: mx.array, temperature: float) -> tuple:
        """(tokens, confidence): the largest tempered probability is the confidence (the
        protocol's c_i); tokens greedy at temperature 0, else drawn with nucleus top_p (or
        by the caller's sampler)."""
        confidence = mx.exp(mx.max(logprobs, axis=-1))
        if temperature < MIN_TEMPERATURE:
            return mx.argmax(logprobs, axis=-1).astype(mx.int32), confidence
        if self.options.sampler is not None:
            return self.sample(logprobs), confidence
        if self.options.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.options.top_p)
        return mx.random.categorical(logprobs).astype(mx.int32), confidence

    def _draw(self, z: mx.array, logprobs: mx.array) -> mx.array:
        """A token per position from softmax(z), as the reference draws; or the caller's sampler."""
        if self.options.sampler is None:
            return mx.random.categorical(z).astype(mx.int32)
        return self.sample(logprobs)
