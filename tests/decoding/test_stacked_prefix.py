"""The stacked prefix cache of batched block-causal steps (model_adapters.runtime.stacked_prefix):
what a step reads equals each row's own cache, as rows join, grow, leave and come back,
and a batch whose rows come and go over a long decode gives every row its tokens alone."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from test_batch import alone, batched

from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from model_adapters import adapter_for
from model_adapters.attention.block_cache import PrefixCache
from model_adapters.runtime.model_cache import model_cache
from model_adapters.runtime.stacked_prefix import POSITION_STEP, StackedPrefix

HEADS, DIM, LAYERS = 2, 8, 2


def row(rng, length):
    """A PrefixCache holding `length` random positions per layer."""
    state = PrefixCache(layers=[KVCache() for _ in range(LAYERS)])
    grow(rng, state, length)
    return state


def grow(rng, state, n):
    for cache in state.layers:
        cache.update_and_fetch(
            mx.array(rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32)),
            mx.array(rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32)),
        )


def check_read(stacked, states, width):
    prefixes = stacked.read(states, width)
    assert len(prefixes) == LAYERS
    for layer, (keys, values) in enumerate(prefixes):
        assert keys.shape == (len(states), HEADS, width, DIM)
        for i, state in enumerate(states):
            n, cache = state.stored, state.layers[layer]
            if not n:
                continue
            assert mx.array_equal(keys[i, :, :n], cache.keys[0, :, :n])
            assert mx.array_equal(values[i, :, :n], cache.values[0, :, :n])


def test_read_equals_each_rows_cache_as_rows_join_grow_and_leave():
    rng = np.random.default_rng(0)
    stacked = StackedPrefix()
    a, b, c = row(rng, 8), row(rng, 4), row(rng, 12)
    check_read(stacked, [a, b], 16)
    grow(rng, b, 4)  # (a block stored by a step decoded alone)
    check_read(stacked, [a, b, c], 16)  # c joins
    check_read(stacked, [c, a], 16)  # b left: its slot is freed; the rows in another order (a gather)
    assert stacked.owners.count(None) == 1
    d = row(rng, 20)
    check_read(stacked, [c, a, d], 32)  # d takes b's slot; a wider read
    assert len(stacked.owners) == 3
    check_read(stacked, [a, b, c, d], 32)  # b comes back: copied from its cache again
    grow(rng, d, POSITION_STEP)  # past the buffers' capacity: they grow, keeping what they hold
    check_read(stacked, [a, b, c, d], POSITION_STEP + 32)
    assert stacked.capacity >= POSITION_STEP + 32


def test_a_reused_prefix_and_an_empty_row():
    """A row that starts from another decode's KV (its cache holds positions it never
    computed in this batch) and a row that holds nothing yet."""
    rng = np.random.default_rng(1)
    stacked = StackedPrefix()
    full, empty = row(rng, 16), PrefixCache(layers=[KVCache() for _ in range(LAYERS)])
    check_read(stacked, [empty, full], 16)
    grow(rng, empty, 8)
    check_read(stacked, [empty, full], 16)


def test_bad_reads_are_refused():
    rng = np.random.default_rng(2)
    stacked, a = StackedPrefix(), row(rng, 8)
    with pytest.raises(ValueError):
        stacked.read([a, a], 8)
    with pytest.raises(ValueError):
        stacked.read([PrefixCache(layers=[])], 8)
    with pytest.raises(ValueError):
        stacked.read([a], 4)  # narrower than what the row holds


def test_rows_joining_and_leaving_over_a_long_decode_give_their_tokens_alone(sdar):
    """Rows join at several steps (one after another left), of different prompt lengths
    and max_tokens, so the slots are reused and the stacked width changes: every row's
    tokens and forward count are those of its decode alone."""
    adapter = adapter_for(*sdar)
    prompts = [[3 + i] * (5 + 7 * i) for i in range(6)]
    max_tokens = [6, 20, 9, 14, 5, 12]
    options = [resolve(DecodeOptions(max_tokens=n), adapter, len(p)) for p, n in zip(prompts, max_tokens)]
    expected = [alone(adapter, p, o) for p, o in zip(prompts, options)]
    joins = {0: [0, 1], 2: [2], 5: [3], 9: [4, 5]}  # step -> rows joining then
    assert batched(adapter, prompts, options, joins=joins) == expected
    assert len(model_cache(adapter.model)["stacked prefix"].owners) < len(
        prompts
    )  # (slots of rows that left were reused)
