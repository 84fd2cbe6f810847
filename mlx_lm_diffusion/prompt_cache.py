"""The prompt cache of a diffusion model, as mlx-lm's server and chat keep it.

LLaDA and Dream attend bidirectionally over the whole canvas, so no key/value state
survives a decode (the block-causal and causal-prefix families rebuild theirs per
decode). What a cache can honestly hold across calls is the token sequence it stands
for; the next decode re-reads it as the start of its prompt. `TokenCache` is
trimmable (mlx-lm's LRU prompt cache trims to shared prefixes) and has no `merge`, so
mlx-lm's server serves these models one request at a time instead of batching them.

Every diffusion model's `make_cache()` returns `[TokenCache()]`, so mlx-lm's own
`make_prompt_cache(model)` hands one out without any patching.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import _BaseCache

from model_adapters import is_diffusion_model


class TokenCache(_BaseCache):
    """The prompt cache of a diffusion model: the token ids it stands for."""

    def __init__(self, tokens: Optional[Sequence[int]] = None):
        self.tokens: List[int] = [int(t) for t in tokens or ()]

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
        return n

    def empty(self) -> bool:
        return not self.tokens

    @property
    def nbytes(self) -> int:
        return 4 * len(self.tokens)

    def __repr__(self) -> str:
        return f"TokenCache({len(self.tokens)} tokens)"


def make_prompt_cache(model: nn.Module, max_kv_size: Optional[int] = None) -> List[Any]:
    """mlx-lm's `make_prompt_cache` for a diffusion model: one `TokenCache`
    (`max_kv_size` does not apply: there is no key/value cache to bound)."""
    if not is_diffusion_model(model):
        raise ValueError("make_prompt_cache here is for diffusion models; use mlx-lm's for others")
    return [TokenCache()]


__all__ = ["TokenCache", "make_prompt_cache"]
