"""Pictures of a decode (issue 56.4): the animation (output.animation: one frame per forward,
bounded in frames and size, GIF and WebP that Pillow decodes; MP4 only with ffmpeg), the
unmask-order picture from draft frames (output.unmask_order.from_frames: the same order as the
recorder's, axes and a bounded size for long canvases) and the generate CLI's --trace-anim."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from cli_run import run_main
from PIL import Image

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.output import animation, unmask_order
from mlx_lm_diffusion.output.frames import FrameRecorder
from model_adapters import adapter_for


@pytest.fixture(scope="module")
def demo_decode():
    """The demo's decode of one problem, recorded as frames and as an unmask order."""
    model, tokenizer = mld.load(str(DEMO_MODEL_PATH))
    mask_id = adapter_for(model, tokenizer).mask_id
    order = unmask_order.OrderRecorder(mask_id)
    frames = FrameRecorder(tokenizer, mask_id, then=order)
    last = None
    for last in mld.stream_generate(model, tokenizer, "357+468=", draft_callback=frames):
        pass
    return frames.frames, order, last.forwards


def _frames_of(path) -> list:
    image = Image.open(path)
    out = []
    for k in range(image.n_frames):
        image.seek(k)
        out.append(image.convert("RGB"))
    return out


@pytest.mark.parametrize("suffix", [".gif", ".webp"])
def test_the_animation_has_one_frame_per_forward(demo_decode, tmp_path, suffix):
    frames, _, forwards = demo_decode
    assert len(frames) == forwards
    written = animation.save_animation(frames, tmp_path / f"decode{suffix}", title="demo")
    pictures = _frames_of(tmp_path / f"decode{suffix}")
    assert written == len(pictures) == forwards
    assert all(p.size == pictures[0].size and max(p.size) <= animation.MAX_SIDE for p in pictures)
    # (each forward commits something: consecutive pictures differ)
    assert all(np.any(np.asarray(a) != np.asarray(b)) for a, b in zip(pictures, pictures[1:]))


def test_a_long_decode_is_bounded_in_frames_and_size(tmp_path):
    """512 positions over 600 forwards: MAX_FRAMES pictures (the first and the last kept), each
    within MAX_SIDE pixels."""
    n, forwards = 512, 600
    frames = [
        {
            "forwards": k + 1,
            "states": "c" * min(k + 1, n) + "m" * max(n - k - 1, 0),
            "tokens": [f"t{i}" if i <= k else None for i in range(n)],
        }
        for k in range(forwards)
    ]
    written = animation.save_animation(frames, tmp_path / "long.gif")
    pictures = _frames_of(tmp_path / "long.gif")
    assert written == len(pictures) == animation.MAX_FRAMES
    assert max(pictures[0].size) <= animation.MAX_SIDE
    assert animation.chosen(frames)[0] is frames[0] and animation.chosen(frames)[-1] is frames[-1]


def test_bad_requests_are_one_line_errors(demo_decode, tmp_path):
    frames, _, _ = demo_decode
    with pytest.raises(ValueError, match="animation is a .gif, .webp, .mp4 file"):
        animation.save_animation(frames, tmp_path / "x.avi")
    with pytest.raises(ValueError, match="no frame"):
        animation.save_animation([], tmp_path / "x.gif")
    if shutil.which("ffmpeg") is None:
        with pytest.raises(ValueError, match="needs ffmpeg"):
            animation.save_animation(frames, tmp_path / "x.mp4")


def test_the_order_of_the_frames_is_the_recorders(demo_decode):
    frames, order, _ = demo_decode
    recorded = order.order(order.committed_span())
    from_frames = unmask_order.from_frames(frames)
    n = len(recorded.forward)
    assert from_frames.forward[:n].tolist() == recorded.forward.tolist()
    assert from_frames.forwards == recorded.forwards
    with pytest.raises(ValueError, match="draft frame"):
        unmask_order.from_frames([{"states": "c"}])


def test_the_picture_of_a_long_canvas_has_axes_and_a_bounded_size(tmp_path):
    """512 positions over 64 forwards: at most 2000 px, and text in the margins (the axes)."""
    n = 512
    frames = [
        {
            "forwards": k + 1,
            "states": "c" * (8 * (k + 1)) + "m" * (n - 8 * (k + 1)),
            "block": [0, n],
            "confidence": [0.5] * n,
        }
        for k in range(64)
    ]
    unmask_order.draw(unmask_order.from_frames(frames), str(tmp_path / "order.png"), title="a long canvas")
    image = np.asarray(Image.open(tmp_path / "order.png").convert("L"))
    assert max(image.shape) <= 2000
    left, bottom = image[:, : image.shape[1] // 12], image[-image.shape[0] // 10 :, :]
    assert (left < 128).any() and (bottom < 128).any()  # (tick labels and axis titles are dark)


def test_the_generate_cli_writes_the_animation(tmp_path):
    out = tmp_path / "demo.gif"
    r = run_main("mlx_lm_diffusion.generate", "--prompt", "357+468=", "--trace-anim", str(out), "--verbose", "True")
    assert r.returncode == 0, r.stderr
    forwards = int(r.stdout.split(" forwards")[0].rsplit(" ", 1)[1])
    assert len(_frames_of(out)) == forwards
    bad = run_main("mlx_lm_diffusion.generate", "--prompt", "1+1=", "--trace-anim", str(tmp_path / "x.txt"))
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--trace-anim" in bad.stderr


# -- what the model hesitated between (Engine(proposals=k), the studio's hover)


def test_each_forward_carries_the_top_proposals_alone_and_in_a_batch():
    """Engine(proposals=5): each forward's Step holds, per position it predicted, the 5 most
    likely tokens with their probabilities (descending, at most 1 together); a running batch's
    row carries the same; the frames name them with their text."""
    from mlx_lm_diffusion.decoding.batch import RunningBatch
    from mlx_lm_diffusion.decoding.engine import Engine
    from mlx_lm_diffusion.decoding.options import DecodeOptions, resolve
    from mlx_lm_diffusion.output.frames import draft_frame

    model, tokenizer = mld.load(str(DEMO_MODEL_PATH))
    adapter = adapter_for(model, tokenizer)
    prompt = tokenizer.encode("357+468=")
    options = resolve(DecodeOptions(max_tokens=16, block_length=8), adapter, len(prompt))
    alone = [s for s in Engine(adapter, options, proposals=5).run(mx.array([prompt])) if s.ran_forward]
    assert alone and all(s.proposals is not None for s in alone)
    for step in alone:
        positions, ids, probs = step.proposals
        assert ids.shape == probs.shape == (len(positions), 5)
        assert all(step.block[0] <= p < step.block[1] for p in positions)
        assert (np.diff(probs, axis=1) <= 1e-7).all() and (probs.sum(axis=1) <= 1 + 1e-5).all()
    frame = draft_frame(tokenizer, alone[0], adapter.mask_id, {})
    assert len(frame["proposals"]) == len(alone[0].proposals[0])
    assert all(
        len(top) == 5 and all(isinstance(t, str) and 0 <= p <= 1 for t, p in top) for _, top in frame["proposals"]
    )
    batch = RunningBatch(adapter)
    batch.add(prompt, options, proposals=5)
    batched = []
    while batch.rows:
        batched += [e.step for e in batch.step() if e.step is not None and e.step.ran_forward]
    assert len(batched) == len(alone) and all(s.proposals is not None for s in batched)
    # (the first forward reads the whole block on both: the same top proposal everywhere; later a
    # single decode reads only its masked positions, a batch row the whole block)
    assert alone[0].proposals[0].tolist() == batched[0].proposals[0].tolist()
    assert (alone[0].proposals[1][:, 0] == batched[0].proposals[1][:, 0]).all()
    for step in batched:
        assert all(step.block[0] <= p < step.block[1] for p in step.proposals[0])
    assert Engine(adapter, options).proposals == 0  # (none unless asked)
