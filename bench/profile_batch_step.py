"""Where a batched step's time goes: B rows in one RunningBatch against the same B rows
each in a batch of its own (the work of B single-row steps), on bench_server's micro models.

    python bench/profile_batch_step.py [--rows 1 4 8] [--steps 24] [--attention]

For each model and B, both setups decode the same B prompts (bench_server's prompt
lengths and max_tokens, the server's options: keep_logprobs) and report, per step of the
batch (per round of B single-row steps), the median milliseconds of:
  forward  predict_batch, evaluated (the model forward and the stacked LM head)
  attn     (--attention) the attention calls alone, each evaluated on its own inputs
  commit   the fused commit, evaluated
  readback the rows' read-backs (_settle's mx.eval)
  host     everything else: the rows' Python, building their Steps
Each phase is forced to evaluate on its own (a profiling artefact: the real step
overlaps nothing on this CPU either, MLX runs one stream). Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PHASES = ("forward", "attn", "commit", "readback", "host", "total")


class Timer:
    def __init__(self):
        self.acc = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name):
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.acc[name] += time.perf_counter() - tic


def instrument(timer: Timer, adapter, attention: bool):
    """Wrap predict_batch, commit_rows, _settle's eval (and the attention) with timers."""
    from mlx_lm.models import llama, qwen3

    from mlx_lm_diffusion import batch as batch_module

    predict_batch = adapter.predict_batch

    def timed_predict(requests):
        with timer.phase("forward"):
            out = predict_batch(requests)
            mx.eval(getattr(out, "source", None) if getattr(out, "source", None) is not None else list(out))
        return out

    adapter.predict_batch = timed_predict
    commit_rows = batch_module.commit_rows

    def timed_commit(*a, **k):
        with timer.phase("commit"):
            out = commit_rows(*a, **k)
            mx.eval([a for c in out for a in (c.block, c.kept, c.confidence) if a is not None])
        return out

    batch_module.commit_rows = timed_commit
    real_eval = mx.eval

    def timed_settle(self, events):
        def eval_timed(*arrays):
            with timer.phase("readback"):
                real_eval(*arrays)

        batch_module.mx.eval = eval_timed
        try:
            return settle(self, events)
        finally:
            batch_module.mx.eval = real_eval

    settle = batch_module.RunningBatch._settle
    batch_module.RunningBatch._settle = timed_settle
    if attention:
        for module in (llama, qwen3):
            sdpa = module.scaled_dot_product_attention

            def timed_sdpa(q, k, v, *a, _sdpa=sdpa, **kw):
                mask = kw.get("mask")
                real_eval(q, k, v, *([mask] if isinstance(mask, mx.array) else []))
                with timer.phase("attn"):
                    out = _sdpa(q, k, v, *a, **kw)
                    real_eval(out)
                return out

            module.scaled_dot_product_attention = timed_sdpa


def prompts(tokenizer, n: int, max_tokens: int):
    from bench_server import requests

    out = []
    for r in requests(n, max_tokens, {}):
        ids = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)
        out.append((list(ids), r["max_tokens"]))
    return out


def one_round(batches, timer: Timer) -> dict:
    """Step every batch once; the phase times (s)."""
    timer.acc = dict.fromkeys(PHASES, 0.0)
    tic = time.perf_counter()
    for batch in batches:
        if len(batch):
            batch.step()
    timer.acc["total"] = time.perf_counter() - tic
    timer.acc["host"] = timer.acc["total"] - timer.acc["forward"] - timer.acc["commit"] - timer.acc["readback"]
    if timer.acc["attn"]:
        timer.acc["forward"] -= timer.acc["attn"]
    return dict(timer.acc)


def interleaved(setups: dict, timer: Timer, steps: int) -> dict:
    """One round of each setup in turn (so that both see the same load), `steps` rounds
    or until a row finishes; the first two rounds (prefill, kernel builds) are dropped."""
    rounds = {name: [] for name in setups}
    for _ in range(steps):
        for name, batches in setups.items():
            rounds[name].append(one_round(batches, timer))
        if any(len(b) < n for n, b in ((s[1], s[0]) for s in _sizes(setups))):
            break
    return {name: r[2:] for name, r in rounds.items()}


def _sizes(setups):
    return [(b, b.size0) for batches in setups.values() for b in batches]


def quantile(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def profile(name: str, path: str, fields: dict, rows: list, steps: int, attention: bool) -> None:
    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.batch import RunningBatch
    from mlx_lm_diffusion.options import DecodeOptions, resolve
    from model_adapters import adapter_for

    model, tokenizer = mld.load(path)
    adapter = adapter_for(model, tokenizer)
    timer = Timer()
    instrument(timer, adapter, attention)
    print(f"\n{name}: ms per batched step (batched) / per round of B single-row steps (single), 20th percentile and median")
    print(f"{'B':>3} {'setup':>8} {'':>4} " + " ".join(f"{p:>8}" for p in PHASES) + f" {'ratio':>6}")
    for B in rows:
        work = prompts(tokenizer, B, 32)
        setups = {"batched": [RunningBatch(adapter, keep_logprobs=True)], "single": []}
        for prompt, n in work:
            setups["single"].append(RunningBatch(adapter, keep_logprobs=True))
            for batch in (setups["batched"][0], setups["single"][-1]):
                batch.add(prompt, resolve(DecodeOptions(max_tokens=n, **fields), adapter, len(prompt)))
        for batches in setups.values():
            for b in batches:
                b.size0 = len(b)
        rounds = interleaved(setups, timer, steps)
        for q in (0.2, 0.5):
            medians = {name: {p: 1e3 * quantile([r[p] for r in rs], q) for p in PHASES} for name, rs in rounds.items()}
            for setup in ("batched", "single"):
                m = medians[setup]
                ratio = medians["single"]["total"] / medians["batched"]["total"] if setup == "batched" else 1.0
                print(f"{B:>3} {setup:>8} q{q:.1f} " + " ".join(f"{m[p]:>8.2f}" for p in PHASES) + f" {ratio:>6.2f}x")
        print(f"    ({len(rounds['batched'])} rounds)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--attention", action="store_true", help="time the attention calls on their own")
    parser.add_argument("--models", nargs="+", default=["sdar", "llada"])
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_server import checkpoints

    with tempfile.TemporaryDirectory() as folder:
        models = checkpoints(Path(folder))
        for name, (path, fields) in models.items():
            if name.split()[0].lower() in args.models:
                profile(name, path, fields, args.rows, args.steps, args.attention)


if __name__ == "__main__":
    main()
