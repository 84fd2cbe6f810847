"""Exact-match decoding of addition problems through the shared engine.

    python -m mlx_lm_diffusion.demo.evaluate [--model DIR] [--problems N]
        [--max-tokens 8 64 512] [--threshold 0.9] [--json FILE]

Problems are decoded in batches of equal prompt length, each batch with the options of
its first problem's request (api.decode.build_decode's). Per row it records the
forwards the row needed (the forward at which its final prefix reached EOS) and the
tokens it emitted (answer digits plus the stopping EOS), so that tokens per forward
is what a single-prompt decode of that row would report. "At its defaults" means the
decoding in the checkpoint's generation_config.json (block_length, steps per block,
strategy); `--threshold` swaps in the threshold rule, the rest unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from mlx_lm_diffusion.api.decode import build_decode
from mlx_lm_diffusion.api.loading import load
from mlx_lm_diffusion.decoding import FREE, Engine
from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.demo.problems import (
    EDGE_CASES,
    GEN_LENGTH,
    JSON_CLOSE,
    JSON_OPEN,
    answer_text,
    carry_chain_problems,
    group_by_prompt_length,
    held_out_problems,
    json_answer_text,
)
from mlx_lm_diffusion.demo.vocab import ANSWER_WIDTH, decode
from mlx_lm_diffusion.flags import one_line_errors
from model_adapters import adapter_for

# the max_tokens the shipped figures are measured at (512: capped to the context)
MAX_TOKENS = (5, 6, 8, 16, 64, 512)
# and the json form's: '{"sum":' + 5 slots + '}' and EOS take 14; 32 is the demo's default
JSON_MAX_TOKENS = (16, 32, 512)
# and the infill's, the middle's slots (b has at most 4 digits; 32 is the demo's default length)
INFILL_MAX_TOKENS = (4, 8, 16, 32)
DECODING_KEYS = ("block_length", "steps", "strategy")  # generation_config.json keys read here


@dataclass
class Evaluation:
    form: str = "plain"
    pairs: list = field(default_factory=list)
    answers: list = field(default_factory=list)  # decoded text per problem
    forwards: list = field(default_factory=list)  # forwards each row needed
    emitted: list = field(default_factory=list)  # tokens each row emitted (incl. EOS)
    stopped: list = field(default_factory=list)  # the row's final prefix ends with EOS
    seconds: float = 0.0

    @property
    def correct(self) -> np.ndarray:
        return np.array([ans == right_answer(self.form, a, b) for (a, b), ans in zip(self.pairs, self.answers)])

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())

    @property
    def slot_accuracy(self) -> list:
        """Per answer slot (most significant first), the share of problems whose decoded
        answer, right-aligned, has the right character there (blank or digit)."""

        def slots(text: str) -> str:
            if self.form == "json":  # the number inside {"sum":...}
                text = text[len(JSON_OPEN) :].removesuffix(JSON_CLOSE)
            return text[-ANSWER_WIDTH:].rjust(ANSWER_WIDTH)

        truth = [slots(right_answer(self.form, a, b)) for a, b in self.pairs]
        got = [slots(ans) for ans in self.answers]
        return [float(np.mean([t[i] == g[i] for t, g in zip(truth, got)])) for i in range(ANSWER_WIDTH)]

    @property
    def tokens_per_forward(self) -> float:
        return float(np.sum(self.emitted) / max(np.sum(self.forwards), 1))

    @property
    def tokens_per_second(self) -> float:
        return float(np.sum(self.emitted) / max(self.seconds, 1e-9))


def right_answer(form: str, a: int, b: int) -> str:
    """The text a right answer reads: the sum; '{"sum":825}' (json); the operand b (infill)."""
    if form == "infill":
        return str(b)
    return json_answer_text(a, b) if form == "json" else answer_text(a, b)


def generation_defaults(path) -> dict:
    """The decoding defaults in a checkpoint's generation_config.json (DECODING_KEYS)."""
    file = Path(path) / "generation_config.json"
    if not file.exists():
        return {}
    config = json.loads(file.read_text())
    return {k: config[k] for k in DECODING_KEYS if k in config}


def evaluate(
    model,
    tokenizer,
    pairs,
    max_tokens: int = GEN_LENGTH,
    batch_size: Optional[int] = None,
    form: str = "plain",
    **options,
) -> Evaluation:
    """Decode every problem of `form` with `options` (DecodeOptions fields; `None` or absent
    takes the checkpoint's default, when `load` read one, else the family's) and compare with
    the right answer (`right_answer`). batch_size: rows per decode (default: as many as keep a
    batch near 32k canvas positions). json: the decode a JSON grammar makes once it has forced
    the '{' (prompt "357+468={"): max_tokens counts the '{', and the '{' counts as one token
    emitted in one forward of its own, as under the grammar."""
    forced = 1 if form == "json" else 0
    adapter = adapter_for(model, tokenizer)
    result = Evaluation(form=form)
    tic = time.perf_counter()
    for group in group_by_prompt_length(list(pairs), form):
        P, S = group.prompts.shape[1], group.suffixes.shape[1]
        rows = batch_size or max(8, min(512, 2**15 // (P + S + max_tokens)))
        # the group's options: its first problem's request (build_decode's, as every door's),
        # which holds for every row (a resolution reads the prompt's and suffix's lengths only)
        suffix = group.suffixes[0].tolist() or None
        first = build_decode(
            model,
            tokenizer,
            group.prompts[0].tolist(),
            max(1, max_tokens - forced),
            adapter=adapter,
            suffix=suffix,
            **options,
        )
        resolved = first.options
        for lo in range(0, len(group.a), rows):
            prompts = group.prompts[lo : lo + rows]
            seed = None
            if S:  # an infill: the middle free, each row's suffix pinned after it
                seed = np.full((len(prompts), resolved.max_tokens + S), FREE, dtype=np.int64)
                seed[:, resolved.max_tokens :] = group.suffixes[lo : lo + rows]
            _decode(Engine(adapter, resolved, keep_logprobs=False), prompts, result, adapter.eos_ids, seed)
            result.pairs += list(zip(group.a[lo : lo + rows].tolist(), group.b[lo : lo + rows].tolist()))
    if forced:  # the "{" a grammar forces is the json prompt's last token
        result.answers = [JSON_OPEN[0] + text for text in result.answers]
        result.emitted = [n + 1 for n in result.emitted]
        result.forwards = [n + 1 for n in result.forwards]
    result.seconds = time.perf_counter() - tic
    return result


def _decode(engine: Engine, prompts: np.ndarray, result: Evaluation, eos_ids, seed=None) -> None:
    B, P = prompts.shape
    forwards = np.zeros(B, dtype=np.int64)
    last = None
    for last in engine.run(mx.array(prompts), seed):
        forwards[(forwards == 0) & last.done] = last.forwards
    forwards[forwards == 0] = last.forwards
    eos = set(int(e) for e in eos_ids)
    for b in range(B):
        tokens = last.canvas[b, P : P + last.final[b]]
        result.answers.append(decode(tokens))
        result.emitted.append(int(last.final[b]))
        result.forwards.append(int(forwards[b]))
        result.stopped.append(bool(len(tokens)) and int(tokens[-1]) in eos)


SETS = {  # name -> (problems, form)
    "held-out": lambda n: (held_out_problems(n), "plain"),
    "carry chains": lambda n: (carry_chain_problems(n), "plain"),
    "json": lambda n: (held_out_problems(n), "json"),
    "infill": lambda n: (held_out_problems(n), "infill"),
}
# What the shipped table reports (every set; the infill form: "357+" | middle | "=825").
REPORTED_SETS = ("held-out", "carry chains", "json", "infill")


def metrics(
    path,
    n: int,
    max_tokens: Sequence[int] = MAX_TOKENS,
    threshold: float = 0.9,
    stream=sys.stderr,
    sets: Sequence[str] = REPORTED_SETS,
) -> dict:
    """Exact match and tokens per forward of the checkpoint at `path`, at its defaults and
    with `threshold`: each of `sets` at every max_tokens (the json form at JSON_MAX_TOKENS,
    infills at INFILL_MAX_TOKENS), and the named edge cases: the record in recipe.json."""
    lengths = {"json": JSON_MAX_TOKENS, "infill": INFILL_MAX_TOKENS}
    model, tokenizer = load(str(path))
    defaults = generation_defaults(path)
    rules = {
        "defaults": dict(defaults),
        f"threshold {threshold}": {**defaults, "strategy": None, "threshold": threshold},
    }
    out = {"problems": n, "default_decoding": defaults, "results": []}
    for name in sets:
        pairs, form = SETS[name](n)
        for rule, options in rules.items():
            for m in lengths.get(form, max_tokens):
                r = evaluate(model, tokenizer, pairs, max_tokens=m, form=form, **options)
                row = {
                    "set": name,
                    "rule": rule,
                    "max_tokens": m,
                    "exact_match": round(r.accuracy, 4),
                    "stopped_at_eos": round(float(np.mean(r.stopped)), 4),
                    "tokens_per_forward": round(r.tokens_per_forward, 3),
                    "forwards_per_problem": round(float(np.mean(r.forwards)), 2),
                    "seconds": round(r.seconds, 1),
                }
                out["results"].append(row)
                if stream is not None:
                    print(json.dumps(row), file=stream, flush=True)
    edge = evaluate(model, tokenizer, EDGE_CASES, **defaults)
    out["edge_cases"] = {f"{a}+{b}=": ans for (a, b), ans in zip(edge.pairs, edge.answers)}
    out["edge_cases_right"] = int(edge.correct.sum())
    return out


def table(record: dict) -> str:
    head = (
        f"{'set':<14}{'rule':<15}{'max_tokens':>11}{'exact match':>13}{'EOS stop':>10}"
        f"{'tok/forward':>13}{'fwd/problem':>13}"
    )
    lines = [f"{record['problems']} problems per set; defaults {record['default_decoding']}", head, "-" * len(head)]
    for r in record["results"]:
        lines.append(
            f"{r['set']:<14}{r['rule']:<15}{r['max_tokens']:>11}{100 * r['exact_match']:>12.1f}%"
            f"{100 * r['stopped_at_eos']:>9.1f}%{r['tokens_per_forward']:>13.2f}{r['forwards_per_problem']:>13.2f}"
        )
    if "edge_cases" in record:
        lines.append(f"edge cases right: {record['edge_cases_right']} of {len(record['edge_cases'])}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:

    p = one_line_errors(
        argparse.ArgumentParser(prog="python -m mlx_lm_diffusion.demo.evaluate", description=__doc__.split("\n\n")[0])
    )
    p.add_argument("--model", type=Path, default=DEMO_MODEL_PATH, help="Checkpoint (default: the demo)")
    p.add_argument("--problems", type=int, default=1000, help="Problems per set")
    p.add_argument(
        "--sets", nargs="+", choices=list(SETS), default=list(REPORTED_SETS), help="Problem sets (default: %(default)s)"
    )
    p.add_argument("--max-tokens", type=int, nargs="+", default=list(MAX_TOKENS))
    p.add_argument("--threshold", type=float, default=0.9, help="Threshold of the second rule")
    p.add_argument("--json", type=Path, help="Also write the record here")
    args = p.parse_args(argv)
    record = metrics(args.model, args.problems, args.max_tokens, args.threshold, sets=args.sets)
    print(table(record))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
