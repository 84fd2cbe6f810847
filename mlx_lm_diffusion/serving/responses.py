"""What the server writes back beyond mlx_lm.server's shapes: JSON-safe numbers and the
draft frames of a stream's SSE comments (mlx_lm_diffusion.output.frames)."""

from __future__ import annotations

import math
from typing import Any

from mlx_lm_diffusion.output.frames import draft_frame, render_draft  # noqa: F401 (the server's frames)


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
