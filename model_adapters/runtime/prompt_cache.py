"""The prompt cache of a diffusion model, as mlx-lm's server and chat keep it.

LLaDA and Dream attend bidirectionally over the whole canvas, so no key/value state
survives a decode. What a cache can honestly hold across calls is the token sequence it
stands for; the next decode re-reads it as the start of its prompt. For the families
whose prompt keys and values are exact (block-causal, causal prefix, causal encoder) it
also holds the KV of its leading tokens, which the next decode starts from
(mlx_lm_diffusion.decoding.kv_reuse). `TokenCache` is
trimmable (mlx-lm's LRU prompt cache trims to shared prefixes) and has no `merge`, so
mlx-lm's server serves these models one request at a time instead of batching them.

Every diffusion model's `make_cache()` returns `[TokenCache()]`, so mlx-lm's own
`make_prompt_cache(model)` hands one out without any patching.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from model_adapters.runtime.prefix_kv import PrefixKV


class TokenCache(_BaseCache):
    """The prompt cache of a diffusion model: the token ids it stands for."""

    def __init__(self, tokens: Optional[Sequence[int]] = None):
        self.tokens: List[int] = [int(t) for t in tokens or ()]
        # The keys and values of the leading tokens, for the families where they are exact
        # (mlx_lm_diffusion.decoding.kv_reuse): never longer than `tokens`, trimmed with them.
        self._kv: Optional[PrefixKV] = None
        self._kv_source: Optional[Callable[[List[int]], Optional[PrefixKV]]] = None

    @property
    def kv(self) -> Optional[PrefixKV]:
        """The KV of the first `kv.length` tokens (None: tokens only). While a decode holds
        the cache (`hold_kv`), the first read takes the decode's KV for the tokens so far."""
        if self._kv_source is not None:
            source, self._kv_source = self._kv_source, None
            kv = source(list(self.tokens))
            self._kv = kv if kv is None or kv.length <= len(self.tokens) else kv.trimmed(len(self.tokens))
        return self._kv

    def hold_kv(self, source: Callable[[List[int]], Optional[PrefixKV]]) -> None:
        """Let a running decode provide the KV (`source(tokens)`: its KV of the leading
        positions of these tokens), read when the cache is next used, trimmed or copied."""
        self._kv, self._kv_source = None, source

    def __deepcopy__(self, memo) -> "TokenCache":
        # The KV arrays are never written to (model_adapters.runtime.prefix_kv): a copy shares them.
        copy = TokenCache(self.tokens)
        copy._kv = self.kv
        return copy

    def add(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    @property
    def offset(self) -> int:
        return len(self.tokens)

    def size(self) -> int:
        return len(self.tokens)

    @property
    def state(self):
        return mx.array(self.tokens, dtype=mx.int32)

    @state.setter
    def state(self, v):
        self.tokens = [int(t) for t in v.tolist()] if v is not None else []
        self._kv = self._kv_source = None  # (the state is the tokens alone)

    def update_and_fetch(self, keys, values):
        """What an autoregressive decoding loop calls on a KV cache: refused with what
        to do (this cache holds tokens, not keys and values)."""
        raise ValueError(
            "a diffusion model's prompt cache (TokenCache) holds tokens, not keys and values, so "
            "mlx-lm's autoregressive decoding (generate_step, stream_generate bound before install(), "
            "cache_prompt) cannot drive the model: call mlx_lm_diffusion.install() before importing "
            "stream_generate/generate from mlx_lm, or call mlx_lm_diffusion.stream_generate"
        )

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = max(0, min(n, len(self.tokens)))
        if n:
            del self.tokens[-n:]
            if self.kv is not None:
                self._kv = self._kv.trimmed(len(self.tokens))
        return n

    def empty(self) -> bool:
        return not self.tokens

    @property
    def nbytes(self) -> int:
        return 4 * len(self.tokens) + (self.kv.nbytes if self.kv is not None else 0)

    def __repr__(self) -> str:
        held = f", KV of {self._kv.length}" if self._kv is not None else ""
        return f"TokenCache({len(self.tokens)} tokens{held})"


__all__ = ["TokenCache"]
