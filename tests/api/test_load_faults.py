"""A checkpoint whose config.json contradicts its weights is refused at load (issue 33,
item 11): it used to load and decode nonsense (a mask id outside the vocabulary)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from cli_run import run_main

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.demo.vocab import MASK_ID, VOCAB_SIZE


@pytest.fixture
def broken(tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(DEMO_MODEL_PATH, path)
    config = json.loads((path / "config.json").read_text())
    config["mask_token_id"] = 99  # the weights hold VOCAB_SIZE tokens
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_mask_id_outside_the_weights_vocabulary_is_refused(broken):
    with pytest.raises(
        ValueError, match=r"mask_token_id \(99\) lies outside (the vocabulary of the weights|its vocab_size)"
    ):
        mld.load(str(broken))
    r = run_main("mlx_lm_diffusion.generate", "--model", str(broken), "--prompt", "357+468=")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "mask_token_id (99)" in r.stderr


def test_after_install_stock_mlx_lm_load_refuses_it_too(broken):
    import mlx_lm

    mld.install()
    try:
        with pytest.raises(ValueError, match="mask_token_id"):
            mlx_lm.load(str(broken))
    finally:
        mld.uninstall()


def test_the_demo_itself_loads():
    model, _ = mld.load(str(DEMO_MODEL_PATH))
    assert model.args.mask_token_id < model.vocab_size


def _config(change: dict):
    def edit(path):
        for name in ("config.json", "generation_config.json"):  # (mlx-lm reads the EOS ids of both)
            config = json.loads((path / name).read_text())
            (path / name).write_text(
                json.dumps({**config, **{k: v for k, v in change.items() if name == "config.json" or k in config}})
            )

    return edit


def _weights(data: bytes):
    def edit(path):
        (path / "model.safetensors").write_bytes(data(path) if callable(data) else data)

    return edit


BROKEN = {
    "truncated weights": (_weights(lambda p: (p / "model.safetensors").read_bytes()[:5000]), "cannot be loaded"),
    "empty weights": (_weights(b""), "cannot be loaded"),
    "weights that are not safetensors": (_weights(b"x" * 4096), "cannot be loaded"),
    "a config that is a list": (lambda p: (p / "config.json").write_text("[]"), "must hold a JSON object"),
    "an EOS id outside the vocabulary": (_config({"eos_token_id": 999}), "eos_token_id (999) lies outside"),
    "no attention heads": (_config({"n_heads": 0}), "must be positive"),
    "a rope_theta that is a string": (_config({"rope_theta": "abc"}), "rope_theta must be a number"),
    "a rope_theta of zero": (_config({"rope_theta": 0}), "rope_theta must be positive"),  # (decoded NaN rotations)
    # (these two loaded: LLaDA's model is built from embedding_size, and vocab_size went unread)
    "a vocab_size past the embedding": (
        _config({"vocab_size": VOCAB_SIZE + 1}),
        f"vocab_size ({VOCAB_SIZE + 1}) exceeds its embedding_size",
    ),
    "a mask id past the vocab_size": (
        _config({"vocab_size": 7}),
        f"mask_token_id ({MASK_ID}) lies outside its vocab_size (7)",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_every_broken_checkpoint_is_one_line_and_exit_2(tmp_path, case):
    """These printed a traceback and exited 1 (or loaded and decoded: the EOS id), from
    every door that loads: the API, generate, chat and convert."""
    edit, message = BROKEN[case]
    path = tmp_path / "broken"
    shutil.copytree(DEMO_MODEL_PATH, path)
    edit(path)
    with pytest.raises(ValueError, match=re.escape(message)):
        mld.load(str(path))
    for door, args in (
        ("mlx_lm_diffusion.generate", ["--model", str(path), "--prompt", "1+2="]),
        ("mlx_lm_diffusion.chat", ["--model", str(path)]),
        ("mlx_lm_diffusion.convert", ["--hf-path", str(path), "--mlx-path", str(tmp_path / "out")]),
    ):
        r = run_main(door, *args)
        lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(lines) == 1 and message in lines[0], (door, r.stderr[-500:])
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_images_without_the_vision_extra_name_the_extra(monkeypatch, tmp_path):
    """--image without mlx-vlm failed deep inside the load; it now says which extra to install."""
    import sys

    monkeypatch.setitem(sys.modules, "mlx_vlm", None)  # (an import of it raises ImportError)
    picture = tmp_path / "p.png"
    picture.write_bytes(b"\x89PNG\r\n\x1a\n")
    r = run_main(
        "mlx_lm_diffusion.generate", "--model", str(DEMO_MODEL_PATH), "--prompt", "1+2=", "--image", str(picture)
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert 'pip install -e ".[vision]"' in r.stderr and "mlx_vlm" in r.stderr


def test_the_extras_install_from_a_clone():
    from pathlib import Path

    import tomllib

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert {"constraints", "vision", "eval", "test", "all"} <= set(extras)
    assert extras["all"] == ["mlx-lm-diffusion[constraints,vision,bench,eval,plot]"]


def test_nan_weights_are_said_at_load(tmp_path, capsys):
    """Issue 55.8: a checkpoint with NaN weights loaded and served noise with no word; the
    load now says how many tensors are not finite (and a clean one says nothing)."""
    from safetensors.numpy import load_file, save_file

    from mlx_lm_diffusion.testing.checkpoints import write_llada

    path = write_llada(tmp_path / "nan")
    mld.load(str(path))
    assert "NaN" not in capsys.readouterr().err
    weights = load_file(str(path / "model.safetensors"))
    name = next(k for k in weights if k.endswith("ff_out.weight"))
    weights[name][0, 0] = float("nan")
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    mld.load(str(path))
    err = capsys.readouterr().err
    assert "NaN or infinite values in 1 weight tensor(s)" in err and str(path) in err


def test_a_fifo_for_weights_or_adapters_is_refused_not_waited_on(tmp_path):
    """Issue 55.8: a FIFO named model.safetensors (or an adapter file) hung every door; it is
    a ValueError at load, and the generate CLI's one line with exit 2."""
    import os

    from mlx_lm_diffusion.testing.checkpoints import write_llada

    path = write_llada(tmp_path / "fifo")
    (path / "model.safetensors").unlink()
    os.mkfifo(path / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors is not a regular file"):
        mld.load(str(path))
    done = run_main("mlx_lm_diffusion.generate", "--model", str(path), "--prompt", "hi")
    assert done.returncode == 2 and "not a regular file" in done.stderr
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    os.mkfifo(adapters / "adapter_config.json")
    with pytest.raises(ValueError, match="adapter_config.json is not a regular file"):
        mld.load(str(DEMO_MODEL_PATH), adapter_path=str(adapters))
