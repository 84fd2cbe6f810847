"""POST /v1/studio/render: the studio page's pictures drawn by the one renderer.

The page holds a decode's draft frames; its PNG, SVG, GIF and WebP buttons send them here and
get back the unmask-order picture (output.unmask_order.draw, as the generate CLI's --trace-png
and the protocol's picture: axes, labels, a colour bar, a title naming the model and the
settings) or the animation (output.animation, as --trace-anim). Bounded: at most MAX_FRAMES
frames of at most MAX_POSITIONS positions (a larger body is a 400, never a long render), and one
render at a time (matplotlib's pyplot is not thread-safe).
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

from mlx_lm_diffusion.serving.errors import RequestError

RENDER_PATH = "/v1/studio/render"
MAX_FRAMES, MAX_POSITIONS, MAX_TITLE = 4096, 8192, 200
TYPES = {"png": "image/png", "svg": "image/svg+xml", "gif": "image/gif", "webp": "image/webp"}
_lock = threading.Lock()


def render(body: Any) -> tuple:
    """(bytes, content type, file name) of the picture a render request asks for."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    kind = body.get("format")
    if kind not in TYPES:
        raise RequestError(f"format must be one of {', '.join(TYPES)}; got {kind!r}", param="format")
    frames = body.get("frames")
    if not isinstance(frames, list) or not frames or not all(isinstance(f, dict) for f in frames):
        raise RequestError("frames must be a non-empty list of draft frames", param="frames")
    if len(frames) > MAX_FRAMES:
        raise RequestError(f"at most {MAX_FRAMES} frames are drawn, got {len(frames)}", param="frames")
    for frame in frames:
        states, tokens = frame.get("states"), frame.get("tokens", [])
        if (
            not isinstance(states, str)
            or len(states) > MAX_POSITIONS
            or not isinstance(tokens, list)
            or len(tokens) > MAX_POSITIONS
            or not isinstance(frame.get("forwards"), int)
        ):
            raise RequestError(
                f"a frame needs forwards (an integer), states (at most {MAX_POSITIONS} letters) and tokens",
                param="frames",
            )
    title = body.get("title", "")
    if not isinstance(title, str):
        raise RequestError("title must be a string", param="title")
    title = title[:MAX_TITLE]
    try:
        with _lock, tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"decode.{kind}"
            if kind in ("png", "svg"):
                from mlx_lm_diffusion.output import unmask_order

                order = unmask_order.from_frames(frames)
                labels = [t if isinstance(t, str) else "" for t in frames[-1].get("tokens", [])][: len(order.forward)]
                unmask_order.draw(order, str(path), labels=labels, title=title)
            else:
                from mlx_lm_diffusion.output import animation

                animation.save_animation(frames, path, title=title)
            data = path.read_bytes()
    except ValueError as e:  # (a frame the renderer cannot read; matplotlib or Pillow missing)
        raise RequestError(str(e), param="frames") from None
    return data, TYPES[kind], f"decode.{kind}"
