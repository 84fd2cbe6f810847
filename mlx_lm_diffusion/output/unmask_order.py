"""The unmask-order picture: the generated positions across, the forwards down, a cell
coloured where a position was committed (its confidence then), grey after, blank before.

One picture from three sources, drawn by `draw`: a decode's steps (`OrderRecorder`, a
`draft_callback`; the generate CLI's `--trace-png`), a step-schedule protocol response
(`from_protocol`, or `python -m mlx_lm_diffusion.output.unmask_order RESPONSE.json OUT.png`),
and a decode's draft frames (`from_frames`: the studio page's, rendered by the server).
Drawing needs matplotlib (the `plot` extra); recording does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from mlx_lm_diffusion.flags import exit_status


@dataclass
class UnmaskOrder:
    """Which forward committed each generated position, and its confidence then."""

    forward: np.ndarray  # (N,) 1-based forward that committed each position; 0: never
    confidence: np.ndarray  # (N,) confidence at commit in [0, 1]; nan where unknown
    forwards: int  # forwards of the whole decode (the picture's height)

    def grid(self) -> np.ndarray:
        """(forwards, N) cells: the confidence at the commit forward, -1 after it (committed),
        nan before it (still masked)."""
        rows = np.arange(1, self.forwards + 1)[:, None]
        at = rows == self.forward[None, :]
        after = (rows > self.forward[None, :]) & (self.forward[None, :] > 0)
        cells = np.full((self.forwards, len(self.forward)), np.nan)
        cells[after] = -1.0
        confidence = np.where(np.isnan(self.confidence), 1.0, self.confidence)
        cells[at] = np.broadcast_to(confidence, cells.shape)[at]
        return cells


class OrderRecorder:
    """A `draft_callback` that records the forward committing each generated position of
    row 0 (a position counts as committed when it stops being the mask token; on a
    uniform canvas, with no mask token, when it becomes final), then calls `then`."""

    def __init__(self, mask_id: Optional[int], then: Optional[Callable[[Any], None]] = None):
        self.mask_id, self.then = mask_id, then
        self.forward: dict[int, int] = {}
        self.confidence: dict[int, float] = {}
        self.forwards = 0
        self.generated = 0
        self.tokens: list[int] = []  # row 0's generated tokens after the latest forward

    def __call__(self, step) -> None:
        row = np.asarray(step.canvas[0, step.prompt_len :])
        self.generated, self.tokens = max(self.generated, len(row)), row.tolist()
        self.forwards = max(self.forwards, int(step.forwards))
        if self.mask_id is None:
            committed = np.arange(int(step.final[0]))
        else:
            committed = np.flatnonzero(row != self.mask_id)
        new = [int(i) for i in committed if int(i) not in self.forward]
        if new:
            start = step.block[0] - step.prompt_len
            known = None if step.block_confidence is None else np.array(step.block_confidence[0], dtype=np.float64)
            for i in new:
                self.forward[i] = int(step.forwards)
                inside = known is not None and 0 <= i - start < len(known)
                self.confidence[i] = float(np.clip(known[i - start], 0.0, 1.0)) if inside else float("nan")
        if self.then is not None:
            self.then(step)

    def committed_span(self) -> int:
        """The generated positions up to the last one committed."""
        return max(self.forward, default=-1) + 1

    def order(self, length: Optional[int] = None) -> UnmaskOrder:
        """The record over the first `length` generated positions (all by default)."""
        n = self.generated if length is None else length
        forward = np.array([self.forward.get(i, 0) for i in range(n)], dtype=np.int64)
        confidence = np.array([self.confidence.get(i, np.nan) for i in range(n)])
        return UnmaskOrder(forward, confidence, max(self.forwards, 1))


def from_protocol(response: dict) -> UnmaskOrder:
    """The order of a step-schedule protocol response: `per_step_unmasked` gives each
    step's absolute indices (the prompt is what `final_tokens` holds before the
    `confidence` entries), `confidence` each generated token's."""
    try:
        confidence = np.asarray(response["confidence"], dtype=np.float64)
        prompt_len = len(response["final_tokens"]) - len(confidence)
        entries = list(response["per_step_unmasked"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a step-schedule protocol response: {e}") from e
    forward = np.zeros(len(confidence), dtype=np.int64)
    last = 0
    for entry in entries:
        step = int(entry["step"]) + 1
        for index in entry["token_indices"]:
            i = int(index) - prompt_len
            if 0 <= i < len(forward) and forward[i] == 0:
                forward[i] = step
        last = max(last, step)
    return UnmaskOrder(forward, confidence, max(last, 1))


def from_frames(frames: list) -> UnmaskOrder:
    """The order of a decode's draft frames (output.frames.draft_frame): each position's first
    frame showing it committed, its confidence from that frame's block."""
    if not isinstance(frames, list) or not frames or not all(isinstance(f, dict) for f in frames):
        raise ValueError("frames must be a non-empty list of draft frames")
    try:
        width = max(len(str(f.get("states", ""))) for f in frames)
        forward, confidence = np.zeros(width, dtype=np.int64), np.full(width, np.nan)
        for frame in frames:
            start = int(frame.get("block", [0, 0])[0])
            block_confidence = [float(c) for c in frame.get("confidence", [])]
            for i, state in enumerate(str(frame.get("states", ""))):
                if state == "c" and forward[i] == 0:
                    forward[i] = max(int(frame["forwards"]), 1)
                    if 0 <= i - start < len(block_confidence):
                        confidence[i] = min(max(block_confidence[i - start], 0.0), 1.0)
        forwards = max(int(f["forwards"]) for f in frames)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a draft frame: {type(e).__name__}: {e}") from None
    return UnmaskOrder(forward, confidence, max(forwards, 1))


def draw(order: UnmaskOrder, path: str, labels: Optional[list[str]] = None, title: str = "") -> None:
    """Save the picture to `path` (PNG, SVG or PDF by its suffix) with matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError as e:
        raise ValueError(
            "drawing the unmask order needs matplotlib: pip install 'mlx-lm-diffusion[plot]' "
            '(from a clone: pip install -e ".[plot]")'
        ) from e
    cells = order.grid()
    n, f = cells.shape[1], cells.shape[0]
    fig, ax = plt.subplots(figsize=(min(2 + 0.25 * n, 16), min(1.5 + 0.22 * f, 12)), dpi=100)
    ax.imshow(
        np.where(cells == -1.0, 1.0, np.nan),
        cmap=ListedColormap(["#d9d9d9"]),
        vmin=0,
        vmax=1,
        aspect="auto",
        interpolation="nearest",
    )
    shown = ax.imshow(
        np.where(cells >= 0, cells, np.nan), cmap="viridis", vmin=0, vmax=1, aspect="auto", interpolation="nearest"
    )
    fig.colorbar(shown, ax=ax, label="confidence at commit")
    ax.set_xlabel("generated position")
    ax.set_ylabel("forward")
    ax.set_yticks(range(f), [str(i + 1) for i in range(f)] if f <= 40 else None)
    if labels is not None and n <= 64:
        ax.set_xticks(range(n), [repr(t)[1:-1] for t in labels[:n]], rotation=90)
    summary = f"{int((order.forward > 0).sum())} tokens in {f} forwards"
    ax.set_title(f"{title}\n{summary}" if title else f"unmask order: {summary}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m mlx_lm_diffusion.output.unmask_order RESPONSE.json OUT.png`: the picture
    of a saved step-schedule protocol response."""
    parser = argparse.ArgumentParser(
        prog="python -m mlx_lm_diffusion.output.unmask_order",
        description="Draw the unmask order of a step-schedule protocol response",
    )
    parser.add_argument("response", help="The protocol response, a JSON file ('-': stdin)")
    parser.add_argument("out", help="The picture to write (.png, .svg or .pdf)")
    args = parser.parse_args(argv)

    def work() -> None:
        text = sys.stdin.read() if args.response == "-" else Path(args.response).read_text(encoding="utf-8")
        draw(from_protocol(json.loads(text)), args.out)

    return exit_status(work)


if __name__ == "__main__":
    sys.exit(main())
