"""`mlx_lm_diffusion.fuse` and `mlx_lm_diffusion.convert` on a full disk (issue 55.8): one line, exit 2, nothing
half-written.

Before (a 200 KiB, 452 KiB and 460 KiB tmpfs under --save-path, measured): MLX's traceback
("[write] Unable to write 11099 bytes to file") beside a truncated model.safetensors; the
tokenizers library's traceback ("No space left on device (os error 28)") beside the weights,
the config and an empty tokenizer.json; or one line with all of those left behind. The full
disk is simulated here where each of those failed (mlx_lm.utils.save's steps); the files a
step had written are written first.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import mlx_lm.utils
import pytest
from cli_run import run_main

from mlx_lm_diffusion.api.checkpoint_dir import written_whole


@pytest.fixture(scope="module")
def adapted(tmp_path_factory) -> tuple:
    """(a tiny LLaDA checkpoint, a LoRA adapter for it after two steps)."""
    from mlx_lm_diffusion.testing.__main__ import writers

    root = tmp_path_factory.mktemp("fuse-faults")
    model = writers()["llada"](root / "model")
    data = root / "data"
    data.mkdir()
    line = json.dumps({"text": "the cat sat on the mat. " * 2}) + "\n"
    (data / "train.jsonl").write_text(line * 8)
    (data / "valid.jsonl").write_text(line * 2)
    r = run_main(
        "mlx_lm_diffusion.lora",
        "--model",
        str(model),
        "--train",
        "--data",
        str(data),
        "--num-layers",
        "-1",
        "--iters",
        "2",
        "--batch-size",
        "2",
        "--val-batches",
        "1",
        "--adapter-path",
        str(root / "adapters"),
    )
    assert r.returncode == 0, r.stderr
    return model, root / "adapters"


def _truncated_weights(dst_path, *args, **kwargs):
    Path(dst_path).mkdir(parents=True, exist_ok=True)  # (as mlx_lm.utils.save_model does)
    (Path(dst_path) / "model.safetensors").write_bytes(b"\0" * 4096)
    raise RuntimeError("[write] Unable to write 11099 bytes to file.")  # (MLX's words)


def _weights_then_no_space(dst_path, *args, **kwargs):
    Path(dst_path).mkdir(parents=True, exist_ok=True)
    (Path(dst_path) / "model.safetensors").write_bytes(b"\0" * 4096)
    raise OSError(errno.ENOSPC, "No space left on device")


def _everything_but_the_card(path, hf_path):
    (Path(path) / "README.md").write_bytes(b"")
    raise Exception("No space left on device (os error 28)")  # (the tokenizers library's words)


FAILURES = {
    "weights, MLX": ("save_model", _truncated_weights),
    "weights, OSError": ("save_model", _weights_then_no_space),
    "last file": ("create_model_card", _everything_but_the_card),
}


def _leftovers(parent: Path) -> list:
    return sorted(p.name for p in parent.iterdir())


@pytest.mark.parametrize("failure", list(FAILURES))
def test_fuse_on_a_full_disk_says_one_line_and_leaves_nothing(failure, adapted, tmp_path, monkeypatch):
    model, adapters = adapted
    name, fail = FAILURES[failure]
    monkeypatch.setattr(mlx_lm.utils, name, fail)
    out = tmp_path / "out"
    out.mkdir()
    r = run_main(
        "mlx_lm_diffusion.fuse",
        "--model",
        str(model),
        "--adapter-path",
        str(adapters),
        "--save-path",
        str(out / "fused"),
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write {out / 'fused'}: "), r.stderr
    if failure != "weights, MLX":  # (MLX's words do not say why; a disk that is not full here)
        assert "No space left on device" in lines[0]
    assert _leftovers(out) == []  # (no fused/, no partial directory beside it)


def test_a_failed_fuse_leaves_an_existing_save_path_as_it_was_and_a_fuse_replaces_its_files(
    adapted, tmp_path, monkeypatch
):
    model, adapters = adapted
    target = tmp_path / "fused"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "notes.txt").write_text("mine")
    with monkeypatch.context() as m:
        m.setattr(mlx_lm.utils, "create_model_card", _everything_but_the_card)
        r = run_main(
            "mlx_lm_diffusion.fuse", "--model", str(model), "--adapter-path", str(adapters), "--save-path", str(target)
        )
        assert r.returncode == 2, r.stderr
    assert _leftovers(tmp_path) == ["fused"] and _leftovers(target) == ["config.json", "notes.txt"]
    assert (target / "config.json").read_text() == "{}"
    r = run_main(
        "mlx_lm_diffusion.fuse", "--model", str(model), "--adapter-path", str(adapters), "--save-path", str(target)
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((target / "config.json").read_text())["model_type"] == "llada"
    assert (target / "notes.txt").read_text() == "mine" and (target / "model.safetensors").exists()
    assert _leftovers(tmp_path) == ["fused"]


def test_written_whole_passes_other_errors_on_and_cleans_up(tmp_path):
    with pytest.raises(KeyError):
        with written_whole(tmp_path / "out") as staging:
            (staging / "x").write_text("x")
            raise KeyError("not a write failure")
    assert _leftovers(tmp_path) == []
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        with written_whole(tmp_path / "file"):
            pass


@pytest.mark.parametrize("failure", list(FAILURES))
def test_convert_on_a_full_disk_says_one_line_and_leaves_nothing(failure, adapted, tmp_path, monkeypatch):
    """mlx_lm_diffusion.convert writes through the same steps (mlx_lm.utils.save): before, a full
    disk was blamed on loading the model ("the checkpoint ... cannot be loaded"), or ended in a
    traceback, beside the files written so far."""
    model, _ = adapted
    name, fail = FAILURES[failure]
    monkeypatch.setattr(mlx_lm.utils, name, fail)
    out = tmp_path / "out"
    out.mkdir()
    r = run_main("mlx_lm_diffusion.convert", "--hf-path", str(model), "--mlx-path", str(out / "converted"))
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if not line.startswith("[INFO]")]
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot write {out / 'converted'}: "), r.stderr
    assert "cannot be loaded" not in lines[0]
    assert _leftovers(out) == []
