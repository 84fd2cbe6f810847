"""The generate and convert CLIs: output, --show-canvas, and one-line errors with exit 2."""

import json

import pytest
from cli_run import run, run_main


def test_generate_prints_text_and_stats(llada_path):
    r = run(
        "mlx_lm_diffusion.generate",
        "--model",
        str(llada_path),
        "--prompt",
        "Hi",
        "--max-tokens",
        "8",
        "--block-length",
        "4",
        "--threshold",
        "0.5",
        "--editing-threshold",
        "0.3",
        "--max-post-steps",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "==========" in r.stdout and "forwards" in r.stdout
    assert "Traceback" not in r.stderr


def test_show_canvas_and_stdin_prompt(llada_path):
    r = run(
        "mlx_lm_diffusion.generate",
        "--model",
        str(llada_path),
        "--prompt",
        "-",
        "--max-tokens",
        "6",
        "--steps",
        "3",
        "--block-length",
        "6",
        "--show-canvas",
        "--ignore-chat-template",
        "--verbose",
        "False",
        stdin="Hello",
    )
    assert r.returncode == 0, r.stderr
    frames = [line for line in r.stderr.splitlines() if line.startswith("[forward ")]
    assert len(frames) == 3  # one frame per forward
    assert frames[0].count("\u2591") == 4 and "\u2591" not in frames[-1]  # 2 of 6 unmasked per step


@pytest.mark.parametrize(
    "flags,word",
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--block-length", "0"], "block_length"),
        (["--steps", "0"], "steps"),
        (["--threshold", "2"], "threshold"),
        (["--strategy", "bogus"], "strategy"),
        (["--schedule", "exponential"], "schedule"),
        (["--preset", "speed"], "preset"),
        (["--causal-context"], "causal_context"),
        (["--prompt", "<|mdm_mask|>", "--ignore-chat-template"], "mask token"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(llada_path, flags, word):
    r = run_main("mlx_lm_diffusion.generate", "--model", str(llada_path), *(["--prompt", "Hi"] + flags))
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and word in lines[0], r.stderr


def test_unsupported_model_and_missing_path(tmp_path, llada_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = run_main("mlx_lm_diffusion.generate", "--model", str(tmp_path), "--prompt", "Hi")
    assert r.returncode == 2 and "llada" in r.stderr and "Traceback" not in r.stderr
    r = run_main("mlx_lm_diffusion.convert", "--hf-path", str(llada_path), "--mlx-path", str(tmp_path))
    assert r.returncode == 2 and "exists" in r.stderr


def test_a_chat_template_that_does_not_render_is_one_line(tmp_path):
    """Issue 55.8: a checkpoint whose chat template has a syntax error gave a jinja2 traceback."""
    import shutil

    from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

    broken = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL_PATH, broken)
    config = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% if %}broken"}))
    r = run_main("mlx_lm_diffusion.generate", "--model", str(broken), "--prompt", "1+1=")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: the chat template cannot render this conversation")
    assert (
        run_main(
            "mlx_lm_diffusion.generate", "--model", str(broken), "--prompt", "1+1=", "--ignore-chat-template"
        ).returncode
        == 0
    )
