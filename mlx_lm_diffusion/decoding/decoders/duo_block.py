"""The DUO block decoder (LFM2.5-Diffusion): uniform-state blocks, an ancestral posterior per step.

The reference sampler (Liquid4All/lfm-diffusion lfm_diffusion/sampler.py, `generate_ids`), as
done here: blocks of `block_length` (32) follow the prompt's end; a block starts as uniformly
random tokens (over the real vocabulary) and takes `steps` denoising steps on the time grid
t_j = eps + (1 - eps)(1 - j / steps)^rho (eps 1e-3), alpha(t) = 1 - (1 - eps) t. Step j runs
the model on the block at sigma = -log alpha(t_j), self-conditioned on the previous step's
belief, divides the logits by the temperature (linear from duo_temperature_start at the
first step to duo_temperature_end at the last), and draws every position of the block from the
uniform-state posterior q(z_s | z_t, x0) at alpha_s = alpha(t_{j+1}) (`duo_posterior`, in
float64 on the CPU as the reference's `use_float64`; Gumbel-max draws). A readout step
follows at sigma >= 0.7 (alpha_s = 1, the end temperature). The block is then final; the
decode stops after a block holding the end token. `steps` counts the denoising steps as the
reference's `steps_per_block` does, so a block costs steps + 1 forwards (SGLang's port counts
the readout inside its steps: its nfe8 is 7 + 1).

The presets (nfe4 / nfe8 / nfe32) are the family's (model_adapters.families.lfm2_diffusion). The
sampler of a request is not used: DUO draws from its own posterior at the annealed
temperatures ("do not decode greedily", the reference's README). Commit rules, schedules,
temperature schedules, editing and logits processors are refused.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.decoding.decoders.base import BlockState, Canvas, Decoder, Forward, ReadBack, log_softmax, queue

EPS = 1e-3  # the grid's smallest noise level (the reference's eps)
READOUT_SIGMA_FLOOR = 0.7  # the readout's noise level, at least (terminal_sigma_floor)

REFUSED = {
    "strategy": "every step draws every position from the posterior: there is no commit rule",
    "threshold": "there is no commit rule",
    "factor": "there is no commit rule",
    "entropy_bound": "there is no commit rule",
    "alg_temp": "there is no commit rule",
    "schedule": "its steps follow the DUO time grid (duo_rho)",
    "editing_threshold": "every step re-decides every position of the block",
    "max_post_steps": "every step re-decides every position of the block",
    "temperature_schedule": "its temperature runs from duo_temperature_start to duo_temperature_end",
    "logits_processors": "a block's positions are drawn together, not left to right",
}


def time_grid(steps: int, rho: float, eps: float = EPS) -> np.ndarray:
    """steps + 1 times from 1 (noise) to eps (clean), warped by rho."""
    u = np.linspace(1.0, 0.0, steps + 1)
    return eps + (1.0 - eps) * u**rho


def alpha(t: float, eps: float = EPS) -> float:
    """The log-linear signal level alpha(t) = 1 - (1 - eps) t."""
    return 1.0 - (1.0 - eps) * t


def temperature_at(step: int, steps: int, start: float, end: float) -> float:
    return start + step / max(steps - 1, 1) * (end - start)


def duo_posterior(x0: mx.array, xt: mx.array, alpha_s: float, alpha_t: float) -> mx.array:
    """The uniform-state reverse posterior q(z_s | z_t, x0) (B, L, V) over the vocabulary, from
    the belief x0 (B, L, V) and the current tokens xt (B, L), in x0's dtype."""
    V = x0.shape[-1]
    ratio, gap = alpha_t / alpha_s, alpha_s - alpha_t
    current = (mx.arange(V) == xt[..., None]).astype(x0.dtype)
    numer = alpha_t * V * x0 * current + (ratio - alpha_t) * current + gap * x0 + (1.0 - ratio) * (1.0 - alpha_s) / V
    denom = alpha_t * V * mx.take_along_axis(x0, xt[..., None], axis=-1) + (1.0 - alpha_t)
    return numer / denom


def reverse_step(
    logits: mx.array, xt: mx.array, alpha_t: float, alpha_s: float, temperature: float, float64: bool
) -> tuple:
    """One ancestral step: (the block's new tokens (B, L), the scaled log-probs (B, L, V))."""
    logprobs = log_softmax(logits.astype(mx.float32) / temperature)
    noise = mx.random.uniform(shape=logprobs.shape)
    stream = mx.cpu if float64 else mx.default_stream(mx.default_device())
    with mx.stream(stream):
        dtype = mx.float64 if float64 else mx.float32
        q = mx.maximum(duo_posterior(mx.exp(logprobs).astype(dtype), xt, alpha_s, alpha_t), 1e-30)
        gumbel = 1e-10 - mx.log(noise.astype(dtype) + 1e-10)
        tokens = mx.argmax(q / gumbel, axis=-1).astype(mx.int32)
    return tokens, logprobs


class DuoBlockDecoder(Decoder):
    name = "duo_block"
    whole_canvases = True
    unread_defaults = frozenset(REFUSED)

    @classmethod
    def check_options(cls, values: dict, adapter: Any) -> None:
        for name, why in REFUSED.items():
            if values.get(name) not in (None, ()):
                raise ValueError(f"{name} does not apply to {adapter.family}'s DUO sampler: {why}; drop {name}")

    @classmethod
    def fit_length(cls, max_tokens: int, block_length: int, room: int) -> int:
        whole = -(-max_tokens // block_length) * block_length
        return max_tokens if whole <= room else room // block_length * block_length

    def canvas_length(self, prompt_len: int) -> int:
        L = self.options.block_length
        return -(-self.options.max_tokens // L) * L  # whole blocks, cut at max_tokens

    def block_step_bound(self, width: int) -> int:
        return self.options.steps + 1  # (the readout)

    @property
    def fill(self) -> int:
        return self.adapter.fill_id

    def changing(self) -> bool:
        return True

    def decode_block(self, state: Any, canvas: Canvas, start: int, end: int) -> Iterator:
        a, o, settings = self.adapter, self.options, self.options.family
        steps, float64 = o.steps, settings["duo_float64"]
        t_start, t_end = settings["duo_temperature_start"], settings["duo_temperature_end"]
        grid = time_grid(steps, settings["duo_rho"])
        readout = min(alpha(grid[-1]), math.exp(-READOUT_SIGMA_FLOOR))
        b = BlockState(start, end, confidence=mx.zeros((canvas.rows, end - start)))
        noisy = mx.random.randint(0, a.vocab_size, (canvas.rows, end - start)).astype(mx.int32)
        levels = [(alpha(grid[j]), alpha(grid[j + 1]), temperature_at(j, steps, t_start, t_end)) for j in range(steps)]
        for b.step, (alpha_t, alpha_s, temperature) in enumerate(levels + [(readout, 1.0, t_end)]):
            canvas.write(noisy, start)
            a.noise(state, -math.log(max(alpha_t, 1e-30)))
            logits = yield Forward(state, canvas.tokens, start, end)
            canvas.forwards += 1
            noisy, logprobs = reverse_step(self.process(logits), noisy, alpha_t, alpha_s, temperature, float64)
            a.condition(state, logprobs)  # (the next step's self-conditioning)
            b.confidence = mx.exp(mx.take_along_axis(logprobs, noisy[..., None], axis=-1)[..., 0])
            canvas.write(noisy, start)
            yield ReadBack((canvas.tokens, b.confidence))
            canvas.sync()
            yield queue(canvas, b, logprobs if self.keep_logprobs else None, b.step == steps)
