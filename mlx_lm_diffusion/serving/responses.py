"""What the server writes back beyond mlx_lm.server's shapes: JSON-safe numbers and the
draft canvas of a stream's SSE comments."""

from __future__ import annotations

import math
from typing import Any, List, Optional

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
