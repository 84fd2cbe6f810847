"""Exact-match decoding of addition problems through the shared engine.

Problems are decoded in batches of equal prompt length. Per row it records the
forwards the row needed (the forward at which its final prefix reached EOS) and the
tokens it emitted (answer digits plus the stopping EOS), so that tokens per forward
is what a single-prompt decode of that row would report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from model_adapters import adapter_for

from ..engine import Engine
from ..options import DecodeOptions, resolve
from .problems import GEN_LENGTH, answer_text, group_by_prompt_length
from .vocab import decode


@dataclass
class Evaluation:
    pairs: list = field(default_factory=list)
    answers: list = field(default_factory=list)  # decoded text per problem
    forwards: list = field(default_factory=list)  # forwards each row needed
    emitted: list = field(default_factory=list)  # tokens each row emitted (incl. EOS)
    seconds: float = 0.0

    @property
    def correct(self) -> np.ndarray:
        return np.array([ans == answer_text(a, b) for (a, b), ans in zip(self.pairs, self.answers)])

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())

    @property
    def tokens_per_forward(self) -> float:
        return float(np.sum(self.emitted) / max(np.sum(self.forwards), 1))

    @property
    def tokens_per_second(self) -> float:
        return float(np.sum(self.emitted) / max(self.seconds, 1e-9))


def evaluate(model, tokenizer, pairs, max_tokens: int = GEN_LENGTH, batch_size: int = 512,
             **options) -> Evaluation:
    """Decode every `a+b=` prompt with `options` (DecodeOptions fields; `None` or absent
    takes the family default) and compare with the true sum."""
    adapter = adapter_for(model, tokenizer)
    result = Evaluation()
    tic = time.perf_counter()
    for group in group_by_prompt_length(list(pairs), max_tokens):
        for lo in range(0, len(group.a), batch_size):
            prompts = group.prompts[lo : lo + batch_size]
            resolved = resolve(DecodeOptions(max_tokens=max_tokens, **options), adapter, prompts.shape[1])
            _decode(Engine(adapter, resolved, keep_logprobs=False), prompts, result)
            result.pairs += list(zip(group.a[lo : lo + batch_size].tolist(), group.b[lo : lo + batch_size].tolist()))
    result.seconds = time.perf_counter() - tic
    return result


def _decode(engine: Engine, prompts: np.ndarray, result: Evaluation) -> None:
    B, P = prompts.shape
    forwards = np.zeros(B, dtype=np.int64)
    last = None
    for last in engine.run(mx.array(prompts)):
        forwards[(forwards == 0) & last.done] = last.forwards
    forwards[forwards == 0] = last.forwards
    for b in range(B):
        tokens = last.canvas[b, P : P + last.final[b]]
        result.answers.append(decode(tokens))
        result.emitted.append(int(last.final[b]))
        result.forwards.append(int(forwards[b]))
