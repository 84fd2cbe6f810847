"""The exact prefix KV cache of block-causal models (model_adapters.attention.block_cache):
identical tokens and forward counts with and without it, each step runs only the
current block against the cache, and the cache grows with the prefix, not the steps.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_arsenal.attention import block_causal_mask
from mlx_lm.models.cache import KVCache

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
from mlx_lm_diffusion.testing.block_checkpoints import write_llada2, write_sdar
from model_adapters import adapter_for
from model_adapters.attention.block_cache import window_mask


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("block")
    return {
        "sdar": mld.load(str(write_sdar(root / "sdar"))),
        "llada2": mld.load(str(write_llada2(root / "llada2"))),
    }


def test_window_mask_is_the_block_causal_mask_rows():
    for offset, stop, block in [(0, 10, 4), (4, 12, 4), (8, 12, 4), (3, 9, 4), (0, 70, 32), (32, 64, 32)]:
        mask = window_mask(offset, stop, block)
        full = np.array(block_causal_mask(stop, block) == 0)[0, 0, offset:stop]
        if mask is None:  # a window inside one block that starts on its boundary sees everything
            assert full.all() and offset % block == 0
        else:
            assert (np.array(mask)[0, 0] == full).all()
    assert window_mask(8, 12, 4) is None and window_mask(32, 50, 32) is None


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_cached_continuation_equals_one_forward(families, family):
    model, _ = families[family]
    block = model.block_size
    ids = mx.array(np.random.default_rng(1).integers(0, 256, (2, 3 * block + 3)))
    full = model(ids)
    cache = [KVCache() for _ in model.layers]
    first = model(ids[:, : 2 * block], cache=cache)
    rest = model(ids[:, 2 * block :], cache=cache)
    assert cache[0].offset == ids.shape[1]
    assert np.abs(np.array(mx.concatenate([first, rest], axis=1) - full)).max() <= 1e-4  # float32 rounding


class Spy:
    """The model, recording each forward's (window width, cache offset)."""

    def __init__(self, model):
        self.model, self.windows = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def backbone(self, inputs, mask=None, cache=None):
        self.windows.append((inputs.shape[1], cache[0].offset if cache else 0))
        return self.model.backbone(inputs, mask, cache)


def decode(model, tok, prompt, use_cache, **options):
    """Engine events, each forward's window and the decode's cache state."""
    adapter = adapter_for(model, tok)
    adapter.use_cache = use_cache
    adapter.eos_ids = frozenset()
    adapter.model = spy = Spy(model)
    states = []
    start = adapter.start
    adapter.start = lambda p, **kw: states.append(start(p, **kw)) or states[-1]
    resolved = resolve(DecodeOptions(**options), adapter, len(prompt[0]))
    events = list(Engine(adapter, resolved).run(mx.array(prompt)))
    return events, spy.windows, states[0]


CASES = [
    ("sdar", [[5, 6, 7, 8, 9, 10, 11]], dict(max_tokens=29)),
    ("sdar", [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26]], dict(max_tokens=21, steps=2)),
    ("sdar", [[5, 6, 7, 8, 9]], dict(max_tokens=27, block_length=6, strategy="entropy_bounded")),
    ("sdar", [[5, 6, 7, 8, 9]], dict(max_tokens=20, block_length=8, strategy="low_confidence_static")),
    ("llada2", [list(range(40, 53))], dict(max_tokens=83)),
    ("llada2", [list(range(40, 53)), list(range(60, 73))], dict(max_tokens=51, steps=8, threshold=0.5)),
    ("llada2", [list(range(40, 53))], dict(max_tokens=51, preset="speed")),
    ("llada2", [list(range(40, 80))], dict(max_tokens=70, block_length=16, threshold=0.7)),
]


@pytest.mark.parametrize("family,prompt,options", CASES)
def test_cache_gives_the_same_tokens_and_forwards(families, family, prompt, options):
    model, tok = families[family]
    cached, windows, state = decode(model, tok, prompt, True, **options)
    plain, plain_windows, _ = decode(model, tok, prompt, False, **options)
    assert (cached[-1].canvas == plain[-1].canvas).all()
    assert cached[-1].forwards == plain[-1].forwards
    # the engine queues the next forward before it reads a step back; the one queued
    # after the step that ends the decode is dropped, uncounted
    assert len(windows) == len(plain_windows) and len(windows) - cached[-1].forwards in (0, 1)
    assert [s.final.tolist() for s in cached] == [s.final.tolist() for s in plain]
    block, total = model.block_size, cached[-1].canvas.shape[1]
    forwards = [e for e in cached if e.forward]
    # without the cache every forward starts at position 0; with it, at the cached prefix
    assert all(offset == 0 for _, offset in plain_windows)
    for event, (width, offset) in zip(forwards, windows):
        start, end = event.block
        assert offset + width == min(-(-end // block) * block, total)  # to end's attention block
        if event.step > 0:  # only the current block (from its attention-block boundary)
            assert offset == start // block * block
        else:  # the first step also stores the block finished before it
            assert offset <= start // block * block
    # the cache holds exactly the final prefix's whole attention blocks
    assert max(offset for _, offset in windows) <= state.stored <= state.final // block * block
    assert state.stored % block == 0
    assert state.layers[0].keys.shape[2] <= -(-(total + block) // 256) * 256


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_cache_grows_with_the_prefix_not_the_steps(families, family):
    model, tok = families[family]
    block = model.block_size
    prompt = [list(range(30, 30 + block + 3))]
    gen = 3 * block - 3
    sizes = {}
    for steps in (1, block):
        events, _, state = decode(
            model, tok, prompt, True, max_tokens=gen, steps=steps, strategy="low_confidence_static"
        )
        sizes[steps] = (state.stored, state.layers[0].keys.shape, state.layers[0].nbytes)
        assert events[-1].forwards == (3 if steps == 1 else gen)
        assert state.stored == (len(prompt[0]) + gen) - block  # every block but the last
    assert sizes[1] == sizes[block]


def test_each_step_runs_only_the_current_block(families):
    """A block's first step stores the finished block before it on the way; every
    other step runs just the current block on top of the cache."""
    model, tok = families["sdar"]
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]  # two whole prompt blocks, then blocks of 4 from 8
    events, windows, _ = decode(model, tok, prompt, True, max_tokens=16, steps=4, strategy="low_confidence_static")
    assert [(e.block[0], e.step) for e in events] == [(b, s) for b in (8, 12, 16, 20) for s in range(4)]
    first = [(12, 0)] + [(4, 8)] * 3  # the prompt's blocks ride along with the first step
    later = [w for b in (8, 12, 16) for w in [(8, b)] + [(4, b + 4)] * 3]
    assert windows == first + later
