"""mlx-lm-compatible generation: `stream_generate`, `generate`, `generate_batch`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse

from mlx_lm_diffusion.api.batch_generate import DiffusionBatchResponse, generate_batch  # noqa: F401 (mlx_lm.batch_generate's)
from mlx_lm_diffusion.api.decode import Decode, build_decode
from mlx_lm_diffusion.decoding import Engine, PromptReuse, Step
from mlx_lm_diffusion.output.detokenize import answer_detokenizer


@dataclass
class DiffusionResponse(GenerationResponse):
    """mlx-lm's GenerationResponse plus the model forward passes used so far."""

    forwards: int = 0


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], mx.array],
    max_tokens: Optional[int] = None,
    draft_callback: Optional[Callable[[Step], None]] = None,
    suffix: Optional[Union[str, Sequence[int]]] = None,
    prompt_kv: Optional[PromptReuse] = None,
    **kwargs,
) -> Iterator[DiffusionResponse]:
    """Yield one response per final token, strictly left to right (mlx-lm's contract).

    Options (keyword): sampler, logits_processors, allowed_tokens, block_length, steps,
    threshold, strategy, factor, entropy_bound, alg_temp, seed; `None` (max_tokens too)
    takes the checkpoint's default (generation_config.json, read by `load`), else the
    family's. `draft_callback(step)` receives the whole draft canvas after every forward.
    `suffix` (text or ids): infill the span between the prompt and it, at most
    max_tokens long (mlx_lm_diffusion.output.infill); the responses are the middle only.
    Images (mlx-vlm's convention, DiffusionGemma): pass the processor `load` returned
    as `tokenizer` and `image=[paths or PIL images]` (`video=[paths]`); `prompt` may
    also be chat messages with image content parts (mlx_lm_diffusion.media.images).
    `prompt_kv` (mlx_lm_diffusion.decoding.kv_reuse.PromptReuse): the KV of the prompt's leading
    tokens from an earlier decode, reused where the family's KV is exact.
    """
    decode = build_decode(model, tokenizer, prompt, max_tokens, suffix=suffix, **kwargs)  # (on the first next())
    yield from decode_responses(decode, draft_callback, prompt_kv)


def decode_responses(
    decode: Decode, draft_callback: Optional[Callable[[Step], None]] = None, prompt_kv: Optional[PromptReuse] = None
) -> Iterator[DiffusionResponse]:
    """`stream_generate`'s responses for a built Decode (the doors that built it themselves)."""
    adapter, options, ids = decode.adapter, decode.options, decode.ids
    engine = Engine(adapter, options, vision=decode.vision)  # (images: encoded with the prompt)
    P = len(ids)
    detokenizer = answer_detokenizer(decode.tokenizer)

    tic = time.perf_counter()
    prompt_tps, emitted = 0.0, 0
    prompt = mx.array([ids])
    reuse = prompt_kv.plan(adapter, engine, prompt) if prompt_kv is not None else None
    for step in engine.run(prompt, decode.seed, reuse=reuse):
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
            stop = token in options.eos_ids
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
    text, response = "", None
    for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        if verbose and response.generation_tokens == 1:  # (not before a bad request fails)
            print("=" * 10)
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
