"""Where a batched step's time goes: B rows in one RunningBatch against the same B rows
each in a batch of its own (the work of B single-row steps), on bench_server's micro models.

    python bench/profile_batch_step.py [--rows 1 4 8] [--steps 24] [--attention] [--ops-detail]

For each model and B, both setups decode the same B prompts (bench_server's prompt
lengths and max_tokens, the server's options: keep_logprobs) and report, per step of the
batch (per round of B single-row steps), the median milliseconds of:
  forward  predict_batch, evaluated (the model forward and the stacked LM head)
  attn     (--attention) the attention calls alone, each evaluated on its own inputs
           (the batched forwards then run uncompiled: model_adapters.runtime.batched.COMPILE_WINDOWS)
  commit   the fused commit, evaluated
  readback the rows' read-backs (_settle's mx.eval)
  host     everything else: the rows' Python, building their Steps
Each phase is forced to evaluate on its own (a profiling artefact: the real step
overlaps nothing on this CPU either, MLX runs one stream).

Then the MLX operations per step and phase (median over the same rounds, counted in a
second, unpipelined pass over fresh batches, so that the counting costs the timings
nothing): every graph node that `mx.eval` / `mx.async_eval` is handed unevaluated
(read with `mx.export_to_dot`); `host` here = the ops the rows' own code builds (their
writes, kept log-probs, read-backs). "per row": (ops of the B-row step - ops of the
2-row step) / (B - 2), what each further row adds (a 1-row batch runs the plain predict,
not the batched forward; without B=2, against B=1). `--ops-detail`: the operations, by
name, of the largest B's batched step against the 1-row one. Not a test.
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import mlx.core as mx

PHASES = ("forward", "attn", "commit", "readback", "host", "total")


class Timer:
    def __init__(self):
        self.acc = dict.fromkeys(PHASES, 0.0)
        self.current = "host"  # the phase running now (OpCounter files its ops under it)

    @contextmanager
    def phase(self, name):
        tic, outer = time.perf_counter(), self.current
        self.current = name
        try:
            yield
        finally:
            self.current = outer
            self.acc[name] += time.perf_counter() - tic


_NODE = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


class OpCounter:
    """The MLX operations every evaluation runs, per phase of `timer` and by name: wraps
    mx.eval and mx.async_eval (the graph a call is handed, less what is evaluated
    already: evaluated arrays are detached from their graph), while `on`."""

    def __init__(self, timer: Timer):
        self.timer = timer
        self.on = False
        self.by_phase: collections.Counter = collections.Counter()
        self.by_name: collections.Counter = collections.Counter()
        self.real_eval, self.real_async = mx.eval, mx.async_eval
        mx.eval, mx.async_eval = self._wrap(self.real_eval), self._wrap(self.real_async)

    def _wrap(self, evaluate):
        def counted(*arrays):
            if self.on:
                dot = io.StringIO()
                mx.export_to_dot(dot, *arrays)
                names = _NODE.findall(dot.getvalue())
                self.by_phase[self.timer.current] += len(names)
                self.by_name.update(f"{self.timer.current}: {n}" for n in names)
            return evaluate(*arrays)

        return counted

    def reset(self) -> None:
        self.by_phase, self.by_name = collections.Counter(), collections.Counter()


def instrument(timer: Timer, adapter, attention: bool):
    """Wrap predict_batch, commit_rows, _settle's eval (and the attention) with timers."""
    from mlx_lm.models import llama, qwen3

    from mlx_lm_diffusion.decoding import batch as batch_module

    predict_batch = adapter.predict_batch

    def timed_predict(requests):
        with timer.phase("forward"):
            out = predict_batch(requests)
            mx.eval(getattr(out, "source", None) if getattr(out, "source", None) is not None else list(out))
        return out

    adapter.predict_batch = timed_predict
    if getattr(batch_module, "_profiled", False):  # (the module-level wrappers: once per process)
        return
    batch_module._profiled = True
    commit_rows = batch_module.commit_rows

    def timed_commit(*a, **k):
        with timer.phase("commit"):
            out = commit_rows(*a, **k)
            mx.eval([a for c in out for a in (c.block, c.commit, c.confidence) if a is not None])
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
        from model_adapters.runtime import batched

        batched.COMPILE_WINDOWS = False  # (the timed attention evaluates inside the forward: nothing to trace)
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


def build_setups(adapter, tokenizer, fields: dict, B: int, pipeline: bool = True) -> dict:
    """B rows in one batch, and the same rows each in a batch of its own."""
    from mlx_lm_diffusion.decoding.batch import RunningBatch
    from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve

    setups = {"batched": [RunningBatch(adapter, keep_logprobs=True, pipeline=pipeline)], "single": []}
    for prompt, n in prompts(tokenizer, B, 32):
        setups["single"].append(RunningBatch(adapter, keep_logprobs=True, pipeline=pipeline))
        for batch in (setups["batched"][0], setups["single"][-1]):
            batch.add(prompt, resolve(DecodeOptions(max_tokens=n, **fields), adapter, len(prompt)))
    for batches in setups.values():
        for b in batches:
            b.size0 = len(b)
    return setups


OP_PHASES = ("forward", "commit", "readback", "host", "total")


def count_ops(setups: dict, counter: OpCounter, steps: int) -> tuple[dict, dict]:
    """Per setup, the median ops per phase of a round (rounds as `interleaved` keeps
    them), and the ops by name summed over those rounds."""
    counts = {name: [] for name in setups}
    names = {name: [] for name in setups}
    for _ in range(steps):
        for name, batches in setups.items():
            counter.reset()
            counter.on = True
            try:
                for batch in batches:
                    if len(batch):
                        batch.step()
            finally:
                counter.on = False
            phases = {p: counter.by_phase.get(p, 0) for p in OP_PHASES[:-1]}
            phases["total"] = sum(phases.values())
            counts[name].append(phases)
            names[name].append(counter.by_name)
        if any(len(b) < n for n, b in ((s[1], s[0]) for s in _sizes(setups))):
            break
    medians = {name: {p: statistics.median(r[p] for r in rs[2:]) for p in OP_PHASES} for name, rs in counts.items()}
    summed = {}
    for name, rs in names.items():
        total = collections.Counter()
        for r in rs[2:]:
            total.update(r)
        summed[name] = {k: v / max(1, len(rs) - 2) for k, v in total.items()}
    return medians, summed


def print_ops(B: int, medians: dict, base: Optional[tuple]) -> None:
    """`base`: (B0, its medians): "per row" is what each row past B0 adds."""
    for setup in ("batched", "single"):
        m = medians[setup]
        extra = ""
        if setup == "batched" and base is not None and B > base[0]:
            extra = f"   per row {(m['total'] - base[1]['total']) / (B - base[0]):>6.1f} (from B={base[0]})"
        print(f"{B:>3} {setup:>8} ops  " + " ".join(f"{m[p]:>8.0f}" for p in OP_PHASES) + extra)


def print_op_detail(B: int, names_B: dict, names_1: dict) -> None:
    print(f"    ops by phase and name per step, batched B={B} against B=1 (mean over the counted rounds):")
    keys = sorted(set(names_B) | set(names_1), key=lambda k: -(names_B.get(k, 0) - names_1.get(k, 0)))
    for k in keys:
        a, b = names_B.get(k, 0), names_1.get(k, 0)
        if a or b:
            print(f"      {k:<34}{a:>8.1f}{b:>8.1f}{(a - b) / max(1, B - 1):>8.1f} per row")


def profile(
    name: str,
    path: str,
    fields: dict,
    rows: list,
    steps: int,
    attention: bool,
    counter: "OpCounter",
    ops_detail: bool = False,
    ops_only: bool = False,
) -> None:
    import mlx_lm_diffusion as mld
    from model_adapters import adapter_for

    model, tokenizer = mld.load(path)
    adapter = adapter_for(model, tokenizer)
    timer = counter.timer
    instrument(timer, adapter, attention)
    print(
        f"\n{name}: ms per batched step (batched) / per round of B single-row steps (single), 20th percentile and median"
    )
    print(f"{'B':>3} {'setup':>8} {'':>4} " + " ".join(f"{p:>8}" for p in PHASES) + f" {'ratio':>6}")
    ops = {}
    for B in rows:
        if ops_only:
            ops[B] = count_ops(build_setups(adapter, tokenizer, fields, B, pipeline=False), counter, steps)
            continue
        rounds = interleaved(build_setups(adapter, tokenizer, fields, B), timer, steps)
        for q in (0.2, 0.5):
            medians = {name: {p: 1e3 * quantile([r[p] for r in rs], q) for p in PHASES} for name, rs in rounds.items()}
            for setup in ("batched", "single"):
                m = medians[setup]
                ratio = medians["single"]["total"] / medians["batched"]["total"] if setup == "batched" else 1.0
                print(f"{B:>3} {setup:>8} q{q:.1f} " + " ".join(f"{m[p]:>8.2f}" for p in PHASES) + f" {ratio:>6.2f}x")
        print(f"    ({len(rounds['batched'])} rounds)")
        ops[B] = count_ops(build_setups(adapter, tokenizer, fields, B, pipeline=False), counter, steps)
    print(f"\n{name}: MLX ops per batched step (batched) / per round of B single-row steps (single), median")
    print(f"{'B':>3} {'setup':>8} {'':>4} " + " ".join(f"{p:>8}" for p in OP_PHASES))
    # (a 1-row batch runs the plain predict, not the batched forward: rows past 2 are compared to 2)
    base = next(((b, ops[b][0]["batched"]) for b in (2, 1) if b in ops), None)
    for B in rows:
        print_ops(B, ops[B][0], base)
    if ops_detail and 1 in ops and max(rows) > 1:
        print_op_detail(max(rows), ops[max(rows)][1]["batched"], ops[1][1]["batched"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--attention", action="store_true", help="time the attention calls on their own")
    parser.add_argument("--models", nargs="+", default=["sdar", "llada"], help="bench_server.MODELS' names")
    parser.add_argument("--ops-detail", action="store_true", help="list the ops of a step by name")
    parser.add_argument("--ops-only", action="store_true", help="count the ops, time nothing")
    args = parser.parse_args()
    counter = OpCounter(Timer())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_server import checkpoints

    with tempfile.TemporaryDirectory() as folder:
        for name, (path, fields) in checkpoints(Path(folder), args.models).items():
            profile(name, path, fields, args.rows, args.steps, args.attention, counter, args.ops_detail, args.ops_only)


if __name__ == "__main__":
    main()
