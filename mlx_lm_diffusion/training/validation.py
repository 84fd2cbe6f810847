"""The validation (and --test) loss: the masked-diffusion ELBO estimate, repeatable.

The training loss draws fresh noise every step, so its value on validation data would
move from one report to the next even for the same weights. Validation instead reports,
per trained token, minus the bound's Monte Carlo estimate of evaluation.likelihood (the
estimate `mlx_lm_diffusion.evaluate` scores with: LLaDA's for the whole-canvas families,
BD3-LM's block sum for the block-causal ones) of each row's trained tokens given the
tokens before them, with a seed made of `seed` and the row's own tokens: the same row
gets the same masks at every report and in every run, whatever the batch order. It is
an upper bound on the negative log-likelihood per token, in nats, comparable to
mlx_lm.lora's validation loss of an autoregressive model.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.evaluation.likelihood import estimate_log_likelihood


class ElboValidation:
    """`(batch, lengths) -> (NELBO per token, tokens)` for mlx-lm's evaluate; `first`:
    the first position a row can be scored from (1 where a token must come before)."""

    def __init__(self, adapter: Any, first: int = 0, samples: int = 1, seed: int = 0):
        self.adapter = adapter
        self.first = first
        self.samples = samples
        self.seed = seed

    def __call__(self, batch: mx.array, lengths: mx.array) -> tuple:
        tokens, spans = np.array(batch), np.array(lengths)
        total, count = 0.0, 0
        for row, (offset, length) in zip(tokens, spans):
            start = max(int(offset), self.first)
            if length <= start:
                continue
            sequence = row[:length].tolist()
            estimate = estimate_log_likelihood(
                self.adapter,
                sequence[:start],
                sequence[start:],
                samples=self.samples,
                batch_size=self.samples,
                seed=[self.seed, *sequence],
            )
            total -= estimate.log_likelihood
            count += int(length) - start
        return mx.array(total / max(count, 1), dtype=mx.float32), mx.array(count)
