"""The accuracy-against-speed table and plot of an evaluation's settings.

One row per setting and task: the task's first metric (lm-eval lists a task's metrics
in its config's order, the primary one first), with what the task's requests cost
(evaluation.speed). The table is printed and written as markdown; the plot (when
matplotlib, the `bench` extra, is installed) puts each task's metric against tokens per
forward and against tokens per second, one point per setting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

COLUMNS = ("setting", "task", "metric", "value", "tokens/forward", "tok/s", "forwards")


@dataclass(frozen=True)
class Row:
    setting: str
    task: str
    metric: str
    value: Optional[float]
    stderr: Optional[float]
    tokens_per_forward: Optional[float]
    tokens_per_second: Optional[float]
    forwards: int


def primary_metric(scores: dict) -> tuple:
    """(name, value, stderr) of a task's first metric in lm-eval's results ("acc,none",
    "acc_stderr,none", ...; the filter shown only when it is not "none")."""
    for key, value in scores.items():
        name, _, filt = key.partition(",")
        if not filt or name.endswith("_stderr") or not isinstance(value, (int, float)):
            continue
        stderr = scores.get(f"{name}_stderr,{filt}")
        shown = name if filt == "none" else f"{name} ({filt})"
        return shown, float(value), float(stderr) if isinstance(stderr, (int, float)) else None
    return "-", None, None


def rows_of(setting: str, results: dict, speed: dict) -> list:
    """The rows of one setting: lm-eval's `results["results"]` and the speed record."""
    rows = []
    for task, scores in results.items():
        metric, value, stderr = primary_metric(scores)
        cost = speed.get(task, {})
        rows.append(Row(setting, task, metric, value, stderr, cost.get("tokens_per_forward"),
                        cost.get("tokens_per_second"), int(cost.get("forwards", 0) + cost.get("scoring_forwards", 0))))
    return rows


def _cell(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(rows: Sequence[Row]) -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 4) + "|"]
    for r in rows:
        value = _cell(r.value, 4) + ("" if r.stderr is None else f" ± {r.stderr:.4f}")
        cells = (r.setting, r.task, r.metric, value, _cell(r.tokens_per_forward, 2), _cell(r.tokens_per_second, 1),
                 str(r.forwards))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: Path) -> Optional[Path]:
    """Each task's metric against tokens per forward and against tok/s, one point per
    setting, as a PNG at `path`; None when matplotlib is missing or no row has a speed."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # (no display: write the file only)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    timed = [r for r in rows if r.value is not None and r.tokens_per_forward is not None]
    if not timed:
        return None
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, attr, title in ((axes[0], "tokens_per_forward", "tokens per forward"),
                            (axes[1], "tokens_per_second", "tokens per second")):
        for task in dict.fromkeys(r.task for r in timed):
            points = [r for r in timed if r.task == task and getattr(r, attr) is not None]
            xs, ys = [getattr(r, attr) for r in points], [r.value for r in points]
            ax.plot(xs, ys, "o", label=f"{task} ({points[0].metric})" if points else task)
            for r, x, y in zip(points, xs, ys):
                ax.annotate(r.setting, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel(title)
        ax.set_ylabel("metric")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle("accuracy against speed")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
