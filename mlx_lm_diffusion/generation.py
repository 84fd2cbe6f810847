"""mlx-lm-compatible generation: `stream_generate`, `generate`, `generate_batch`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from model_adapters import adapter_for

from .engine import Engine, Step
from .options import DecodeOptions, resolve


@dataclass
class DiffusionResponse(GenerationResponse):
    """mlx-lm's GenerationResponse plus the model forward passes used so far."""

    forwards: int = 0


def encode_prompt(tokenizer: TokenizerWrapper, prompt: Union[str, Sequence[int], mx.array]) -> List[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)  # as mlx-lm does
        return list(tokenizer.encode(prompt, add_special_tokens=add_special))
    if isinstance(prompt, mx.array):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    return [int(t) for t in prompt]


def check_prompt(ids: List[int], mask_id: Optional[int], vocab_size: int) -> None:
    if not ids:
        raise ValueError("prompt is empty; give at least one token")
    if mask_id is not None and mask_id in ids:
        raise ValueError(
            f"prompt contains the mask token (id {mask_id}); remove it: the mask token "
            "marks positions still to be generated and cannot appear in a prompt"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} lie outside the vocabulary [0, {vocab_size})")


def _engine(model: nn.Module, tokenizer: TokenizerWrapper, prompt_len: int, max_tokens: Optional[int], kwargs: dict):
    adapter = adapter_for(model, tokenizer)
    options = DecodeOptions(max_tokens=max_tokens, **kwargs)  # (unknown names: TypeError)
    return adapter, resolve(options, adapter, prompt_len)


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: Optional[int] = None,
    draft_callback: Optional[Callable[[Step], None]] = None,
    **kwargs,
) -> Iterator[DiffusionResponse]:
    """Yield one response per final token, strictly left to right (mlx-lm's contract).

    Options (keyword): sampler, logits_processors, block_length, steps, threshold,
    strategy, factor, entropy_bound, alg_temp, seed; `None` (max_tokens too) takes the
    checkpoint's default (generation_config.json, read by `load`), else the family's.
    `draft_callback(step)` receives the whole draft canvas after every forward.
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    ids = encode_prompt(tokenizer, prompt)
    adapter, options = _engine(model, tokenizer, len(ids), max_tokens, kwargs)
    check_prompt(ids, adapter.mask_id, adapter.vocab_size)
    engine = Engine(adapter, options)
    P = len(ids)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()

    tic = time.perf_counter()
    prompt_tps, emitted = 0.0, 0
    for step in engine.run(mx.array([ids])):
        if step.forwards == 1:
            prompt_time = time.perf_counter() - tic
            prompt_tps = P / max(prompt_time, 1e-9)
            tic = time.perf_counter()
        if draft_callback is not None and step.ran_forward:
            draft_callback(step)
        while emitted < step.final[0]:
            token = int(step.canvas[0, P + emitted])
            logprobs = step.logprobs(0, P + emitted)
            emitted += 1
            stop = token in adapter.eos_ids
            finish = "stop" if stop else ("length" if emitted == options.max_tokens else None)
            if not stop:
                detokenizer.add_token(token)
            if finish is not None:
                detokenizer.finalize()
            yield DiffusionResponse(
                text=detokenizer.last_segment,
                token=token,
                logprobs=logprobs,
                from_draft=False,
                prompt_tokens=P,
                prompt_tps=prompt_tps,
                generation_tokens=emitted,
                generation_tps=emitted / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish,
                forwards=step.forwards,
            )
            if finish is not None:
                return


def generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, Sequence[int]],
    max_tokens: Optional[int] = None,
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a complete response (mlx-lm's `generate`, for diffusion models)."""
    if verbose:
        print("=" * 10)
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec, {response.forwards} forwards"
        )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


def generate_batch(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Union[str, Sequence[int], mx.array]],
    max_tokens: Optional[int] = None,
    **kwargs,
) -> tuple[List[List[int]], int]:
    """Decode prompts of equal token length together; returns (tokens per row, forwards).

    Each prompt is a string (encoded as `stream_generate` encodes it) or a list of
    token ids. Each row stops at its own EOS (excluded from its tokens)."""
    if isinstance(prompts, mx.array) and prompts.ndim == 2:  # (rows, length) token ids
        prompts = prompts.tolist()
    if isinstance(prompts, (str, mx.array)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        raise ValueError("generate_batch takes a list of prompts (strings or token lists); wrap one prompt in a list")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompts = [encode_prompt(tokenizer, p) for p in prompts or ()]
    if not prompts:
        raise ValueError("generate_batch needs one or more prompts")
    lengths = sorted({len(p) for p in prompts})
    if len(lengths) != 1:
        raise ValueError(
            f"generate_batch needs prompts of equal token length, got lengths {lengths}: "
            "group the prompts by length, or call stream_generate for each"
        )
    adapter, options = _engine(model, tokenizer, len(prompts[0]), max_tokens, kwargs)
    for p in prompts:
        check_prompt(list(p), adapter.mask_id, adapter.vocab_size)
    last = None
    for last in Engine(adapter, options, keep_logprobs=False).run(mx.array(prompts)):
        pass
    P = len(prompts[0])
    rows = []
    for b in range(len(prompts)):
        tokens = [int(t) for t in last.canvas[b, P : P + last.final[b]]]
        if tokens and tokens[-1] in adapter.eos_ids:
            tokens = tokens[:-1]
        rows.append(tokens)
    return rows, last.forwards
