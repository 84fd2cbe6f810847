"""What the server writes back beyond mlx_lm.server's shapes: JSON-safe numbers and the
draft frames of a stream's SSE comments."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import numpy as np

from mlx_lm_diffusion.cli.canvas_view import MASK_GLYPH
from mlx_lm_diffusion.decoding.engine import Step


def json_safe(value: Any) -> Any:
    """`value` with no number JSON cannot carry: -inf (a log-probability of an excluded
    token) becomes -9999.0 as in OpenAI's answers, NaN and +inf become null."""
    if isinstance(value, float):
        if math.isnan(value) or value == math.inf:
            return None
        return -9999.0 if value == -math.inf else value
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


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
    `deleted` (how many positions a DELETE dropped) this forward. `texts` caches each token
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
    if step.edits is not None:
        offset = step.block[0] - step.prompt_len
        frame["inserted"] = [int(i) + offset for i in np.flatnonzero(step.edits.inserted[0])]
        frame["deleted"] = int(step.edits.deleted[0].sum())
    return frame
