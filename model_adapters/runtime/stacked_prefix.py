"""Every batch row's cached prefix keys and values, kept stacked across steps.

A batched block-causal step (model_adapters.runtime.batched.block_causal_batch) attends each
row's window to that row's cached prefix. Stacking the rows' own KVCaches afresh at every
step (slice, left-pad, concatenate, per row and layer) costs about six MLX ops per row and
layer, more than the rest of a small model's forward. `StackedPrefix` keeps instead, per
layer, one preallocated (slots, H, capacity, D) buffer, as mlx-lm's BatchKVCache lays a
batch out, but right-padded: slot s holds its row's positions [0, length_s) at columns
[0, length_s), so column j is position j in every row and a row's new blocks are written
after what it holds, whatever the other rows hold. A step reads its rows' prefixes with
one slice (or one gather) per layer; the columns past a row's length are masked out by the
caller.

The rows' own caches (PrefixCache.layers) stay the source of truth: a slot copies from its
row's cache what the row stored since the slot last read it (the positions [0, stored) of
a prefix cache are final, so they never change once stored), so every path that writes a
row's cache (its prefill, a reused prompt prefix, a step decoded alone, a batched step)
is seen at the next read. Slots of rows absent from a read are freed (their rows left).
The buffers duplicate the rows' keys and values: memory for the batch's KV doubles.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx

from model_adapters.runtime.model_cache import model_cache

POSITION_STEP = 256  # the buffers' position capacity grows in steps of this (KVCache's step)


class StackedPrefix:
    """Stacked cached prefixes of the rows of a batch, one slot per row."""

    def __init__(self) -> None:
        self.keys: list = []  # per layer (slots, H, capacity, D)
        self.values: list = []
        self.owners: list = []  # per slot: the row's PrefixCache, or None (free)
        self.lengths: list = []  # per slot: the positions [0, length) it holds

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def read(self, states: Sequence[Any], width: int) -> list:
        """Per layer, (keys, values) (len(states), H, width, D): row i's cached positions
        [0, states[i].stored) at columns [0, stored), anything after them (mask it out).
        Every state must hold KVCaches (`layers`) with at most `width` positions."""
        if not states or not all(s.layers for s in states):
            raise ValueError("StackedPrefix.read needs rows with a prefix cache")
        filled = next((s.layers for s in states if s.stored), None)
        if filled is None:
            raise ValueError("StackedPrefix.read needs a row with a cached prefix")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a row appears twice in one batched step")
        longest = max(s.stored for s in states)
        if longest > width:
            raise ValueError(f"a row holds {longest} cached positions, more than the {width} read")
        slots = self._place(states)
        self._reserve(len(self.owners), width, filled)
        for slot, state in zip(slots, states):
            self._sync(slot, state)
        if slots == list(range(len(slots))):
            pick = lambda buffer: buffer[: len(slots), :, :width]  # noqa: E731
        else:
            index = mx.array(slots)
            pick = lambda buffer: mx.take(buffer, index, axis=0)[:, :, :width]  # noqa: E731
        return [(pick(k), pick(v)) for k, v in zip(self.keys, self.values)]

    def clear(self) -> None:
        self.keys, self.values, self.owners, self.lengths = [], [], [], []

    def _place(self, states: Sequence[Any]) -> list:
        """Each state's slot: the one it had, else a free one (slots of rows absent from
        this read are freed first: those rows left the batch)."""
        present = {id(s) for s in states}
        where = {}
        for slot, owner in enumerate(self.owners):
            if owner is not None and id(owner) in present:
                where[id(owner)] = slot
            elif owner is not None:
                self.owners[slot], self.lengths[slot] = None, 0
        slots = []
        for state in states:
            slot = where.get(id(state))
            if slot is None:
                slot = next((s for s, owner in enumerate(self.owners) if owner is None), len(self.owners))
                if slot == len(self.owners):
                    self.owners.append(None)
                    self.lengths.append(0)
                self.owners[slot], self.lengths[slot] = state, 0
            slots.append(slot)
        return slots

    def _reserve(self, slots: int, width: int, layers: list) -> None:
        """Grow the buffers to at least `slots` rows and `width` positions (copying what
        they hold); `layers`: a row's per-layer caches (their shapes and dtypes)."""
        have_slots = self.keys[0].shape[0] if self.keys else 0
        if self.keys and have_slots >= slots and self.capacity >= width:
            return
        new_slots = max(slots, 2 * have_slots, 4)
        new_capacity = max(self.capacity, -(-width // POSITION_STEP) * POSITION_STEP)
        grown_keys, grown_values = [], []
        for layer, like in enumerate(layers):
            heads, dim = like.keys.shape[1], like.keys.shape[3]
            k = mx.zeros((new_slots, heads, new_capacity, dim), like.keys.dtype)
            v = mx.zeros((new_slots, heads, new_capacity, like.values.shape[3]), like.values.dtype)
            if self.keys:
                k[:have_slots, :, : self.capacity] = self.keys[layer]
                v[:have_slots, :, : self.capacity] = self.values[layer]
            grown_keys.append(k)
            grown_values.append(v)
        self.keys, self.values = grown_keys, grown_values

    def _sync(self, slot: int, state: Any) -> None:
        """Copy into the slot what its row stored since the slot last read it."""
        stored, have = state.stored, self.lengths[slot]
        if stored < have:  # (a cache that shrank: not a prefix cache's; copy it all again)
            have = 0
        if stored > have:
            for layer, cache in enumerate(state.layers):
                self.keys[layer][slot : slot + 1, :, have:stored] = cache.keys[..., have:stored, :]
                self.values[layer][slot : slot + 1, :, have:stored] = cache.values[..., have:stored, :]
        self.lengths[slot] = stored


def stacked_prefix_of(adapter: Any) -> StackedPrefix:
    """The StackedPrefix of the adapter's model (runtime.model_cache; made on first use)."""
    cache = model_cache(adapter.model)
    stacked: Optional[StackedPrefix] = cache.get("stacked prefix")
    if stacked is None:
        stacked = cache["stacked prefix"] = StackedPrefix()
    return stacked
