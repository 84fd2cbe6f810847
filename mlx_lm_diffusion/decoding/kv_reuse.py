"""Prompt keys and values reused across requests, for the families where they are exact.

SDAR and LLaDA2 (block-causal on absolute blocks), Nemotron-Labs Diffusion's causal
prefix, DiffusionGemma's causal encoder and the ar adapter compute the same keys and
values for the same leading tokens in any prompt (model_adapters.runtime.prefix_kv). A decode
then leaves the KV of its final tokens in its prompt cache (a `TokenCache`, which holds
it beside the tokens it stands for), mlx-lm's LRUPromptCache keeps that cache under
"prompt + tokens yielded", and the next request that shares a prefix (a follow-up chat
turn, a common system prompt) prefills only what follows it.

LLaDA and Dream attend bidirectionally over the whole canvas: their keys and values
depend on every position, masks included, so they reuse nothing (Fast-dLLM's `cache`
option keeps KV within one decode only). Their prompt caches hold tokens only and report
0 cached tokens.

* `PromptReuse`: one decode's side (what it may start from, how much it took, what it
  leaves), handed to `generation.stream_generate(prompt_kv=...)`.
* `cache_occupancy`: entries, bytes and tokens of an LRUPromptCache (the server's /v1/stats).
* `CachedTokensTap`: the response queue of one server request, setting mlx-lm's
  `GenerationContext.prompt_cache_count` (usage.prompt_tokens_details.cached_tokens) to
  the prompt positions whose KV was reused, not the tokens the cache matched.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from model_adapters import PrefixKV


class PromptReuse:
    """One decode's use of a cached prefix: `prefix` (the KV of the prompt's leading
    tokens, from an earlier decode) in; `reused` (prompt positions it took) and
    `export(length)` (the KV it leaves) out."""

    def __init__(self, prefix: Optional[PrefixKV] = None):
        self.prefix = prefix
        self.reused = 0
        self._adapter: Any = None
        self._engine: Any = None

    def plan(self, adapter: Any, engine: Any, prompt: Any) -> Optional[PrefixKV]:
        """The part of `prefix` the engine's decode (its options and inputs: `engine.setup`)
        starts from; None: a cold prefill."""
        self._adapter, self._engine = adapter, engine
        if self.prefix is None:
            return None
        n = int(adapter.reuse_length(self.prefix, prompt, setup=engine.setup))
        if n <= 0:
            return None
        reuse = self.prefix.trimmed(n)
        if reuse is None or reuse.length != n:
            raise RuntimeError(f"{adapter.family}: reuse_length {n} is not a whole number of the prefix's blocks")
        self.reused = n
        return reuse

    def export(self, tokens: Sequence[int]) -> Optional[PrefixKV]:
        """The KV the decode leaves for the leading positions of `tokens` (what the prompt
        cache stands for: prompt + tokens yielded), as its adapter vouches for them, cut
        where the canvas differs from `tokens` (a token edited after it was yielded, or a
        prompt token an editing rule revised); None before the decode started, or for a
        family that reuses nothing."""
        state = getattr(self._engine, "state", None)
        if self._adapter is None or state is None:
            return None
        prefix = self._adapter.export_prefix(state, len(tokens))
        if prefix is None:
            return None
        canvas = np.array(self._engine.canvas.tokens[0, : prefix.length])
        differs = np.flatnonzero(canvas != np.asarray(tokens[: prefix.length]))
        return prefix if not differs.size else prefix.trimmed(int(differs[0]))


def cache_occupancy(prompt_cache: Any) -> dict:
    """Entries, bytes, tokens (what the entries stand for) and kv_tokens (the positions
    whose keys and values they hold) of mlx-lm's LRUPromptCache. Reads its LRU order and
    trie (pinned by tests/decoding/test_kv_reuse.py's contract test)."""
    entries = tokens = kv_tokens = 0
    for lru in prompt_cache._lru._lrus.values():
        for model, key in lru:
            entries += 1
            tokens += len(key)
            entry = prompt_cache._trie.get(model, key)
            kv = [getattr(c, "kv", None) for c in entry.prompt_cache]
            kv_tokens += max((p.length for p in kv if p is not None), default=0)
    return {"entries": entries, "bytes": int(prompt_cache.nbytes), "tokens": tokens, "kv_tokens": kv_tokens}


class CachedTokensTap:
    """A request's response queue as mlx_lm.server's `_serve_single` fills it: notes the
    GenerationContext it puts first (cached tokens 0 until the decode says otherwise) so
    that `report` can set how many prompt positions the decode took from the cache. The
    decode reports before its first token is queued, so the handler reads the final count."""

    def __init__(self, queue: Any):
        self.queue = queue
        self.context: Any = None  # mlx_lm.server.GenerationContext

    def put(self, item: Any) -> None:
        from mlx_lm.server import GenerationContext  # (the server's module: imported by the caller)

        if isinstance(item, GenerationContext) and self.context is None:
            self.context = item
            item.prompt_cache_count = 0  # mlx-lm counted matched tokens; none reused yet
        self.queue.put(item)

    def report(self, reused: int) -> None:
        if self.context is not None:
            self.context.prompt_cache_count = int(reused)


__all__ = ["PromptReuse", "cache_occupancy", "CachedTokensTap"]
