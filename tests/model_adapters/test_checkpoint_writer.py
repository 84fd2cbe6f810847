"""`python -m mlx_lm_diffusion.testing OUT_DIR` writes a tiny random checkpoint of every
family in its released layout (issue 35, item 2): each loads and answers through the
generate CLI, offline; the tests' own fixtures are these writers."""

from __future__ import annotations

import json

from cli_run import run, run_main

from mlx_lm_diffusion.testing.__main__ import writers

FAMILY_TYPES = {
    "llada": "llada",
    "dream": "Dream",
    "sdar": "sdar",
    "idlm": "sdar",
    "trida": "qwen3_5_text",
    "lfm2_diffusion": "lfm2_diffusion",
    "llada2": "llada2_moe",
    "llada2_2": "llada2_moe",
    "nemotron_labs_diffusion": "nemotron_labs_diffusion",
    "diffusion_gemma": "diffusion_gemma",
    "diffusion_gemma_vision": "diffusion_gemma",
}


def test_the_command_writes_every_family_and_each_one_answers(tmp_path):
    out = tmp_path / "checkpoints"
    done = run("mlx_lm_diffusion.testing", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(writers()) == sorted(FAMILY_TYPES)
    for family, model_type in FAMILY_TYPES.items():
        config = json.loads((out / family / "config.json").read_text())
        assert config["model_type"] == model_type and "architectures" in config
        r = run_main(
            "mlx_lm_diffusion.generate",
            "--model",
            str(out / family),
            "--prompt",
            "Hello",
            "--max-tokens",
            "4",
            "--ignore-chat-template",
        )
        assert r.returncode == 0, (family, r.stderr[-1000:])
    assert (out / "diffusion_gemma_vision" / "processor_config.json").exists() or any(
        (out / "diffusion_gemma_vision").glob("preprocessor_config.json")
    )


def test_it_refuses_to_write_over_a_directory(tmp_path):
    (tmp_path / "llada").mkdir()
    r = run_main("mlx_lm_diffusion.testing.__main__", str(tmp_path), "--families", "llada")
    assert r.returncode == 2 and "exists" in r.stderr
    # --skip-existing keeps it (the docs' pages share checkpoints/) and writes the others
    r = run_main("mlx_lm_diffusion.testing.__main__", str(tmp_path), "--families", "llada", "sdar", "--skip-existing")
    assert r.returncode == 0 and r.stdout.split() == [str(tmp_path / "llada"), str(tmp_path / "sdar")]
    assert not any((tmp_path / "llada").iterdir()) and (tmp_path / "sdar" / "config.json").exists()
