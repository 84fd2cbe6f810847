"""Any mlx-lm causal LM as a degenerate diffusion model (the protocol's "ar" adapter).

Causal attention, the autoregressive logit shift and an exact prefix KV cache: the
first masked position gets the model's prediction (read from the position before it),
every other masked position a uniform distribution. Under a schedule that unmasks
one most-confident position per step this is greedy autoregressive decoding, which is
the step-schedule protocol's autoregressive-equivalence invariant.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from model_adapters.base import NO_SETUP, Adapter, DecodeSetup, FamilyDefaults, _stop_ids
from model_adapters.runtime import batched
from model_adapters.runtime.prefix_kv import CAUSAL, PrefixKV, usable

# A canvas sentinel outside every vocabulary: it is never embedded (only the committed
# prefix is fed to the model) and never proposed.
AR_MASK_ID = -1


class ArAdapter(Adapter):
    family = "autoregressive (any mlx-lm causal LM)"
    # One position per block and one step per block: next-token decoding.
    defaults = FamilyDefaults(block_length=1, strategy="low_confidence")
    suffix_refusal = "its attention is causal: a token never sees text after it"
    likelihood_layout = None

    def __init__(self, model: nn.Module, tokenizer: Any = None):
        self.model = model
        args = model.args
        self.mask_id = AR_MASK_ID
        self.vocab_size = int(args.vocab_size)
        self.max_length = getattr(args, "max_position_embeddings", None)
        self.eos_ids = frozenset(_stop_ids(args, tokenizer))

    # AR_MASK_ID lies outside the vocabulary: nothing to suppress
    suppress_ids = frozenset()

    def check_resolved(self, options: Any) -> None:
        """Only the next position has a prediction (every later one gets a uniform
        distribution): an edit of a committed one would write filler tokens; refuse it
        before anything runs (a rule committing other positions: `predicts_next_only`)."""
        if options.editing_threshold is not None:
            raise ValueError(
                "editing_threshold does not apply to the autoregressive adapter: it predicts "
                "only the next token, never a committed one; drop it"
            )

    # Only the next position has a prediction: the decoding layer refuses, before
    # anything runs, a rule that would commit any other (commit_rules.commits_next_only).
    predicts_next_only = True

    def next_only_refusal(self, options: Any) -> str:
        return (
            f"the autoregressive adapter predicts one token per forward, the next: strategy "
            f"{options.rule.name!r} with block_length {options.block_length} and {options.steps} steps "
            "would commit other positions too (filler tokens): unmask one token per step (block_length "
            "1; or steps = block_length, low_confidence; the protocol: num_steps = target_length - "
            "prompt length, linear)"
        )

    def start(self, prompt: mx.array, reuse: Optional[PrefixKV] = None, setup: DecodeSetup = NO_SETUP) -> dict:
        if prompt.shape[0] != 1:
            raise ValueError("the autoregressive adapter decodes one prompt at a time")
        cache = make_prompt_cache(self.model) if reuse is None else reuse.caches()
        if not can_trim_prompt_cache(cache):
            raise ValueError("this model's cache cannot be trimmed; the ar adapter needs KVCache layers")
        fed = 0 if reuse is None else reuse.length  # (the first predict feeds the rest)
        tokens = np.array(prompt[0, :fed]).astype(np.int64)
        # fed: positions in the cache; tokens: their ids (host, kept for editing);
        # next: the prediction for position `fed`; block: the block of the last predict
        # editing: a committed token may change (without it the cache never needs checking
        # against the canvas)
        editing = getattr(setup.options, "editing_threshold", None) is not None
        return {"cache": cache, "fed": fed, "tokens": tokens, "next": None, "block": None, "editing": editing}

    def reuse_length(self, prefix: Optional[PrefixKV], prompt: mx.array, setup: DecodeSetup = NO_SETUP) -> int:
        """Causal attention: the same leading tokens have the same KV in any prompt. At least
        the last prompt token is fed again (it predicts the first generated token)."""
        if prompt.shape[0] != 1 or any(type(c) is not KVCache for c in make_prompt_cache(self.model)):
            return 0
        return usable(prefix, CAUSAL, 1, prompt.shape[1] - 1)

    def export_prefix(self, state: dict, length: int) -> Optional[PrefixKV]:
        """The fed positions: committed tokens, which never change without editing (with
        editing a token fed may be revised after its last feed: nothing is exported)."""
        if state is None or state["editing"]:
            return None
        return PrefixKV.of(state["cache"], min(length, state["fed"]), CAUSAL)

    def predict(self, state: dict, canvas: mx.array, start: int, end: int) -> mx.array:
        if state["block"] != start and not state["editing"]:
            # A block's first step: the engine finished every block before it and this one
            # is all masks, so the first mask is `start` and the new tokens are fed straight
            # from the device canvas (no read-back: the engine may still be computing them).
            first = start
            self._feed(state, canvas[:, state["fed"] : start])
        else:
            row = np.array(canvas[0])
            masked = np.flatnonzero(row == self.mask_id)
            first = int(masked[0]) if masked.size else row.size
            self._sync_cache(state, row, first)
        state["block"] = start
        if first == start and end - start == 1:  # (next-token decoding: no other position)
            return state["next"]
        logits = mx.zeros((1, end - start, self.vocab_size))
        if start <= first < end:
            logits[:, first - start] = state["next"][:, 0]
        return logits

    def predict_batch(self, requests: list) -> list:
        """Next-token steps of many rows (a block's first step at block length 1: each row
        feeds what it committed since, `predict`'s fast path) in one model call
        (model_adapters.runtime.batched.causal_feed_batch); any other request alone."""
        batchable = [i for i, r in enumerate(requests) if self._next_token_step(r)]
        if len(batchable) < 2:
            return super().predict_batch(requests)

        out = [
            None if i in batchable else self.predict(r.state, r.canvas, r.start, r.end) for i, r in enumerate(requests)
        ]
        rows = [requests[i] for i in batchable]
        logits = batched.causal_feed_batch(
            self.model, [r.state["cache"] for r in rows], [r.canvas[:, r.state["fed"] : r.start] for r in rows]
        )
        for i, r, row_logits in zip(batchable, rows, logits):
            r.state["fed"], r.state["block"], r.state["next"] = r.start, r.start, row_logits
            out[i] = row_logits
        if len(batchable) == len(requests):
            logits[:] = out  # (the same arrays: the batch's stacked head stays readable)
            return logits
        return out

    def _next_token_step(self, request: Any) -> bool:
        state = request.state
        return (
            request.end - request.start == 1
            and state["block"] != request.start
            and not state["editing"]
            and request.start > state["fed"]
            and all(type(c) is KVCache for c in state["cache"])
        )

    def _feed(self, state: dict, tokens: mx.array) -> None:
        out = self.model(tokens, cache=state["cache"])[:, -1:]  # (1, 1, V)
        state["next"] = out if out.dtype == mx.float32 else out.astype(mx.float32)
        state["fed"] += tokens.shape[1]

    def _sync_cache(self, state: dict, row: np.ndarray, first: int) -> None:
        """Make the cache hold exactly row[:first] and `next` the prediction for `first`."""
        fed = keep = state["fed"]
        if state["editing"]:  # a committed token may have changed
            changed = np.flatnonzero(state["tokens"] != row[:fed])
            keep = int(changed[0]) if changed.size else fed
        if state["next"] is None or keep < fed or fed > first:
            keep = min(keep, first - 1, fed)  # re-feed at least the token before `first`
        if keep < fed:
            trim_prompt_cache(state["cache"], fed - keep)
            state["fed"] = keep
        if keep < first:
            self._feed(state, mx.array(row[None, keep:first]))
        state["tokens"] = row[:first].copy()
