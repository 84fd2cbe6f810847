"""What each pass over the vocabulary costs a step, against the bare forward (a profile,
not a test): bench_engine's micro models at one vocabulary, bench_engine's four cases.

Per case: the decode's wall time with and without kept log-probs (Engine keep_logprobs),
over its forwards replayed bare; and per pass, the time of one pass over K rows x V
(K = the rows a step reads) next to the head over K rows and a whole bare forward.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/profile_vocab_passes.py [--vocab 32768] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine  # noqa: E402

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.decoding.decoders.vocab_stats import LOG2E, _cpu_exp_terms  # noqa: E402
from mlx_lm_diffusion.testing.checkpoints import write_dream, write_llada  # noqa: E402

try:
    from mlx_lm_diffusion.decoding.decoders.vocab_stats import logprob_rows  # noqa: E402
except ImportError:  # (profiling a tree from before the kept log-probs were recorded per commit)

    def logprob_rows(shifted, log_total, slots):
        index = slots[..., None]
        return mx.take_along_axis(shifted, index, axis=1) - mx.take_along_axis(log_total, index, axis=1)


from mlx_lm_diffusion.api.decode import build_decode  # noqa: E402
from mlx_lm_diffusion.decoding.engine import Engine  # noqa: E402
from model_adapters import adapter_for  # noqa: E402


def best(fn, repeats=20) -> float:
    """Best time of `fn` (which evaluates what it builds), in ms."""
    fn()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return 1e3 * min(times)


def engine_decode(model, tok, keep: bool, options: dict) -> float:
    """Seconds of one Engine decode (its steps only: no detokenizer, no responses)."""
    decode = build_decode(model, tok, bench_engine.PROMPT, bench_engine.GEN, **options)
    adapter, resolved = decode.adapter, decode.options
    engine = Engine(adapter, resolved, keep_logprobs=keep)
    tic = time.perf_counter()
    for _ in engine.run(mx.array([bench_engine.PROMPT])):
        pass
    return time.perf_counter() - tic


def passes(adapter, vocab: int, rows: int, width: int) -> dict:
    """ms of the bare forward whose head covers `rows` rows, of that head alone, and of
    each pass a greedy step makes over (1, rows, V)."""
    P = len(bench_engine.PROMPT)
    canvas = mx.array([bench_engine.PROMPT + [adapter.mask_id] * bench_engine.GEN])
    index = mx.arange(rows, dtype=mx.int32)[None]
    logits = adapter.predict_rows(None, canvas, P, P + width, index)
    hidden = adapter.block_hidden(None, canvas, P, P + width)
    mx.eval(logits, hidden)
    x0 = mx.argmax(logits, axis=-1)
    top = mx.take_along_axis(logits, x0[..., None], axis=-1)
    shifted = logits - top
    scaled = shifted * LOG2E
    e = mx.power(mx.array(2.0), scaled)
    total = mx.sum(e, axis=-1, keepdims=True)
    log_total = mx.log(total)
    mx.eval(x0, top, shifted, scaled, e, total, log_total)
    kept = mx.zeros((1, width, vocab))
    commit = mx.arange(rows)[None] == 0
    one = mx.zeros((1, 1), mx.int32)
    mx.eval(kept, commit)
    out = {
        "bare forward (head over the rows)": best(
            lambda: mx.eval(adapter.predict_rows(None, canvas, P, P + width, index))
        ),
        "head alone": best(lambda: mx.eval(adapter.model.head(hidden[:, :rows])))
        if hidden is not None
        else float("nan"),
        "argmax": best(lambda: mx.eval(mx.argmax(logits, axis=-1))),
        "max (unused: argmax's logit is taken)": best(lambda: mx.eval(mx.max(logits, axis=-1))),
        "subtract the max": best(lambda: mx.eval(logits - top)),
        "multiply by log2 e": best(lambda: mx.eval(shifted * LOG2E)),
        "power(2, .) (the exp before cpu_exp)": best(lambda: mx.eval(mx.power(mx.array(2.0), scaled))),
        "cpu_exp and the entropy terms, fused (the exp now)": best(lambda: mx.eval(*_cpu_exp_terms(shifted))),
        "mx.exp (not used at this vocabulary)": best(lambda: mx.eval(mx.exp(shifted))),
        "sum": best(lambda: mx.eval(mx.sum(e, axis=-1, keepdims=True))),
        "entropy terms (only where a rule reads it)": best(
            lambda: mx.eval(mx.sum(mx.where(e > 0, e * shifted, 0.0), axis=-1))
        ),
        "full log-probs (shifted - log S)": best(lambda: mx.eval(shifted - log_total)),
        "kept before: where over the rows": best(lambda: mx.eval(mx.where(commit[..., None], shifted, kept[:, :rows]))),
        "kept before: put_along_axis into width x V": best(
            lambda: mx.eval(mx.put_along_axis(kept, index[..., None], shifted, axis=1))
        ),
        "kept now: one committed row": best(lambda: mx.eval(logprob_rows(shifted, log_total, one))),
    }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    bench_engine.set_tokens(args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {
            "LLaDA": write_llada(Path(tmp) / "llada", d_model=256, mlp=512, vocab=args.vocab, **bench_engine.SIZE),
            "Dream": write_dream(Path(tmp) / "dream", hidden=256, inter=512, vocab=args.vocab, **bench_engine.SIZE),
        }
        loaded = {name: mld.load(str(path)) for name, path in paths.items()}
        print(f"vocab {args.vocab}, {args.tokens} tokens: decode / bare forwards (Engine, no responses)")
        for name, options, block in bench_engine.CASES.values():
            model, tok = loaded[name]
            adapter = adapter_for(model, tok)
            with bench_engine.Recorder(type(adapter)) as recorder:
                engine_decode(model, tok, True, options)
            bare = min(recorder.bare_seconds() for _ in range(3))
            walls = {keep: min(engine_decode(model, tok, keep, options) for _ in range(3)) for keep in (True, False)}
            print(
                f"  {name:6} {str(options):36} kept {walls[True] / bare:6.3f}  not kept {walls[False] / bare:6.3f}"
                f"  ({len(recorder.calls)} forwards, bare {1e3 * bare / len(recorder.calls):.2f} ms each)"
            )
        adapter = adapter_for(*loaded["LLaDA"])
        for rows in (1, 4, 32):
            print(f"LLaDA passes over {rows} rows x {args.vocab} (ms; block width 32):")
            for what, ms in passes(adapter, args.vocab, rows, 32).items():
                print(f"  {what:44} {ms:8.3f}")


if __name__ == "__main__":
    main()
