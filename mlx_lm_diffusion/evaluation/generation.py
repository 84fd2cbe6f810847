"""lm-eval's generate_until requests through the engine: batched, stopped at `until`, counted.

`generate_batch` (mlx_lm_diffusion.api) decodes every row to its EOS or max_tokens; an
evaluation also stops a row at the request's stop strings (`until`), as a server stops
a stream, so that the forwards it reports are those the answer needed. This module
therefore drives the same `RunningBatch` generate_batch drives, at most `batch_size`
rows at once (a row that leaves makes room for the next request), and removes a row as
soon as its final text holds a stop string. Per row it records the tokens emitted (the
stopping EOS included, as the demo's evaluation counts them) and the forwards the row
needed (the forward count of the step that made it final), so that tokens per forward
is what a single-prompt decode of that row would report.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from mlx_lm_diffusion.api.decode import build_decode
from mlx_lm_diffusion.decoding import RowEvent, RunningBatch
from model_adapters import adapter_for


@dataclass
class Generation:
    """One request's answer: its text (cut at the first stop string), the tokens emitted
    (EOS included), the forwards its row needed, and why it ended ("stop": EOS,
    "until": a stop string, "length": max_tokens)."""

    text: str = ""
    tokens: list = field(default_factory=list)
    forwards: int = 0
    finish: str = "length"

    @property
    def emitted(self) -> int:
        return len(self.tokens)


@dataclass
class GenerationRun:
    """The answers of one call, in request order, and its wall-clock seconds."""

    generations: list
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(g.emitted for g in self.generations)

    @property
    def forwards(self) -> int:
        return sum(g.forwards for g in self.generations)


def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string (mlx_lm.evaluate's _rstrip_until)."""
    cuts = [text.find(u) for u in until if u]
    return text[: min([c for c in cuts if c >= 0], default=len(text))]


def fit_prompt(prompt: list, max_tokens: int, max_length: Optional[int]) -> list:
    """The prompt's tail that leaves room for the answer in the model's context (as
    lm-eval's HF model truncates a context on the left); the answer keeps at least half
    the context, and the engine caps max_tokens to what is left."""
    if max_length is None or len(prompt) + max_tokens <= max_length:
        return prompt
    keep = max(max_length - max_tokens, max_length // 2, 1)
    return prompt[-keep:]


def generate_until(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[list],
    max_tokens: Sequence[int],
    until: Sequence[Sequence[str]],
    options: dict,
    batch_size: int = 8,
) -> GenerationRun:
    """Decode `prompts` (token ids) with `options` (DecodeOptions keywords: sampler, seed,
    the decoding options), at most `batch_size` rows at a time. Each row is a request built
    by `build_decode` (mlx_lm_diffusion.api.decode) over the batch's one adapter."""
    adapter = adapter_for(model, tokenizer)
    batch = RunningBatch(adapter, keep_logprobs=False)
    results = [Generation() for _ in prompts]
    waiting = deque(range(len(prompts)))
    live: dict = {}  # row id -> request index
    tic = time.perf_counter()
    while waiting or len(batch):
        while waiting and len(batch) < max(batch_size, 1):
            i = waiting.popleft()
            prompt = fit_prompt(list(prompts[i]), max_tokens[i], adapter.max_length)
            decode = build_decode(model, tokenizer, prompt, max_tokens[i], adapter=adapter, **options)
            live[batch.add_decode(decode).id] = i
        for event in batch.step():
            i = live[event.row.id]
            if _collect(event, results[i], adapter.eos_ids, tokenizer, until[i]) and not event.finished:
                batch.remove(event.row)  # a stop string: the row's answer is complete
    seconds = time.perf_counter() - tic
    for result, stops in zip(results, until):
        text = tokenizer.decode([t for t in result.tokens if t not in adapter.eos_ids])
        result.text = cut_at_stops(text, stops)
    return GenerationRun(results, seconds)


def _collect(event: RowEvent, result: Generation, eos_ids: frozenset, tokenizer: Any, until: Sequence[str]) -> bool:
    """Add the row's newly final tokens to `result`; True once its text holds a stop string."""
    if event.error is not None:
        raise event.error
    step = event.step
    if step is None:  # (a row that ended before its first step)
        return False
    P, before = step.prompt_len, len(result.tokens)
    result.tokens += [int(t) for t in step.canvas[0, P + before : P + int(step.final[0])]]
    result.forwards = step.forwards
    if result.tokens and result.tokens[-1] in eos_ids:
        result.finish = "stop"
        return False
    if len(result.tokens) == before or not any(until):
        return False
    text = tokenizer.decode([t for t in result.tokens if t not in eos_ids])
    if cut_at_stops(text, until) != text:
        result.finish = "until"
        return True
    return False
