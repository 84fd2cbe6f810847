"""A decode as an animation: the canvas after every forward (animated GIF or WebP with Pillow,
MP4 where ffmpeg is installed), from the frames of output.frames.

Each picture holds the generated positions in rows that wrap like text (32 to a row), each cell
a token: a still-masked position pale grey, a draft (a uniform canvas's guess, a speculative
decoder's draft) pale yellow with an amber edge, a committed token coloured by the forward that
committed it on viridis (colour-blind safe: dark early, yellow late) with its text, the tokens
this forward committed outlined, a token without text a middle dot. A title line names the decode and the forward. The picture is
at most MAX_SIDE pixels wide and tall (the positions the decode reached) and an animation at most MAX_FRAMES frames (a longer
decode keeps evenly spaced forwards, the first and the last among them); the last frame holds.
Pillow ships with matplotlib (the `plot` extra).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

MAX_FRAMES = 300
MAX_SIDE = 1600
COLUMNS = 32
CELL_W, CELL_H, PAD, HEADER = 40, 22, 6, 24
FRAME_MS, LAST_MS = 150, 2000
FORMATS = (".gif", ".webp", ".mp4")
# viridis at 9 evenly spaced stops (matplotlib's table), interpolated between
VIRIDIS = (
    (68, 1, 84),
    (71, 44, 122),
    (59, 81, 139),
    (44, 113, 142),
    (33, 144, 141),
    (39, 173, 129),
    (92, 200, 99),
    (170, 220, 50),
    (253, 231, 37),
)
MASKED, DRAFT_FILL, DRAFT_EDGE, GRID = (238, 238, 238), (255, 243, 205), (224, 160, 0), (200, 200, 200)


def viridis(x: float) -> tuple:
    x = min(max(x, 0.0), 1.0) * (len(VIRIDIS) - 1)
    i = min(int(x), len(VIRIDIS) - 2)
    f = x - i
    return tuple(round(a + (b - a) * f) for a, b in zip(VIRIDIS[i], VIRIDIS[i + 1]))


def committed_at(frames: Sequence[dict]) -> list:
    """Per generated position, the forward of the first frame showing it committed (0: never)."""
    width = max((len(f.get("states", "")) for f in frames), default=0)
    at = [0] * width
    for frame in frames:
        for i, s in enumerate(frame.get("states", "")):
            if s == "c" and not at[i]:
                at[i] = int(frame["forwards"])
    return at


def reached(frames: Sequence[dict]) -> int:
    """The positions a decode reached: up to the last one any frame shows unmasked (a decode that
    ended early leaves its later blocks out), at least one."""
    last = -1
    for frame in frames:
        unmasked = [i for i, s in enumerate(frame.get("states", "")) if s != "m"]
        last = max(last, unmasked[-1] if unmasked else -1)
    return max(last + 1, 1)


def chosen(frames: Sequence[dict], limit: int = MAX_FRAMES) -> list:
    """At most `limit` frames: all, or evenly spaced ones with the first and the last."""
    if len(frames) <= limit:
        return list(frames)
    step = (len(frames) - 1) / (limit - 1)
    return [frames[round(i * step)] for i in range(limit)]


def picture(frame: dict, first_commit: list, last_forward: int, title: str, width: int, previous: Optional[dict]):
    """One frame as a PIL image of the whole canvas (`width` positions)."""
    from PIL import Image, ImageDraw, ImageFont

    columns = max(1, min(COLUMNS, width))
    rows = max(1, -(-width // columns))
    scale = min(1.0, MAX_SIDE / (2 * PAD + columns * CELL_W), MAX_SIDE / (HEADER + 2 * PAD + rows * CELL_H))
    cw, ch = max(4, int(CELL_W * scale)), max(4, int(CELL_H * scale))
    image = Image.new("RGB", (2 * PAD + columns * cw, HEADER + 2 * PAD + rows * ch), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    draw.text((PAD, 4), f"{title}   forward {frame['forwards']} / {last_forward}".strip(), fill=(0, 0, 0), font=font)
    states, tokens = frame.get("states", ""), frame.get("tokens", [])
    before = previous.get("states", "") if previous else ""
    for i in range(width):
        x, y = PAD + (i % columns) * cw, HEADER + PAD + (i // columns) * ch
        box = (x, y, x + cw - 2, y + ch - 2)
        state = states[i] if i < len(states) else "m"
        if state == "c":
            fill = viridis((first_commit[i] - 1) / max(last_forward - 1, 1))
            new = i >= len(before) or before[i] != "c"
            draw.rectangle(box, fill=fill, outline=(0, 0, 0) if new else fill, width=2 if new else 1)
        elif state == "d":
            draw.rectangle(box, fill=DRAFT_FILL, outline=DRAFT_EDGE)
        else:
            draw.rectangle(box, fill=MASKED, outline=GRID)
            continue
        text = _cell_text(tokens[i] if i < len(tokens) else None, cw)
        if text and ch >= 12:
            light = state == "c" and sum(fill) < 3 * 140
            draw.text(
                (x + 2, y + max(1, (ch - 12) // 2)), text, fill=(255, 255, 255) if light else (0, 0, 0), font=font
            )
    return image


def _cell_text(token: Optional[str], cell_width: int) -> str:
    if token is None:
        return ""
    if token == "":
        return "\u00b7"  # (a committed token without text)
    text = token.replace("\n", "\u21b5").replace("\t", "\u21e5").replace(" ", "\u00b7")
    room = max(0, (cell_width - 4) // 6)  # (the default font: about 6 px a character)
    return text if len(text) <= room else text[: max(room - 1, 0)] + "\u2026"


def save_animation(frames: Sequence[dict], path: Any, title: str = "") -> int:
    """Write the frames' animation to `path` (.gif, .webp or .mp4); returns the frames written."""
    suffix = Path(str(path)).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"an animation is a {', '.join(FORMATS)} file; got {str(path)!r}")
    if not frames:
        raise ValueError("there is no frame to animate (the decode ran no forward)")
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ValueError("animations need Pillow: pip install 'mlx-lm-diffusion[plot]'") from None
    if suffix == ".mp4" and shutil.which("ffmpeg") is None:
        raise ValueError("an .mp4 needs ffmpeg on PATH; write a .gif or .webp instead")
    kept = chosen(frames)
    first = committed_at(frames)
    last = int(frames[-1]["forwards"])
    width = reached(frames)
    images = [picture(f, first, last, title, width, kept[k - 1] if k else None) for k, f in enumerate(kept)]
    durations = [FRAME_MS] * (len(images) - 1) + [LAST_MS]
    if suffix == ".mp4":
        _mp4(images, path)
    else:
        images[0].save(
            str(path),
            save_all=True,
            append_images=images[1:],
            duration=durations,
            loop=0,
            **({"lossless": True} if suffix == ".webp" else {}),
        )
    return len(images)


def _mp4(images: list, path: Any) -> None:
    """ffmpeg over the frames as PNGs (even sides: yuv420p needs them)."""
    with tempfile.TemporaryDirectory() as tmp:
        for k, image in enumerate(images):
            image.save(Path(tmp) / f"{k:05d}.png")
        done = subprocess.run(
            [
                "ffmpeg",
                "-y",
                "-loglevel",
                "error",
                "-framerate",
                str(1000 // FRAME_MS),
                "-i",
                str(Path(tmp) / "%05d.png"),
                "-vf",
                "pad=ceil(iw/2)*2:ceil(ih/2)*2",
                "-pix_fmt",
                "yuv420p",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise ValueError(f"ffmpeg could not write {path}: {done.stderr.strip()[-300:]}")
