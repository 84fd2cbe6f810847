"""Prefix KV cache speedup for SDAR and LLaDA2 micro models, and tokens/s against
mlx-vlm's LLaDA2 generation on the same checkpoint (a benchmark, not a test).

cache speedup = decode time without the cache / decode time with it, same options,
side by side in one run, 256 generated tokens, tokens checked identical. EOS is
switched off so every run fills its whole canvas.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/bench_block_cache.py
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.decoding.engine import Engine  # noqa: E402
from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve  # noqa: E402
from mlx_lm_diffusion.testing.block_checkpoints import LLADA2_MASK, write_llada2, write_sdar  # noqa: E402
from model_adapters import adapter_for  # noqa: E402

GEN = 256
PROMPT = list(range(40, 72))  # 32 tokens: prompt + 256 fill whole blocks, so every loop decodes the same canvas
SIZE = dict(hidden=256, n_layers=4, n_heads=8, n_kv_heads=4)
REPEATS = 2  # alternated runs, best of each kept: the 2-core machine is noisy


def engine_decode(model, tok, use_cache, **options):
    adapter = adapter_for(model, tok)
    adapter.use_cache = use_cache
    adapter.eos_ids = frozenset()  # fill the canvas: the random micro models rarely stop
    resolved = resolve(DecodeOptions(max_tokens=GEN, **options), adapter, len(PROMPT))
    tic = time.perf_counter()
    last = None
    for last in Engine(adapter, resolved, keep_logprobs=False).run(mx.array([PROMPT])):
        pass
    seconds = time.perf_counter() - tic
    return seconds, last.canvas[0, len(PROMPT) :].tolist(), last.forwards


def side_by_side(first, second, repeats=REPEATS):
    """Alternate the two runs `repeats` times; the best time of each and their first output."""
    a, b = [], []
    for _ in range(repeats):
        a.append(first())
        b.append(second())
    return (min(r[0] for r in a), a[0][1:]), (min(r[0] for r in b), b[0][1:])


def vlm_model(path: Path):
    from mlx_vlm.models.llada2_moe import Model, ModelConfig

    model = Model(ModelConfig.from_dict(json.loads((path / "config.json").read_text())))
    model.load_weights(list(model.sanitize(dict(mx.load(str(path / "model.safetensors")))).items()))
    mx.eval(model.parameters())
    return model


def vlm_decode(model):
    tic = time.perf_counter()
    out = model.language_model.generate(
        mx.array([PROMPT]), block_length=32, steps=32, gen_length=GEN, threshold=0.95, eos_id=-1, mask_id=LLADA2_MASK
    )
    mx.eval(out)
    return time.perf_counter() - tic, out[0].tolist()


def main():
    cache_rows, vlm_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        sdar_path = write_sdar(Path(tmp) / "sdar", head_dim=32, inter=512, **SIZE)
        llada2_path = write_llada2(Path(tmp) / "llada2", inter=512, moe_inter=128, **SIZE)
        cases = [
            ("SDAR", sdar_path, dict()),
            ("SDAR", sdar_path, dict(strategy="entropy_bounded")),
            ("LLaDA2", llada2_path, dict()),
            ("LLaDA2", llada2_path, dict(preset="speed")),
        ]
        for name, path, options in cases:
            model, tok = mld.load(str(path))
            engine_decode(model, tok, True, **options)  # warm up
            (cached, (tokens, forwards)), (plain, (plain_tokens, plain_forwards)) = side_by_side(
                lambda: engine_decode(model, tok, True, **options),
                lambda: engine_decode(model, tok, False, **options),
            )
            same = tokens == plain_tokens and forwards == plain_forwards
            cache_rows.append((name, options, forwards, plain, cached, same))
            print(name, options, f"{plain / cached:.2f}x", same, flush=True)

        model, tok = mld.load(str(llada2_path))
        vlm = vlm_model(llada2_path)
        vlm_decode(vlm)  # warm up
        engine_decode(model, tok, True, steps=32)
        (ours, (tokens, forwards)), (theirs, (vlm_tokens,)) = side_by_side(
            lambda: engine_decode(model, tok, True, steps=32), lambda: vlm_decode(vlm), repeats=2 * REPEATS
        )
        vlm_rows.append((forwards, ours, theirs, tokens == vlm_tokens))

    print(f"cache speedup, {GEN} generated tokens, prompt {len(PROMPT)} tokens, micro models {SIZE}")
    print(f"{'model':7} {'options':32} {'forwards':>8} {'no cache s':>10} {'cache s':>8} {'speedup':>8} {'same':>5}")
    for name, options, forwards, plain, cached, same in cache_rows:
        print(
            f"{name:7} {str(options):32} {forwards:8d} {plain:10.3f} {cached:8.3f} {plain / cached:8.2f} {str(same):>5}"
        )
    print()
    print("LLaDA2 against mlx-vlm's generate (block 32, 32 steps, threshold 0.95, same checkpoint)")
    print(f"{'forwards':>8} {'ours tok/s':>10} {'mlx-vlm tok/s':>13} {'ratio':>6} {'same tokens':>11}")
    for forwards, ours, theirs, same in vlm_rows:
        print(f"{forwards:8d} {GEN / ours:10.1f} {GEN / theirs:13.1f} {theirs / ours:6.2f} {str(same):>11}")


if __name__ == "__main__":
    main()
