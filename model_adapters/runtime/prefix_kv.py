"""Keys and values of a prompt's leading positions, kept from one decode for the next.

Where a family's keys and values at a position depend only on the tokens at and before
it, laid out the same way in every decode (causal attention; block-causal attention on
absolute blocks), a later prompt that starts with the same tokens gets the same keys and
values from a cold prefill: the earlier decode's can be reused and only the new tail
prefilled. `PrefixKV` is what an adapter exports after a decode (`Adapter.export_prefix`)
and takes back at the start of the next (`Adapter.start(prompt, reuse=...)`).

The arrays are never written to once exported: `caches()` hands out KV caches whose
buffers are exactly `length` long, so the first write of a decode allocates a new buffer
(mlx-lm's KVCache concatenates when full) and the prefix itself can be shared between a
prompt cache and any number of decodes without copying.

Bidirectional families (LLaDA, Dream) export nothing: their keys and values depend on
every position of the canvas, including the ones still masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

CAUSAL = "causal"


def block_causal(block: int) -> str:
    """The `kind` of keys and values computed with block-causal attention over `block`."""
    return f"block_causal:{block}"


@dataclass(frozen=True)
class PrefixKV:
    """Per layer, the keys and values (B, heads, length, dim) of positions [0, length),
    as a cold prefill of the same tokens computes them."""

    keys: tuple
    values: tuple
    kind: str  # the attention layout that computed them (CAUSAL, block_causal(b))
    block: int = 1  # reusable in whole multiples of this only (block-causal: the attention block)

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[2]) if self.keys else 0

    @property
    def rows(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values))

    @classmethod
    def of(cls, caches: Sequence[KVCache], length: int, kind: str, block: int = 1) -> Optional["PrefixKV"]:
        """Compact copies of the first `length` positions of `caches` (rounded down to
        `block`); None when that leaves nothing or a cache is not a plain KVCache."""
        if not caches or any(type(c) is not KVCache or c.keys is None for c in caches):
            return None
        length = min(length, min(c.offset for c in caches)) // block * block
        if length <= 0:
            return None
        # contiguous copies: a slice would keep the decode's whole buffer alive
        keys = tuple(mx.contiguous(c.keys[..., :length, :]) for c in caches)
        values = tuple(mx.contiguous(c.values[..., :length, :]) for c in caches)
        mx.eval(keys, values)
        return cls(keys, values, kind, block)

    def trimmed(self, length: int) -> Optional["PrefixKV"]:
        """The first `length` positions (rounded down to `block`); None when none remain."""
        length = min(length, self.length) // self.block * self.block
        if length == self.length:
            return self
        if length <= 0:
            return None
        cut = lambda arrays: tuple(a[..., :length, :] for a in arrays)  # noqa: E731
        return PrefixKV(cut(self.keys), cut(self.values), self.kind, self.block)

    def caches(self) -> list:
        """Fresh KV caches holding these positions (their buffers are these arrays, exactly
        `length` long: a decode's first write reallocates and never writes into them)."""
        out = []
        for k, v in zip(self.keys, self.values):
            cache = KVCache()
            cache.state = (k, v, self.length)
            out.append(cache)
        return out


def usable(prefix: Optional[PrefixKV], kind: str, rows: int, limit: int) -> int:
    """How many leading positions of `prefix` a decode of `rows` rows may start from, when
    its own attention layout is `kind` and at most `limit` positions may come from a cache
    (rounded down to the prefix's block); 0 when it has another layout or row count."""
    if prefix is None or prefix.kind != kind or prefix.rows != rows:
        return 0
    return max(0, min(prefix.length, limit)) // prefix.block * prefix.block


__all__ = ["PrefixKV", "CAUSAL", "block_causal", "usable"]


def keep_first(cache: list, length: int) -> None:
    """Trim every layer's KVCache of `cache` to its first `length` positions (a speculative
    round's rejected drafts and masks: self-speculation, I-DLM)."""
    excess = cache[0].offset - length
    if excess < 0:
        raise RuntimeError(f"cache holds {cache[0].offset} positions, cannot keep {length}")
    for c in cache:
        c.trim(excess)
