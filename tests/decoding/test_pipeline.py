"""The engine's pipelining: it queues the next forward before reading a step back, and
the steps it yields are exactly those of the read-every-step loop (pipeline=False), for
every family with a mask token and every kind of commit rule."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.decoding.decoders import decoder_class
from mlx_lm_diffusion.decoding.engine import Engine
from mlx_lm_diffusion.decoding.options import DecodeOptions, check_forward_budget, forward_bound, resolve
from mlx_lm_diffusion.decoding.schedules import ScheduleQuota
from mlx_lm_diffusion.testing.block_checkpoints import write_llada2, write_sdar
from mlx_lm_diffusion.testing.causal_checkpoints import write_causal
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_nemotron
from model_adapters import adapter_for


@pytest.fixture(scope="module")
def models(tmp_path_factory, llada, dream):
    root = tmp_path_factory.mktemp("pipeline")
    return {
        "llada": llada,
        "dream": dream,
        "sdar": mld.load(str(write_sdar(root / "sdar"))),
        "llada2": mld.load(str(write_llada2(root / "llada2"))),
        "nemotron": mld.load(str(write_nemotron(root / "nemotron"))),
        "ar": mld.load(str(write_causal(root / "ar", "qwen3")), autoregressive=True),
    }


def run(model, tok, prompt, pipeline, **options):
    adapter = adapter_for(model, tok)
    resolved = resolve(DecodeOptions(**options), adapter, len(prompt))
    return Engine(adapter, resolved, pipeline=pipeline).run(mx.array([prompt]))


def trace(steps):
    return [
        (
            s.canvas.tolist(),
            s.final.tolist(),
            s.done.tolist(),
            s.forwards,
            s.block,
            s.step,
            s.forward,
            np.array(s.block_logprobs).tobytes(),
            np.array(s.block_confidence).tobytes(),
        )
        for s in steps
    ]


CASES = [
    ("llada", dict(max_tokens=24, block_length=8)),  # quota, one per step
    ("llada", dict(max_tokens=24, block_length=8, steps=3)),  # quota, several per step
    ("llada", dict(max_tokens=20, block_length=8, steps=12)),  # more steps than masks
    ("llada", dict(max_tokens=16, block_length=8, steps=4, strategy="random", seed=3)),
    ("llada", dict(max_tokens=16, block_length=8, threshold=0.05)),  # data-dependent count
    ("llada", dict(max_tokens=16, block_length=8, strategy="factor", factor=4.0)),
    ("llada", dict(max_tokens=12, block_length=1)),
    ("llada", dict(max_tokens=16, block_length=8, steps=4, sampler=make_sampler(temp=1.0), seed=5)),
    ("llada", dict(max_tokens=16, block_length=8, steps=8, temperature_schedule=[0.7] * 8, top_p=0.9, seed=2)),
    ("llada", dict(max_tokens=16, block_length=8, steps=4, editing_threshold=0.1)),  # read every step
    ("dream", dict(max_tokens=16, steps=8)),
    ("dream", dict(max_tokens=16, steps=6, strategy="entropy")),
    ("dream", dict(max_tokens=16, steps=6, strategy="topk_margin", alg_temp=0.5, seed=1)),
    ("dream", dict(max_tokens=16, steps=6, strategy="origin", seed=4)),
    ("sdar", dict(max_tokens=20)),
    ("sdar", dict(max_tokens=20, strategy="low_confidence_static", steps=2)),
    ("sdar", dict(max_tokens=20, strategy="entropy_bounded")),
    ("llada2", dict(max_tokens=40)),
    ("llada2", dict(max_tokens=40, steps=4, threshold=0.0)),  # every token passes
    ("nemotron", dict(max_tokens=16)),
    ("nemotron", dict(max_tokens=16, block_length=4, causal_context=True)),
    ("ar", dict(max_tokens=16, block_length=1)),
    ("ar", dict(max_tokens=16, block_length=4)),  # the adapter reads the canvas mid-block
    ("ar", dict(max_tokens=12, block_length=12, steps=12, strategy=ScheduleQuota("linear"))),  # one per step
]


@pytest.mark.parametrize("family,options", CASES)
def test_pipelined_steps_equal_read_every_step(models, family, options):
    model, tok = models[family]
    prompt = [5, 9, 30, 31, 7, 64, 25]
    rule = options.get("strategy")
    serial = trace(run(model, tok, prompt, False, **options))
    if isinstance(rule, ScheduleQuota):  # a rule instance keeps block state: use a fresh one
        options = dict(options, strategy=ScheduleQuota(rule.schedule))
    assert trace(run(model, tok, prompt, True, **options)) == serial


def test_next_forward_is_queued_before_the_step_is_read_back(models):
    """At block length 1 every step's count is known, so forward t + 1 is built before the
    consumer sees step t; without pipelining the consumer has seen every earlier step."""
    model, tok = models["ar"]
    for pipeline, lag in ((True, 1), (False, 0)):
        seen, at_forward = [], []
        real = model.__call__

        class Spy:
            def __getattr__(self, name):
                return getattr(model, name)

            def __call__(self, *args, **kwargs):
                at_forward.append(len(seen))
                return real(*args, **kwargs)

        adapter = adapter_for(model, tok)
        adapter.model = Spy()
        try:
            resolved = resolve(DecodeOptions(max_tokens=8, block_length=1), adapter, 3)
            for step in Engine(adapter, resolved, pipeline=pipeline).run(mx.array([[5, 9, 30]])):
                seen.append(step)
        finally:
            adapter.model = model
        assert len(at_forward) >= 8 and at_forward == [max(0, k - lag) for k in range(len(at_forward))]


@pytest.mark.parametrize("family,options", CASES)
def test_forward_bound_holds_for_every_decode(models, family, options):
    """`forward_bound` (what a server checks against --max-forwards before anything runs)
    is never exceeded, and is exact for LLaDA's and Dream's fixed quotas of no more steps
    than a block has positions, run to the end of the canvas (with more steps, or a
    threshold inside the schedule as LLaDA2's, a block can fill early)."""
    model, tok = models[family]
    prompt = [5, 9, 30, 31, 7, 64, 25]
    if isinstance(options.get("strategy"), ScheduleQuota):
        options = dict(options, strategy=ScheduleQuota(options["strategy"].schedule))
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()  # run every block
    resolved = resolve(DecodeOptions(**options), adapter, len(prompt))
    bound = forward_bound(resolved, adapter, len(prompt))
    last = None
    for last in Engine(adapter, resolved).run(mx.array([prompt])):
        pass
    assert last.forwards <= bound
    widths = [end - start for start, end in decoder_class(adapter)(adapter, resolved).blocks(len(prompt))]
    quota = family in ("llada", "dream") and "threshold" not in options and resolved.rule.fixed_steps
    if quota and resolved.editing_threshold is None and resolved.steps <= min(widths):
        assert last.forwards == bound


def test_forward_budget_refuses_with_the_bound(models):
    model, tok = models["llada"]
    adapter = adapter_for(model, tok)
    resolved = resolve(DecodeOptions(max_tokens=16, block_length=8, steps=100_000, schedule="linear"), adapter, 3)
    assert forward_bound(resolved, adapter, 3) == 200_000
    assert check_forward_budget(resolved, adapter, 3, None) == 200_000
    with pytest.raises(ValueError, match="up to 200000 model forwards.*allows 4096"):
        check_forward_budget(resolved, adapter, 3, 4096)
