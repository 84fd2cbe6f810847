"""The accuracy-against-speed table and plot of an evaluation's settings.

One row per setting and task: the task's first metric (lm-eval lists a task's metrics
in its config's order, the primary one first), with what the task's requests cost
(evaluation.speed). The table is printed and written as markdown; the plot (when
matplotlib, the `plot` extra, is installed) puts each task's metric against tokens per
forward and against tokens per second, one marker per setting with its standard error and
the Pareto front, and a sweep over two options as a heatmap too (`figure`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

COLUMNS = ("setting", "task", "metric", "value", "tokens/forward", "tok/s", "forwards")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")


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
    grid: tuple = ()  # the setting's ((option, value), ...) of a sweep


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


def rows_of(setting: str, results: dict, speed: dict, grid: tuple = ()) -> list:
    """The rows of one setting: lm-eval's `results["results"]` and the speed record (`grid`:
    the setting's sweep values)."""
    rows = []
    for task, scores in results.items():
        metric, value, stderr = primary_metric(scores)
        cost = speed.get(task, {})
        rows.append(
            Row(
                setting,
                task,
                metric,
                value,
                stderr,
                cost.get("tokens_per_forward"),
                cost.get("tokens_per_second"),
                int(cost.get("forwards", 0) + cost.get("scoring_forwards", 0)),
                grid,
            )
        )
    return rows


def _cell(value: Optional[float], digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(rows: Sequence[Row]) -> str:
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * 4) + "|"]
    for r in rows:
        value = _cell(r.value, 4) + ("" if r.stderr is None else f" ± {r.stderr:.4f}")
        cells = (
            r.setting,
            r.task,
            r.metric,
            value,
            _cell(r.tokens_per_forward, 2),
            _cell(r.tokens_per_second, 1),
            str(r.forwards),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def pareto_front(points: Sequence[tuple]) -> list:
    """The points (x, y) no other point beats on both (higher is better on both), by x."""
    front, best = [], -math.inf
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    return sorted(front)


def figure(rows: Sequence[Row]) -> Any:
    """The plot as a matplotlib Figure: per task a row of panels, its metric (named on the y
    axis, with lm-eval's standard error as error bars) against tokens per forward and against
    tok/s, one marker per setting (named in the legend, not on the points, where labels
    collided), the Pareto front dashed; a sweep over two options adds a heatmap of the metric
    over their grid. None when no row has both a value and a speed."""
    import matplotlib

    matplotlib.use("Agg")  # (no display: write the file only)
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.value is not None and r.tokens_per_forward is not None]
    if not timed:
        return None
    tasks = list(dict.fromkeys(r.task for r in timed))
    settings = list(dict.fromkeys(r.setting for r in timed))
    names = [name for name, _ in timed[0].grid]
    grid = len(names) == 2 and all(len(r.grid) == 2 for r in timed)
    columns = 3 if grid else 2
    fig, panels = plt.subplots(len(tasks), columns, figsize=(4.8 * columns + 2.6, 3.9 * len(tasks)), squeeze=False)
    colours = plt.get_cmap("tab10" if len(settings) <= 10 else "viridis")
    style = {
        s: (colours(k % 10 if len(settings) <= 10 else k / max(len(settings) - 1, 1)), MARKERS[k % len(MARKERS)])
        for k, s in enumerate(settings)
    }
    for t, task in enumerate(tasks):
        points = [r for r in timed if r.task == task]
        for c, (attr, name) in enumerate(
            (("tokens_per_forward", "tokens per forward"), ("tokens_per_second", "tokens per second"))
        ):
            ax = panels[t][c]
            placed = [(getattr(r, attr), r.value, r) for r in points if getattr(r, attr) is not None]
            for x, y, r in placed:
                colour, marker = style[r.setting]
                ax.errorbar(
                    [x], [y], yerr=[r.stderr or 0.0], fmt=marker, color=colour, capsize=3, ms=7, label=r.setting
                )
            front = pareto_front([(x, y) for x, y, _ in placed])
            if len(front) > 1:
                ax.plot(*zip(*front), "--", color="0.45", lw=1, zorder=0, label="Pareto front")
            ax.set_xlabel(name)
            ax.set_ylabel(f"{points[0].metric} ({task})")
            ax.grid(alpha=0.3)
        if grid:
            _heatmap(panels[t][2], points, names)
    handles, labels = panels[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8, title="setting", frameon=False)
    fig.suptitle("accuracy against speed (error bars: lm-eval's standard error)")
    fig.tight_layout(rect=(0, 0, 1 - 2.4 / fig.get_figwidth(), 1))
    return fig


def _heatmap(ax: Any, points: Sequence[Row], names: Sequence[str]) -> None:
    """The metric over a two-option sweep's grid, each cell with its value and tokens per forward."""
    rows_values = list(dict.fromkeys(str(dict(r.grid)[names[0]]) for r in points))
    column_values = list(dict.fromkeys(str(dict(r.grid)[names[1]]) for r in points))
    cells = np.full((len(rows_values), len(column_values)), np.nan)
    notes = {}
    for r in points:
        i, j = rows_values.index(str(dict(r.grid)[names[0]])), column_values.index(str(dict(r.grid)[names[1]]))
        cells[i, j] = r.value
        notes[i, j] = f"{r.value:.3f}\n{r.tokens_per_forward:.2f} t/f"
    shown = ax.imshow(cells, cmap="viridis", aspect="auto")
    for (i, j), text in notes.items():
        dark = np.nanmax(cells) == np.nanmin(cells) or cells[i, j] < (np.nanmin(cells) + np.nanmax(cells)) / 2
        ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(column_values)), column_values)
    ax.set_yticks(range(len(rows_values)), rows_values)
    ax.set_xlabel(names[1])
    ax.set_ylabel(names[0])
    ax.figure.colorbar(shown, ax=ax, label=points[0].metric)


def plot(rows: Sequence[Row], path: Path) -> Optional[Path]:
    """`figure` as a PNG at `path`; None when matplotlib is missing or no row has a speed."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = figure(rows)
    if fig is None:
        return None
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
