"""`generate_batch`: mlx_lm.batch_generate for diffusion models, over a running batch.

Prompts of any lengths (strings or token ids) decode together in one
`RunningBatch` (one model forward per step for every live row); each row stops at its
own EOS or max_tokens and leaves the batch then. The return value is mlx-lm's
`BatchResponse` (texts, `BatchStats`, caches, token_ids, logprobs), with the forward
count of each row added (`forwards`). Each row is a request built by `build_decode`
(mlx_lm_diffusion.api.decode) over the batch's one adapter. After `install()`,
`mlx_lm.batch_generate` comes here for diffusion models.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchResponse
from mlx_lm.generate_utils import BatchStats
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_lm_diffusion.api.decode import build_decode
from mlx_lm_diffusion.api.prompts import drop_cache_options, encode_prompt
from mlx_lm_diffusion.decoding import RowEvent, RunningBatch
from mlx_lm_diffusion.media.images import text_tokenizer
from model_adapters import TokenCache, adapter_for


@dataclass
class DiffusionBatchResponse(BatchResponse):
    """mlx-lm's BatchResponse plus each row's model forwards and finish reason."""

    forwards: List[int] = field(default_factory=list)
    finish_reasons: List[str] = field(default_factory=list)


@dataclass
class _RowResult:
    prompt: List[int]
    tokens: List[int] = field(default_factory=list)  # final tokens, EOS included
    logprobs: List[float] = field(default_factory=list)
    forwards: int = 0
    finish: Optional[str] = None


def prompt_ids(tokenizer: TokenizerWrapper, prompts: Any) -> List[List[int]]:
    """Each prompt's token ids (a string is encoded as stream_generate encodes it)."""
    if isinstance(prompts, mx.array) and prompts.ndim == 2:  # (rows, length) token ids
        prompts = prompts.tolist()
    if isinstance(prompts, (str, mx.array)) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        raise ValueError("generate_batch takes a list of prompts (strings or token lists); wrap one prompt in a list")
    ids = [encode_prompt(tokenizer, p) for p in prompts or ()]
    if not ids:
        raise ValueError("generate_batch needs one or more prompts")
    return ids


def row_processors(processors: Optional[Sequence], n_rows: int) -> List[dict]:
    """Each row's `logits_processors` keyword: none, the one shared list, or the row's own
    list where one list per prompt is given (every item a list or tuple)."""
    if processors is None:
        return [{}] * n_rows
    processors = list(processors)
    lists = [isinstance(p, (list, tuple)) for p in processors]
    if not any(lists):
        return [{"logits_processors": processors}] * n_rows
    if not all(lists):
        raise ValueError("logits_processors: give one list of processors, or one list per prompt, not a mix")
    if len(processors) != n_rows:
        raise ValueError(f"logits_processors has {len(processors)} per-prompt lists for {n_rows} prompts")
    return [{"logits_processors": list(p)} for p in processors]


# build_decode's keywords that are not decoding options, which a batch's rows do not take
# (text prompts only; no context fitting, forward budget or grammar): unknown options here,
# as they were before its rows were built by build_decode
NOT_ROW_OPTIONS = ("fit_context", "max_forwards", "response_format", "image", "video", "vision")


def refuse_non_options(kwargs: dict) -> None:
    """TypeError (DecodeOptions' for an unknown name) for a keyword in NOT_ROW_OPTIONS."""
    unknown = sorted(set(kwargs) & set(NOT_ROW_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected options {unknown}; generate_batch takes the decoding options only")


def generate_batch(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Union[str, Sequence[int]]],
    prompt_caches: Optional[List[List[Any]]] = None,
    max_tokens: Union[int, List[int]] = 128,
    verbose: bool = False,
    return_prompt_caches: bool = False,
    return_token_ids: bool = False,
    return_logprobs: bool = False,
    **kwargs,
) -> DiffusionBatchResponse:
    """Decode prompts of any lengths together (mlx_lm.batch_generate's signature and
    return). Decoding options (keywords, as for stream_generate) apply to every row;
    `max_tokens` may be one per prompt. Each row's text excludes its EOS. `suffix`:
    every row infills before it (as `stream_generate`; a keyword, so that the signature
    stays mlx_lm.batch_generate's). `logits_processors`: one list shared by every row
    (stateless processors, as mlx-lm's batch-wide ones), or one list per prompt (as
    mlx-lm's `BatchGenerator.insert` takes them), which a stateful processor needs: each
    row feeds its own processors its own committed tokens."""
    suffix = kwargs.pop("suffix", None)
    drop_cache_options(kwargs)  # (mlx_lm.batch_generate's scheduling keywords, as stream_generate's)
    if prompt_caches is not None:
        raise ValueError("a diffusion model keeps no prompt key/value cache to resume: pass prompt_caches=None")
    tokenizer = text_tokenizer(tokenizer)  # (a processor's tokenizer: text prompts only here)
    ids = prompt_ids(tokenizer, prompts)
    limits = [max_tokens] * len(ids) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(ids):
        raise ValueError(f"max_tokens has {len(limits)} entries for {len(ids)} prompts")
    refuse_non_options(kwargs)
    adapter = adapter_for(model, tokenizer)  # (one for every row: build_decode builds none)
    batch = RunningBatch(adapter, keep_logprobs=return_logprobs)
    processors = row_processors(kwargs.pop("logits_processors", None), len(ids))
    results = {}
    for prompt, limit, row_kwargs in zip(ids, limits, processors):
        decode = build_decode(model, tokenizer, prompt, limit, adapter=adapter, suffix=suffix, **kwargs, **row_kwargs)
        results[batch.add_decode(decode).id] = _RowResult(decode.ids)
    eos_ids = decode.options.eos_ids  # (every row's: the rows share their options but max_tokens)
    stats = _drive(batch, results, eos_ids, verbose)
    rows = list(results.values())
    token_ids = [_without_eos(r, eos_ids) for r in rows]
    texts = [tokenizer.decode(t) for t in token_ids]
    caches = [[TokenCache(r.prompt + t)] for r, t in zip(rows, token_ids)] if return_prompt_caches else None
    if verbose:
        print(f"[batch_generate] Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
        print(
            f"[batch_generate] Generation: {stats.generation_tokens} tokens, "
            f"{stats.generation_tps:.3f} tokens-per-sec, {batch.forwards} batched forwards"
        )
        print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
    return DiffusionBatchResponse(
        texts,
        stats,
        caches,
        token_ids if return_token_ids else None,
        [r.logprobs[: len(t)] for r, t in zip(rows, token_ids)] if return_logprobs else None,
        forwards=[r.forwards for r in rows],
        finish_reasons=[r.finish for r in rows],
    )


def _drive(batch: RunningBatch, results: dict, eos_ids: frozenset, verbose: bool) -> BatchStats:
    """Step the batch until every row is out; the stats of the run."""
    tic = time.perf_counter()
    prompt_time, finished = None, 0
    while len(batch):
        for event in batch.step():
            _collect(event, results[event.row.id], eos_ids)
            if event.finished:
                finished += 1
                if verbose:
                    print(f"[batch_generate] Finished processing {finished}/{len(results)} ...", end="\r")
        if prompt_time is None:  # the first step runs every row's prefill and first forward
            prompt_time = time.perf_counter() - tic
    wall = time.perf_counter() - tic
    rows = results.values()
    return BatchStats(
        prompt_tokens=sum(len(r.prompt) for r in rows),
        prompt_time=prompt_time or 0.0,
        generation_tokens=sum(len(r.tokens) for r in rows),
        generation_steps=batch.forwards,
        decode_time=wall - (prompt_time or 0.0),
        wall_time=wall,
        peak_memory=mx.get_peak_memory() / 1e9,
    )


def _collect(event: RowEvent, result: _RowResult, eos_ids: frozenset) -> None:
    if event.error is not None:
        raise event.error
    step, P = event.step, len(result.prompt)
    if step is None:  # (a row that ended before its first step)
        result.finish = result.finish or "length"
        return
    for position in range(P + len(result.tokens), P + int(step.final[0])):
        token = int(step.canvas[0, position])
        result.tokens.append(token)
        logprobs = step.logprobs(0, position)
        if logprobs is not None:
            result.logprobs.append(logprobs[token].item())
    result.forwards = step.forwards
    if event.finished:
        stop = bool(result.tokens) and result.tokens[-1] in eos_ids
        result.finish = "stop" if stop else "length"


def _without_eos(result: _RowResult, eos_ids: frozenset) -> List[int]:
    tokens = result.tokens
    return tokens[:-1] if tokens and tokens[-1] in eos_ids else list(tokens)
