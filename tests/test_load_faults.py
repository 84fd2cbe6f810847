"""A checkpoint whose config.json contradicts its weights is refused at load (issue 33,
item 11): it used to load and decode nonsense (a mask id outside the vocabulary)."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_run import run_main

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.demo import DEMO_MODEL_PATH


@pytest.fixture
def broken(tmp_path):
    path = tmp_path / "broken"
    shutil.copytree(DEMO_MODEL_PATH, path)
    config = json.loads((path / "config.json").read_text())
    config["mask_token_id"] = 99  # the weights hold 16 tokens
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_mask_id_outside_the_weights_vocabulary_is_refused(broken):
    with pytest.raises(ValueError, match=r"mask_token_id \(99\) lies outside the vocabulary of the weights"):
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
