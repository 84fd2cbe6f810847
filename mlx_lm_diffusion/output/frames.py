"""A decode's frames: row 0's generated region after each forward, as the studio page, the
animations and any client draw it (`draft_frame`), and a `draft_callback` that keeps them.

The server streams these frames (serving.generator: the SSE `draft` events); the generate CLI's
`--trace-anim` and `--trace-png` and the server's render route draw them
(output.animation, output.unmask_order.from_frames): one description of a frame for every picture.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from mlx_lm_diffusion.decoding import Step

MASK_GLYPH = "\u2591"  # light shade: a position still masked


def render_draft(tokenizer: Any, step: Step, mask_id: Optional[int]) -> str:
    """Row 0's generated region: runs of tokens decoded together, masks as a glyph."""
    pieces: List[str] = []
    run: List[int] = []
    for token in step.canvas[0, step.prompt_len :].tolist():
        if token == mask_id:
            if run:
                pieces.append(tokenizer.decode(run))
                run = []
            pieces.append(MASK_GLYPH)
        else:
            run.append(int(token))
    if run:
        pieces.append(tokenizer.decode(run))
    return "".join(pieces)


def draft_frame(tokenizer: Any, step: Step, mask_id: Optional[int], texts: Dict[int, str]) -> dict:
    """One forward's frame of row 0, as the studio page and any client draw it:
    `forwards`, `committed` (generated tokens final), `text` (render_draft), and per
    generated position its token's text (`tokens`, null: still masked) and `states`, one
    letter each: m masked, d draft (a uniform canvas's argmax, or a speculative decoder's
    guesses: self-speculation, I-DLM; not committed), c committed;
    `block`: the current block's [start, end) among the generated positions, and
    `confidence`: each of its positions' confidence at commit (0: not yet). With LLaDA2.2's
    structural edits, `inserted` (the generated positions of the masks a SPLIT put in) and
    `deleted` (how many positions a DELETE dropped) this forward; on a uniform canvas
    (DiffusionGemma), `accepted`: the generated positions whose drawn token the step kept (the
    others are noised again; with a mask schedule, the positions committed so far). With the
    engine's proposals (Engine(proposals=k)), `proposals`: per position of the forward, the
    model's k most likely tokens and their probabilities, [position, [[text, p], ...]]. `texts` caches each token
    id's text across a decode's frames."""
    row = step.canvas[0, step.prompt_len :].tolist()
    final = int(step.final[0])
    tokens, states = [], []
    for i, token in enumerate(row):
        if token == mask_id:
            tokens.append(None)
            states.append("m")
            continue
        if token not in texts:
            texts[token] = tokenizer.decode([int(token)])
        tokens.append(texts[token])
        drafted = step.drafted is not None and step.drafted[0] <= step.prompt_len + i < step.drafted[1]
        states.append("d" if drafted or (mask_id is None and i >= final) else "c")
    start, end = (b - step.prompt_len for b in step.block)
    confidence = [] if step.block_confidence is None else np.asarray(step.block_confidence[0], dtype=np.float64)
    frame = {
        "forwards": int(step.forwards),
        "committed": final,
        "text": render_draft(tokenizer, step, mask_id),
        "tokens": tokens,
        "states": "".join(states),
        "block": [max(start, 0), max(end, 0)],
        "confidence": [round(float(c), 4) for c in np.clip(confidence, 0.0, 1.0)],
    }
    if step.proposals is not None:  # (the studio's hover: what the model hesitated between)
        positions, ids, probs = step.proposals
        frame["proposals"] = [
            [int(p) - step.prompt_len, [[_text(tokenizer, texts, int(t)), round(float(q), 4)] for t, q in zip(i, r)]]
            for p, i, r in zip(positions, ids, probs)
            if int(p) >= step.prompt_len
        ]
    if step.accepted is not None:  # (a uniform canvas: the positions whose draw the rule kept)
        offset = step.block[0] - step.prompt_len
        frame["accepted"] = [int(i) + offset for i in np.flatnonzero(step.accepted[0])]
    if step.edits is not None:
        offset = step.block[0] - step.prompt_len
        frame["inserted"] = [int(i) + offset for i in np.flatnonzero(step.edits.inserted[0])]
        frame["deleted"] = int(step.edits.deleted[0].sum())
    return frame


def _text(tokenizer: Any, texts: Dict[int, str], token: int) -> str:
    if token not in texts:
        texts[token] = tokenizer.decode([token])
    return texts[token]


class FrameRecorder:
    """A `draft_callback` keeping each forward's `draft_frame` of row 0 (`frames`), then
    calling `then` (another callback) if given."""

    def __init__(self, tokenizer: Any, mask_id: Optional[int], then: Any = None):
        self.tokenizer, self.mask_id, self.then = tokenizer, mask_id, then
        self.frames: List[dict] = []
        self._texts: Dict[int, str] = {}

    def __call__(self, step: Step) -> None:
        if step.ran_forward or not self.frames:
            self.frames.append(draft_frame(self.tokenizer, step, self.mask_id, self._texts))
        else:  # (a block-over event: the same forward, its tokens now final)
            self.frames[-1] = draft_frame(self.tokenizer, step, self.mask_id, self._texts)
        if self.then is not None:
            self.then(step)
