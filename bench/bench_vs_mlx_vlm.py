"""Tokens/s of the engine against mlx-vlm's own loops, same checkpoints, same run (a benchmark,
not a test): Nemotron-Labs Diffusion (mlx-vlm's `generate`, diffusion mode) and DiffusionGemma
(mlx-vlm's entropy-bound sampler, same seed). Both sides decode the same number of tokens
with EOS off; "same" says whether the tokens agree (DiffusionGemma: the first canvas; a
canvas that runs all its steps ends without mlx-vlm drawing the reference's last sample and
noise, so later canvases start from different random streams). Best of 3
alternating runs after a warm-up; the ratio is mlx-vlm's time over ours.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python bench/bench_vs_mlx_vlm.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mlx_lm_diffusion as mld  # noqa: E402
from checkpoints_nemotron_gemma import write_diffusion_gemma, write_nemotron  # noqa: E402
from mlx_lm_diffusion.engine import Engine  # noqa: E402
from mlx_lm_diffusion.options import DecodeOptions, resolve  # noqa: E402
from model_adapters import adapter_for  # noqa: E402

PROMPT = list(range(40, 72))
NEMOTRON_GEN, GEMMA_GEN, GEMMA_CANVAS = 128, 128, 64


def engine(model, tok, **options):
    """The engine without EOS (both sides decode every token); returns (tokens, forwards)."""
    adapter = adapter_for(model, tok)
    adapter.eos_ids = frozenset()
    resolved = resolve(DecodeOptions(**options), adapter, len(PROMPT))
    last = None
    for last in Engine(adapter, resolved, keep_logprobs=False).run(mx.array([PROMPT])):
        pass
    n = options["max_tokens"]
    return last.canvas[0, len(PROMPT):len(PROMPT) + n].tolist(), last.forwards


def alternate(ours, theirs, runs=3):
    """Warm both up, then time them in turn `runs` times (the machine is noisy); returns the
    best seconds of each and their last results."""
    ours(), theirs()
    t_ours = t_theirs = float("inf")
    for _ in range(runs):
        tic = time.perf_counter()
        a = ours()
        t_ours = min(t_ours, time.perf_counter() - tic)
        tic = time.perf_counter()
        b = theirs()
        t_theirs = min(t_theirs, time.perf_counter() - tic)
    return t_ours, t_theirs, a, b


def nemotron_rows(tmp: Path):
    from mlx_vlm.models import nemotron_labs_diffusion as ref

    path = write_nemotron(tmp / "nemotron", hidden=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, inter=512)
    model, tok = mld.load(str(path))
    vlm = ref.Model(ref.ModelConfig.from_dict(json.loads((path / "config.json").read_text())))
    vlm.load_weights(list(vlm.sanitize(mx.load(str(path / "model.safetensors"))).items()))
    lm = vlm.language_model
    rows = []
    for threshold in (0.9, None):
        rule = {"threshold": threshold} if threshold is not None else {"strategy": "low_confidence"}
        ours = lambda: engine(model, tok, max_tokens=NEMOTRON_GEN, block_length=32, **rule)  # noqa: E731
        for parity in (True, False):
            def theirs(parity=parity):
                stats = {}
                out = lm.generate(mx.array([PROMPT]), block_length=32, steps=32, gen_length=NEMOTRON_GEN,
                                  threshold=threshold, eos_id=-1, stats=stats, transformers_parity=parity)
                return out[0].tolist(), int(stats["diffusion_denoise_nfe"])
            t_ours, t_theirs, (a, fa), (b, fb) = alternate(ours, theirs)
            name = f"Nemotron {'threshold 0.9' if threshold else 'quota'}, vlm parity={parity}"
            rows.append((name, a == b, NEMOTRON_GEN, fa, fb, t_ours, t_theirs))
    return rows


def gemma_rows(tmp: Path):
    from mlx_vlm.generate.diffusion import stream_diffusion_generate
    from mlx_vlm.models import diffusion_gemma as ref

    path = write_diffusion_gemma(
        tmp / "gemma", canvas_length=GEMMA_CANVAS, sliding_window=64, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32, global_head_dim=64,
        num_global_key_value_heads=2, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        num_experts=8, top_k_experts=2, moe_intermediate_size=128,
    )
    model, tok = mld.load(str(path))
    cfg = json.loads((path / "config.json").read_text())
    cfg["vision_config"] = None
    layer = cfg["text_config"]["per_layer_config"]["3"]
    cfg["text_config"].update(global_head_dim=layer["head_dim"], num_global_key_value_heads=layer["num_key_value_heads"])
    vlm = ref.Model(ref.ModelConfig.from_dict(cfg))
    vlm.load_weights(list(vlm.sanitize(mx.load(str(path / "model.safetensors"))).items()))
    vlm.config.generation_config = {"stability_threshold": 1, "confidence_threshold": 0.005}

    class NoText:
        class detokenizer:
            last_segment = ""
            reset = finalize = staticmethod(lambda: None)
            add_token = staticmethod(lambda token, skip_special_token_ids=None: None)
        stopping_criteria = staticmethod(lambda token: False)

    def theirs():
        mx.random.seed(0)
        tokens, last = [], None
        for last in stream_diffusion_generate(
            vlm, NoText, NoText, mx.array([PROMPT]), None, None, max_tokens=GEMMA_GEN, temperature=1.0,
            skip_special_token_ids=[], max_denoising_steps=48, diffusion_full_canvas=True,
            diffusion_sampler="entropy-bound",
        ):
            if not (last.is_draft or last.diffusion_block_complete or last.finish_reason):
                tokens.append(last.token)
        return tokens, last.diffusion_denoising_steps

    ours = lambda: engine(model, tok, max_tokens=GEMMA_GEN, seed=0)  # noqa: E731
    t_ours, t_theirs, (a, fa), (b, fb) = alternate(ours, theirs)
    # after a canvas that runs all its steps, mlx-vlm skips the reference's last draws and
    # the random streams part: "same" compares the first canvas, which both start alike
    same = a[:GEMMA_CANVAS] == b[:GEMMA_CANVAS]
    name = f"DiffusionGemma entropy-bound ({GEMMA_GEN // GEMMA_CANVAS} canvases)"
    return [(name, same, GEMMA_GEN, fa, fb, t_ours, t_theirs)]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        rows = nemotron_rows(Path(tmp)) + gemma_rows(Path(tmp))
    print(f"{'case':42} {'same':>5} {'tokens':>6} {'fwd':>5} {'vlm fwd':>7} {'tok/s':>8} {'vlm tok/s':>9} {'ratio':>6}")
    for name, same, tokens, fa, fb, t_ours, t_theirs in rows:
        print(f"{name:42} {str(same):>5} {tokens:6d} {fa:5d} {fb:7d} {tokens / t_ours:8.1f} "
              f"{tokens / t_theirs:9.1f} {t_theirs / t_ours:6.2f}")


if __name__ == "__main__":
    main()
