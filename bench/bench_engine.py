"""Engine overhead on LLaDA and Dream micro models, at a small and a realistic vocabulary
(a benchmark, not a test).

overhead = decode wall time (stream_generate) / wall time of the same decode's model
forwards run bare: every `predict` / `predict_rows` call the decode made, replayed with
the same canvas, block and gathered rows, each evaluated, nothing else. It is what the
engine adds to its forwards: log-softmax, proposals, entropy, the commit rule, the kept
log-probs, the host. `vs block fwd` divides the decode by forwards x one forward whose
head covers the whole block (the definition before the head ran over gathered rows, when
Dream's whole-canvas step cost 2.14x it at a 16k vocabulary): below 1 where a step reads
fewer rows than its block. `vs plain loop` divides the decode by
a minimal loop written in this file (`plain_loop`: the same adapter forwards over the same
gathered rows, the proposal, probability and entropy from the same vocab_stats passes, the
top-k or threshold commit picked on the host), which must give the same tokens and
forwards (checked at every run): the engine's cost over the least a correct loop does.
Side by side in one run, interleaved; the best of 5 (--repeats) of each (a shared
machine's load only ever adds time).

The micro models have hidden size 256 (4 layers). At a 32k vocabulary that makes the
output layer cheap per logit (256 multiply-adds), while each pass an exact step makes over
the vocabulary of the rows it reads (argmax, exp, sum) costs the same per logit at any
hidden size, the exp most (vocab_stats.cpu_exp, ~5-7 ns a logit on this CPU; see
decoders/vocab_stats.py): so at hidden 256 those passes are a floor on the overhead that
no removal of other work gets under. The `--wide-vocabs` rows (2 layers, hidden
`--wide-hidden`, 1024 by default: a head four times as wide per logit, nearer a real
model's, at a micro model's depth) show the overhead when the head costs more per logit;
they are added rows, the hidden-256 rows stay the reference.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/bench_engine.py [--vocabs 288 32768] [--wide-vocabs 32768] [--wide-hidden 1024] \\
            [--repeats 5] [--tokens 128] \\
            [--cases llada-block llada-threshold dream-canvas dream-block]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.api.decode import build_decode  # noqa: E402
from mlx_lm_diffusion.decoding.decoders.gathered_rows import bucket  # noqa: E402
from mlx_lm_diffusion.decoding.decoders.vocab_stats import greedy_parts  # noqa: E402
from mlx_lm_diffusion.testing.checkpoints import write_dream, write_llada  # noqa: E402
from model_adapters import adapter_for  # noqa: E402

GEN, PROMPT = 128, list(range(40, 72))
SIZE = dict(n_layers=4, n_heads=8, n_kv_heads=4)
HIDDEN, MLP = 256, 512
# --wide-vocabs: a head as wide as a small real model's (see the docstring)
WIDE = dict(n_layers=2, n_heads=16, n_kv_heads=8)
WIDE_HIDDEN = 1024  # (--wide-hidden; the MLP is twice as wide)
# --cases: the names of the cases, run in this order
CASES = {
    "llada-block": ("LLaDA", dict(block_length=32), 32),
    "llada-threshold": ("LLaDA", dict(block_length=32, threshold=0.9), 32),
    "dream-canvas": ("Dream", dict(), GEN),
    "dream-block": ("Dream", dict(block_length=32), 32),
}


def set_tokens(tokens: int) -> None:
    """Decode `tokens` per case (Dream's whole-canvas block is the canvas)."""
    global GEN
    GEN = tokens
    CASES["dream-canvas"] = ("Dream", dict(), tokens)


class Recorder:
    """Records the forwards of the decodes of one adapter class (its predict and
    predict_rows calls, arguments evaluated), while active."""

    def __init__(self, cls):
        self.cls, self.calls = cls, []

    def __enter__(self):
        self.saved = self.cls.predict, self.cls.predict_rows
        predict, predict_rows = self.saved

        def recorded_predict(adapter, state, canvas, start, end):
            self.calls.append((adapter, canvas, start, end, None))
            return predict(adapter, state, canvas, start, end)

        def recorded_rows(adapter, state, canvas, start, end, rows):
            self.calls.append((adapter, canvas, start, end, rows))
            return predict_rows(adapter, state, canvas, start, end, rows)

        self.cls.predict, self.cls.predict_rows = recorded_predict, recorded_rows
        return self

    def __exit__(self, *exc):
        del self.cls.predict, self.cls.predict_rows
        for name, method in zip(("predict", "predict_rows"), self.saved):
            if getattr(self.cls, name) is not method:  # (defined on the class itself)
                setattr(self.cls, name, method)

    def bare_seconds(self) -> float:
        """The recorded forwards replayed bare (no cache state: these decodes keep none)."""
        mx.eval([(canvas, rows) for _, canvas, _, _, rows in self.calls])
        tic = time.perf_counter()
        for adapter, canvas, start, end, rows in self.calls:
            if rows is None:
                mx.eval(adapter.predict(None, canvas, start, end))
            else:
                mx.eval(adapter.predict_rows(None, canvas, start, end, rows))
        return time.perf_counter() - tic


def block_forward_seconds(adapter, block, repeats):
    """One forward whose head covers the whole block (the earlier bare forward)."""
    canvas = mx.array([PROMPT + [adapter.mask_id] * GEN])
    start = len(PROMPT)
    mx.eval(adapter.predict(None, canvas, start, start + block))
    tic = time.perf_counter()
    for _ in range(repeats):
        mx.eval(adapter.predict(None, canvas, start, start + block))
    return (time.perf_counter() - tic) / repeats


def step_counts(rule: str, masked: int, steps: int, step: int, scores: np.ndarray, threshold) -> int:
    """How many of a block's `masked` masks the bench's cases commit at `step` of `steps`:
    LLaDA's even split of the masks over the steps (the first `masked % steps` steps take
    one more), Dream's int(M (1 - s / t)) over linspace(1, 1e-3, steps + 1) in float32
    (all at the last step), or the threshold rule's count of scores >= threshold (at
    least one)."""
    if threshold is not None:
        return max(1, int((scores >= threshold).sum()))
    if rule == "low_confidence":
        return 0 if step >= steps else masked // steps + (step < masked % steps)  # (of the block's first masks)
    if step >= steps - 1:
        return masked
    t = np.linspace(1.0, 1e-3, steps + 1, dtype=np.float64).astype(np.float32)
    return int(np.floor(np.float32(masked) * (np.float32(1.0) - t[step + 1] / t[step])))


def plain_loop(model, tok, options: dict) -> tuple:
    """(tokens, forwards): the least a correct loop does for the bench's cases, written
    here without the engine: per step, the adapter's forward over the masked positions
    of the block (their head only, padded to the engine's buckets so the model sees the
    same shapes), the proposal and its probability (and the entropy for Dream's rule)
    from vocab_stats' passes over those rows, the top-k (or threshold) commit chosen on
    the host, the canvas rewritten; it stops at a block whose final prefix holds an EOS."""
    decode = build_decode(model, tok, PROMPT, GEN, **options)
    adapter, o = decode.adapter, decode.options
    P, mask_id, eos = len(PROMPT), adapter.mask_id, adapter.eos_ids
    host = np.array([PROMPT + [mask_id] * GEN], dtype=np.int32)
    suppress = np.zeros(adapter.vocab_size, np.float32)
    suppress[sorted(adapter.suppress_ids)] = -np.inf
    suppress, forwards = mx.array(suppress), 0
    for start in range(P, P + GEN, o.block_length):
        end = min(start + o.block_length, P + GEN)
        first_masks = int((host[0, start:end] == mask_id).sum())
        for step in range(o.rule.step_bound(o.steps, end - start)):
            open_ = np.flatnonzero(host[0, start:end] == mask_id)
            if open_.size == 0:
                break
            n, size = open_.size, bucket(open_.size, end - start)
            canvas = mx.array(host)
            if size >= end - start:
                logits = adapter.predict(None, canvas, start, end)[:, mx.array(open_)]
            else:
                rows = np.concatenate([open_, np.setdiff1d(np.arange(end - start), open_)])[:size]
                logits = adapter.predict_rows(None, canvas, start, end, mx.array(rows[None].astype(np.int32)))[:, :n]
            forwards += 1
            x0, prob, entropy = greedy_parts(logits + suppress)[:3]
            scores = -entropy if o.rule.name == "entropy" else prob
            mx.eval(x0, scores)  # (one wait for both: read one by one, the second waits again)
            x0, scores = np.array(x0[0]), np.array(scores[0])
            k = step_counts(
                o.rule.name,
                first_masks if o.rule.name == "low_confidence" else n,
                o.steps,
                step,
                scores,
                o.rule.threshold if o.rule.name == "threshold" else None,
            )
            chosen = np.argsort(-scores, kind="stable")[:k]  # (first position on ties)
            host[0, start + open_[chosen]] = x0[chosen]
        prefix = host[0, P:end]
        final = prefix[: np.argmax(prefix == mask_id)] if (prefix == mask_id).any() else prefix
        if any(int(t) in eos for t in final):
            break
    return host[0, P:].tolist(), forwards


def plain_seconds(model, tok, options, tokens, forwards) -> float:
    """Wall time of one plain loop, checked against the engine's tokens and forwards."""
    tic = time.perf_counter()
    loop_tokens, loop_forwards = plain_loop(model, tok, options)
    seconds = time.perf_counter() - tic
    if loop_tokens[: len(tokens)] != tokens or loop_forwards != forwards:
        raise AssertionError(
            f"the plain loop differs from the engine ({options}): {loop_forwards} forwards against {forwards}"
        )
    return seconds


def decode(model, tok, **options):
    tic = time.perf_counter()
    out = list(mld.stream_generate(model, tok, PROMPT, max_tokens=GEN, **options))
    # count all tokens: the random micro models rarely emit EOS, and we time the canvas
    return time.perf_counter() - tic, [r.token for r in out], out[-1].forwards


def measure(name, model, tok, options, block, repeats=5):
    """(overhead, vs block fwd, vs plain loop, wall, tokens, forwards, gathered forwards):
    decodes, their bare replays, the whole-block forward and the plain loop interleaved,
    each timed `repeats` times; the best of each is used (on a shared, loaded machine the
    minimum is the stable figure)."""
    adapter = adapter_for(model, tok)
    decode(model, tok, **options)  # warm up
    walls, bares, wholes, plains = [], [], [], []
    for _ in range(repeats):
        with Recorder(type(adapter)) as recorder:
            wall, tokens, forwards = decode(model, tok, **options)
        walls.append(wall)
        bares.append(recorder.bare_seconds())
        wholes.append(forwards * block_forward_seconds(adapter, block, min(forwards, 16)))
        plains.append(plain_seconds(model, tok, options, tokens, forwards))
    gathered = sum(rows is not None for *_, rows in recorder.calls)
    wall = min(walls)
    return wall / min(bares), wall / min(wholes), wall / min(plains), wall, len(tokens), forwards, gathered


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocabs", type=int, nargs="*", default=[288, 32768])
    parser.add_argument("--repeats", type=int, default=5, help="decode / bare pairs per case (the median is shown)")
    parser.add_argument("--tokens", type=int, default=GEN, help="tokens per decode (Dream's whole canvas)")
    parser.add_argument(
        "--wide-vocabs",
        type=int,
        nargs="*",
        default=[],
        help="also these vocabularies with a wider hidden size, 2 layers (see the docstring)",
    )
    parser.add_argument("--wide-hidden", type=int, default=WIDE_HIDDEN, help="the hidden size of --wide-vocabs")
    parser.add_argument(
        "--cases",
        nargs="*",
        choices=list(CASES),
        default=list(CASES),
        help="the cases to run (default: all): LLaDA block 32, LLaDA threshold 0.9, "
        "Dream's whole canvas, Dream block 32",
    )
    args = parser.parse_args()
    if args.tokens != GEN:
        set_tokens(args.tokens)
    cases = [case for name, case in CASES.items() if name in args.cases]
    rows = []
    models = [(vocab, HIDDEN, MLP, SIZE) for vocab in args.vocabs]
    models += [(vocab, args.wide_hidden, 2 * args.wide_hidden, WIDE) for vocab in args.wide_vocabs]
    with tempfile.TemporaryDirectory() as tmp:
        for vocab, hidden, mlp, size in models:
            writers = {
                "LLaDA": lambda: write_llada(
                    Path(tmp) / f"llada{vocab}-{hidden}", d_model=hidden, mlp=mlp, vocab=vocab, **size
                ),
                "Dream": lambda: write_dream(
                    Path(tmp) / f"dream{vocab}-{hidden}", hidden=hidden, inter=mlp, vocab=vocab, **size
                ),
            }
            # (only the families the cases decode)
            loaded = {name: mld.load(str(writers[name]())) for name in dict.fromkeys(name for name, *_ in cases)}
            for name, options, block in cases:
                ratio, whole, plain, wall, tokens, forwards, gathered = measure(
                    name, *loaded[name], options, block, args.repeats
                )
                rows.append(
                    (
                        vocab,
                        hidden,
                        size["n_layers"],
                        name,
                        options,
                        tokens,
                        forwards,
                        gathered,
                        wall,
                        ratio,
                        whole,
                        plain,
                    )
                )
                print(".", end="", flush=True, file=sys.stderr)
    print(file=sys.stderr)
    print(
        f"{'vocab':>6} {'hidden':>6} {'layers':>6} {'model':6} {'options':36} {'tokens':>6} {'fwd/tok':>8}"
        f" {'gathered':>8} {'tok/s':>8} {'overhead':>8} {'vs block fwd':>12} {'vs plain loop':>13}"
    )
    for vocab, hidden, layers, name, options, tokens, forwards, gathered, wall, ratio, whole, plain in rows:
        print(
            f"{vocab:6d} {hidden:6d} {layers:6d} {name:6} {str(options):36} {tokens:6d} {forwards / tokens:8.2f}"
            f" {gathered:8d} {tokens / wall:8.1f} {ratio:8.3f} {whole:12.3f} {plain:13.3f}"
        )


if __name__ == "__main__":
    main()
