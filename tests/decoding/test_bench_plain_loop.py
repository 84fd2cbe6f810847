"""bench_engine's plain loop (the least a correct loop does, its `vs plain loop` column)
decodes what the engine decodes: the same tokens and the same number of forwards."""

import sys
from pathlib import Path

import pytest

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.testing.checkpoints import write_dream, write_llada

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_engine  # noqa: E402

CASES = [
    ("LLaDA", dict(block_length=8)),  # one commit per step
    ("LLaDA", dict(block_length=8, steps=3)),  # several per step, uneven quotas
    ("LLaDA", dict(block_length=8, threshold=0.3)),
    ("Dream", dict()),  # the whole canvas, the entropy rule
    ("Dream", dict(block_length=8, steps=3)),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    return {"LLaDA": mld.load(str(write_llada(tmp / "llada"))), "Dream": mld.load(str(write_dream(tmp / "dream")))}


@pytest.mark.parametrize("name, options", CASES)
def test_plain_loop_decodes_what_the_engine_decodes(models, name, options, monkeypatch):
    monkeypatch.setattr(bench_engine, "GEN", 20)
    _, tokens, forwards = bench_engine.decode(*models[name], **options)
    loop_tokens, loop_forwards = bench_engine.plain_loop(*models[name], options)
    assert loop_tokens[: len(tokens)] == tokens
    assert loop_forwards == forwards
    bench_engine.plain_seconds(*models[name], options, tokens, forwards)  # (its own check passes)
    with pytest.raises(AssertionError):  # ... and fails on other tokens
        bench_engine.plain_seconds(*models[name], options, [t + 1 for t in tokens], forwards)
