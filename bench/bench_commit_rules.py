"""Commit rules on the embedded demo model: held-out exact match against speed.

    python bench/bench_commit_rules.py [--problems 1000] [--out bench/out]

For each commit rule (LLaDA's fixed quota at several step counts, threshold 0.5-0.95,
factor, entropy bound) it decodes the same held-out addition problems greedily and
reports exact-match accuracy, tokens per forward (emitted tokens, answer digits plus
the stopping EOS, over the forwards each problem needed) and tokens/s (all settings run
the same way, batched by prompt length, one after another in this process: compare
them side by side, not with other runs). The table goes to stdout; the plot of accuracy
against tokens per forward goes to OUT/commit_rules.png (needs matplotlib: the `bench`
extra).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlx_lm_diffusion.demo import DEMO_MAX_TOKENS, held_out_problems, load_demo
from mlx_lm_diffusion.demo.evaluate import evaluate

# (rule family, label, DecodeOptions fields). block_length = max_tokens = DEMO_MAX_TOKENS.
SETTINGS = [
    *[("quota (low_confidence)", f"steps={s}", dict(steps=s)) for s in (5, 4, 3, 2, 1)],
    *[("threshold", f"threshold={t}", dict(threshold=t)) for t in (0.95, 0.9, 0.8, 0.7, 0.6, 0.5)],
    *[("factor", f"factor={f}", dict(strategy="factor", factor=f)) for f in (0.25, 0.5, 1.0, 2.0, 4.0)],
    *[
        ("entropy bound", f"bound={e}", dict(strategy="entropy_bound", entropy_bound=e))
        for e in (0.01, 0.1, 0.35, 1.0, 2.0)
    ],
]


def run(problems: int):
    model, tokenizer = load_demo()
    pairs = held_out_problems(problems)
    evaluate(model, tokenizer, pairs[:64])  # warm up
    rows = []
    for family, label, options in SETTINGS:
        r = evaluate(model, tokenizer, pairs, **options)
        rows.append(
            (family, label, r.accuracy, r.tokens_per_forward, float(sum(r.forwards)) / len(pairs), r.tokens_per_second)
        )
    return rows


def table(rows, problems: int) -> str:
    head = f"{'rule':<24}{'setting':<16}{'exact match':>12}{'tok/forward':>13}{'fwd/problem':>13}{'tok/s':>9}"
    lines = [
        f"demo model, {problems} held-out problems, greedy, max_tokens = block = {DEMO_MAX_TOKENS}",
        head,
        "-" * len(head),
    ]
    for family, label, acc, tpf, fpp, tps in rows:
        lines.append(f"{family:<24}{label:<16}{acc:>12.3f}{tpf:>13.2f}{fpp:>13.2f}{tps:>9.0f}")
    return "\n".join(lines)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family in dict.fromkeys(r[0] for r in rows):
        pts = [r for r in rows if r[0] == family]
        ax.plot([r[3] for r in pts], [r[2] for r in pts], marker="o", label=family)
        for r in pts:
            ax.annotate(r[1].split("=")[1], (r[3], r[2]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("tokens per forward (answer + EOS)")
    ax.set_ylabel("held-out exact match")
    ax.set_title("Commit rules on the demo adder: accuracy vs parallelism")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--problems", type=int, default=1000)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    rows = run(args.problems)
    print(table(rows, args.problems))
    try:
        plot(rows, args.out / "commit_rules.png")
        print(f"plot: {args.out / 'commit_rules.png'}")
    except ImportError:
        print("matplotlib is missing (pip install -e '.[bench]'): no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
