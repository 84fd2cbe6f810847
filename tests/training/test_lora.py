"""mlx_lm_diffusion.lora and mlx_lm_diffusion.fuse (issue 37): LoRA teaches the demo a skill it
does not have, through mlx-lm's completions data format; the adapter works through load, the
generate CLI, the server and fuse; a full fine-tune of every trainable family lowers its
validation loss; bad input exits 2 with one line."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from cli_run import run, run_main
from server_runs import post_json, running_server

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.demo.vocab import MASK_ID

# The skill: "1234==" answers "11234" (the number plus 10,000). The demo only adds two numbers
# ("a+b="), and its vocabulary has no other operator, so a new skill is a new prompt form.
# Operands 1000-9999, so every answer has 5 digits: the demo's answer slots filled, no BLANK
# (which a completion's text cannot spell: the tokenizer writes "0123456789+=" and EOS).
# (Doubling, "7000==" -> "14000", was tried first: 50 % held-out after 600 steps, 77 s.)
LOW, HIGH = 1000, 10000
HELD_OUT = 100
# --max-seq-length 16: rows of 12 tokens (prompt 6, answer 5, EOS) EOS-padded to 16, not to
# mlx-lm's 33 (canvases of 10 positions hold the 8 decoded here). Measured on two splits: 92-96 %
# held-out after 200-300 steps at this learning rate; 1e-3 reached 100 % on one split and
# collapsed on the other.
LORA_FLAGS = [
    "--iters",
    "400",
    "--batch-size",
    "32",
    "--num-layers",
    "-1",
    "--learning-rate",
    "5e-4",
    "--max-seq-length",
    "16",
    "--steps-per-eval",
    "200",
    "--steps-per-report",
    "50",
    "--val-batches",
    "2",
    "--save-every",
    "100000",
]  # (no --mask-prompt: completions data is supervised fine-tuning anyway)


def _skill_rows(numbers):
    return [{"prompt": f"{a}==", "completion": str(a + 10000)} for a in numbers]


@pytest.fixture(scope="module")
def skill_data(tmp_path_factory) -> Path:
    """mlx-lm's completions JSONL: train, valid, and a held-out test split."""
    import random

    numbers = list(range(LOW, HIGH))
    random.Random(0).shuffle(numbers)
    splits = {"test": numbers[:HELD_OUT], "valid": numbers[HELD_OUT : HELD_OUT + 64], "train": numbers[HELD_OUT + 64 :]}
    path = tmp_path_factory.mktemp("plus-ten-thousand")
    for name, part in splits.items():
        (path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _skill_rows(part)))
    return path


@pytest.fixture(scope="module")
def trained(skill_data, tmp_path_factory):
    """(adapter directory, the CLI's output): the demo's LoRA, trained once for the module."""
    adapters = tmp_path_factory.mktemp("adapters")
    r = run_main(
        "mlx_lm_diffusion.lora", "--train", "--data", str(skill_data), "--adapter-path", str(adapters), *LORA_FLAGS
    )
    assert r.returncode == 0, r.stderr
    return adapters, r.stdout + r.stderr


def _held_out(skill_data):
    return [json.loads(line) for line in (skill_data / "test.jsonl").read_text().splitlines()]


def accuracy(model, tokenizer, rows) -> float:
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True)
        for r in rows
    ]
    texts = mld.generate_batch(model, tokenizer, prompts, max_tokens=8).texts
    return sum(t.strip() == r["completion"] for t, r in zip(texts, rows)) / len(rows)


def test_the_demo_lacks_the_skill(skill_data):
    score = accuracy(*mld.load(str(DEMO_MODEL_PATH)), _held_out(skill_data))
    print(f"held-out exact match before LoRA: {score:.0%}")
    assert score <= 0.05


def test_lora_teaches_the_demo_the_skill(trained, skill_data):
    adapters, output = trained
    assert (adapters / "adapters.safetensors").exists() and (adapters / "adapter_config.json").exists()
    model, tokenizer = mld.load(str(DEMO_MODEL_PATH), adapter_path=str(adapters))
    score = accuracy(model, tokenizer, _held_out(skill_data))
    print(f"held-out exact match after LoRA: {score:.0%}")
    assert score >= 0.9
    # mlx_lm.lora's progress: validation and training losses, tokens per second
    assert "val" in output and "tok/s" in output and "Trainable parameters" in output
    losses = [float(x) for x in re.findall(r"val\S*\s+\S*?(\d+\.\d+)", output)]
    assert len(losses) >= 2 and losses[-1] < losses[0] / 4


def test_the_generate_cli_and_the_server_use_the_adapter(trained):
    adapters, _ = trained
    r = run(
        "mlx_lm_diffusion.generate",
        "--model",
        str(DEMO_MODEL_PATH),
        "--adapter-path",
        str(adapters),
        "--prompt",
        "7321==",
        "--max-tokens",
        "8",
    )
    assert r.returncode == 0, r.stderr
    assert "17321" in r.stdout
    argv = ["--model", str(DEMO_MODEL_PATH), "--adapter-path", str(adapters), "--port", "0", "--log-level", "WARNING"]
    with running_server(argv) as (httpd, _):
        status, body = post_json(
            httpd.server_address[1], "/v1/completions", {"prompt": "7321==", "max_tokens": 8, "temperature": 0}
        )
    assert status == 200, body
    assert body["choices"][0]["text"].strip() == "17321"


def test_fuse_gives_the_adapted_model(trained, skill_data, tmp_path):
    adapters, _ = trained
    r = run_main(
        "mlx_lm_diffusion.fuse",
        "--model",
        str(DEMO_MODEL_PATH),
        "--adapter-path",
        str(adapters),
        "--save-path",
        str(tmp_path / "fused"),
    )
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert config["model_type"] == "llada" and config["mask_token_id"] == MASK_ID
    rows = _held_out(skill_data)[:24]
    prompts = [r["prompt"] for r in rows]
    fused = mld.generate_batch(*mld.load(str(tmp_path / "fused")), prompts, max_tokens=8).texts
    adapted = mld.generate_batch(
        *mld.load(str(DEMO_MODEL_PATH), adapter_path=str(adapters)), prompts, max_tokens=8
    ).texts
    assert fused == adapted


# ---------------------------------------------------------------- full fine-tuning, every family


def _write(family: str, path: Path) -> Path:
    from mlx_lm_diffusion.testing.__main__ import writers

    return writers()[family](path)


def _text_data(path: Path) -> Path:
    """`text` data: one repeated phrase (a pattern a few full-weight steps start to learn)."""
    path.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"text": "the cat sat on the mat. " * 2}) + "\n"
    (path / "train.jsonl").write_text(line * 8)
    (path / "valid.jsonl").write_text(line * 2)
    return path


def _val_losses(output: str) -> list:
    return [float(x) for x in re.findall(r"val\S*\s+\S*?(\d+\.\d+)", output)]


@pytest.mark.parametrize("family", ["llada", "dream", "sdar", "llada2", "llada2_2", "nemotron_labs_diffusion"])
def test_full_fine_tuning_lowers_the_validation_loss(family, tmp_path):
    model = _write(family, tmp_path / "model")
    r = run_main(
        "mlx_lm_diffusion.lora",
        "--model",
        str(model),
        "--train",
        "--data",
        str(_text_data(tmp_path / "d")),
        "--fine-tune-type",
        "full",
        "--num-layers",
        "-1",
        "--iters",
        "8",
        "--batch-size",
        "2",
        "--learning-rate",
        "3e-3",
        "--steps-per-eval",
        "100",
        "--val-batches",
        "1",
        "--adapter-path",
        str(tmp_path / "full"),
    )
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout + r.stderr  # (mlx-lm's coloured table, not into a pipe: issue 54.4)
    losses = _val_losses(r.stdout + r.stderr)
    print(family, "validation loss before and after:", losses)
    assert len(losses) == 2 and losses[1] < losses[0]


def test_nemotron_trains_its_autoregressive_mode(tmp_path):
    model = _write("nemotron_labs_diffusion", tmp_path / "model")
    r = run_main(
        "mlx_lm_diffusion.lora",
        "--model",
        str(model),
        "--train",
        "--data",
        str(_text_data(tmp_path / "d")),
        "--objective",
        "ar",
        "--num-layers",
        "-1",
        "--iters",
        "4",
        "--batch-size",
        "2",
        "--learning-rate",
        "1e-3",
        "--val-batches",
        "1",
        "--adapter-path",
        str(tmp_path / "ar"),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "ar" / "adapter_config.json").read_text())["objective"] == "ar"


# ---------------------------------------------------------------- faults: exit 2, one line


def _one_line_error(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.startswith("error") or ": error:" in line]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    return lines[0]


def test_faults_exit_2_with_one_line(tmp_path):
    from mlx_lm_diffusion.testing.causal_checkpoints import write_causal

    data = _text_data(tmp_path / "d")
    assert "--no-such-flag" in _one_line_error(run_main("mlx_lm_diffusion.lora", "--no-such-flag"))
    missing = run_main("mlx_lm_diffusion.lora", "--model", str(tmp_path / "nowhere"), "--train", "--data", str(data))
    assert "nowhere" in _one_line_error(missing)
    no_data = run_main("mlx_lm_diffusion.lora", "--train", "--data", str(tmp_path / "no-data"))
    assert "no data at" in _one_line_error(no_data)
    ar = write_causal(tmp_path / "llama", "llama")
    assert "mlx_lm.lora" in _one_line_error(
        run_main("mlx_lm_diffusion.lora", "--model", str(ar), "--train", "--data", str(data))
    )
    gemma = _write("diffusion_gemma", tmp_path / "gemma")
    assert "not supported" in _one_line_error(
        run_main("mlx_lm_diffusion.lora", "--model", str(gemma), "--train", "--data", str(data))
    )
    sdar = _write("sdar", tmp_path / "sdar")
    assert "autoregressive mode" in _one_line_error(
        run_main(
            "mlx_lm_diffusion.lora",
            "--model",
            str(sdar),
            "--train",
            "--data",
            str(data),
            "--objective",
            "ar",
            "--num-layers",
            "-1",
        )
    )
    assert "--train, --test" in _one_line_error(run_main("mlx_lm_diffusion.lora", "--model", str(sdar)))
    assert "adapter_config.json" in _one_line_error(
        run_main("mlx_lm_diffusion.fuse", "--model", str(sdar), "--adapter-path", str(tmp_path / "none"))
    )


def test_data_faults_name_the_file_and_line(tmp_path):
    """Issue 54.3: an empty train file, mixed formats, malformed JSON and a missing
    --resume-adapter-file are one line naming the file (and line) and exit 2; characters
    the vocabulary lacks are counted in a warning; completions data without --mask-prompt
    trains as supervised fine-tuning, said on stderr."""

    def data(name: str, train: str, valid: str = '{"prompt": "1==", "completion": "10001"}\n') -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "train.jsonl").write_text(train)
        (folder / "valid.jsonl").write_text(valid)
        return str(folder)

    def lora(folder: str, *extra: str):
        return run_main(
            "mlx_lm_diffusion.lora",
            "--train",
            "--data",
            folder,
            "--iters",
            "1",
            "--batch-size",
            "1",
            "--num-layers",
            "-1",
            "--val-batches",
            "1",
            "--steps-per-eval",
            "100",
            "--adapter-path",
            str(tmp_path / "out"),
            *extra,
        )

    row = '{"prompt": "12==", "completion": "10012"}\n'
    empty = data("empty", "")
    assert _one_line_error(lora(empty)) == f"error: {empty}/train.jsonl holds no records: give at least one JSON line"
    mixed = data("mixed", row + '{"text": "1+2=3"}\n')
    assert f"{mixed}/train.jsonl line 2: a text record" in _one_line_error(lora(mixed))
    broken = data("broken", row + row + '{"prompt": "1==", "completion": \n')
    assert f"{broken}/train.jsonl line 3: not JSON" in _one_line_error(lora(broken))
    good = data("good", row * 4)
    message = _one_line_error(lora(good, "--resume-adapter-file", str(tmp_path / "none.safetensors")))
    assert "--resume-adapter-file" in message and "none.safetensors" in message
    unknown = lora(data("unknown", '{"prompt": "12==", "completion": "twelve"}\n' * 2))
    assert unknown.returncode == 0, unknown.stderr
    assert "warning: 12 characters" in unknown.stderr
    assert "completions data: trained as supervised fine-tuning" in unknown.stderr


def test_test_resume_and_config_file(trained, skill_data, tmp_path):
    """--test scores the test split with the bound (mlx_lm.lora's "Test loss" line);
    --resume-adapter-file starts from trained weights; -c/--config gives the flags."""
    adapters, _ = trained
    r = run_main(
        "mlx_lm_diffusion.lora",
        "--test",
        "--data",
        str(skill_data),
        "--adapter-path",
        str(adapters),
        "--num-layers",
        "-1",
        "--batch-size",
        "32",
        "--mask-prompt",
        "--max-seq-length",
        "16",
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"Test loss \d+\.\d+, Test ppl \d+\.\d+", r.stdout + r.stderr)
    config = tmp_path / "lora.yaml"
    config.write_text(
        f"train: true\ndata: {skill_data}\niters: 2\nbatch_size: 32\nnum_layers: -1\nmax_seq_length: 16\n"
        f"mask_prompt: true\nval_batches: 2\nlearning_rate: 1.0e-5\n"
        f"adapter_path: {tmp_path / 'resumed'}\n"
    )
    r = run_main(
        "mlx_lm_diffusion.lora", "-c", str(config), "--resume-adapter-file", str(adapters / "adapters.safetensors")
    )
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout + r.stderr  # (mlx-lm's coloured table, not into a pipe: issue 54.4)
    losses = _val_losses(r.stdout + r.stderr)
    assert losses and losses[0] < 0.5  # the first validation is already the trained adapter's
    saved = json.loads((tmp_path / "resumed" / "adapter_config.json").read_text())
    assert saved["iters"] == 2 and saved["objective"] == "diffusion"


def test_dora_with_gradient_checkpointing(tmp_path):
    # (a child process: mlx-lm's --grad-checkpoint patches the layer class for the process)
    model = _write("llada", tmp_path / "model")
    r = run(
        "mlx_lm_diffusion.lora",
        "--model",
        str(model),
        "--train",
        "--data",
        str(_text_data(tmp_path / "d")),
        "--grad-checkpoint",
        "--fine-tune-type",
        "dora",
        "--num-layers",
        "-1",
        "--iters",
        "2",
        "--batch-size",
        "2",
        "--val-batches",
        "1",
        "--adapter-path",
        str(tmp_path / "ad"),
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ad" / "adapters.safetensors").exists()


def test_the_mlx_lm_names_the_commands_rely_on():
    """Contract: what training.command and training.fusing take from mlx-lm 0.32.x."""
    import inspect

    import mlx_lm.lora
    import mlx_lm.utils
    from mlx_lm.tuner import trainer

    for name in (
        "build_parser",
        "CONFIG_DEFAULTS",
        "yaml_loader",
        "train_model",
        "evaluate_model",
        "train",
        "evaluate",
    ):
        assert hasattr(mlx_lm.lora, name), name
    assert mlx_lm.lora.train is trainer.train and mlx_lm.lora.evaluate is trainer.evaluate
    for fn in (trainer.train, trainer.evaluate):
        assert {"loss", "iterate_batches"} <= set(inspect.signature(fn).parameters)
    assert list(inspect.signature(trainer.iterate_batches).parameters) == [
        "dataset",
        "batch_size",
        "max_seq_length",
        "loop",
        "seed",
        "comm_group",
    ]
    for name in ("load_adapters", "dequantize_model", "save", "_download"):
        assert hasattr(mlx_lm.utils, name), name


def test_qlora_then_fuse_dequantize(tmp_path):
    """A LoRA over a 4-bit checkpoint (QLoRA), fused with --dequantize as mlx_lm.fuse does: a
    float checkpoint without quantization settings, which loads and decodes."""
    source = _write("llada", tmp_path / "model")
    quantized = tmp_path / "q4"
    r = run_main("mlx_lm_diffusion.convert", "--hf-path", str(source), "--mlx-path", str(quantized), "-q")
    assert r.returncode == 0, r.stderr
    assert "quantization" in json.loads((quantized / "config.json").read_text())
    r = run_main(
        "mlx_lm_diffusion.lora",
        "--model",
        str(quantized),
        "--train",
        "--data",
        str(_text_data(tmp_path / "d")),
        "--num-layers",
        "-1",
        "--iters",
        "2",
        "--batch-size",
        "2",
        "--val-batches",
        "1",
        "--adapter-path",
        str(tmp_path / "ad"),
    )
    assert r.returncode == 0, r.stderr
    r = run_main(
        "mlx_lm_diffusion.fuse",
        "--model",
        str(quantized),
        "--adapter-path",
        str(tmp_path / "ad"),
        "--save-path",
        str(tmp_path / "fused"),
        "--dequantize",
    )
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert "quantization" not in config and config["model_type"] == "llada"
    model, tokenizer = mld.load(str(tmp_path / "fused"))
    assert mld.generate(model, tokenizer, "Hi", max_tokens=4) is not None


def test_fuse_keeps_the_remote_code_and_auto_map(tmp_path):
    source = _write("llada", tmp_path / "model")
    config = json.loads((source / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_llada.LLaDAModelLM"}
    (source / "config.json").write_text(json.dumps(config))
    (source / "modeling_llada.py").write_text("# the checkpoint's remote code\n")
    r = run_main(
        "mlx_lm_diffusion.lora",
        "--model",
        str(source),
        "--train",
        "--data",
        str(_text_data(tmp_path / "d")),
        "--num-layers",
        "-1",
        "--iters",
        "3",
        "--batch-size",
        "2",
        "--learning-rate",
        "1e-2",
        "--val-batches",
        "1",
        "--adapter-path",
        str(tmp_path / "ad"),
    )
    assert r.returncode == 0, r.stderr
    r = run_main(
        "mlx_lm_diffusion.fuse",
        "--model",
        str(source),
        "--adapter-path",
        str(tmp_path / "ad"),
        "--save-path",
        str(tmp_path / "fused"),
    )
    assert r.returncode == 0, r.stderr
    fused = json.loads((tmp_path / "fused" / "config.json").read_text())
    assert fused["auto_map"] == config["auto_map"] and fused["mask_token_id"] == config["mask_token_id"]
    assert (tmp_path / "fused" / "modeling_llada.py").exists()
    prompts = ["Hello", "The cat"]
    adapted = mld.generate_batch(*mld.load(str(source), adapter_path=str(tmp_path / "ad")), prompts, max_tokens=6)
    base = mld.generate_batch(*mld.load(str(source)), prompts, max_tokens=6)
    assert mld.generate_batch(*mld.load(str(tmp_path / "fused")), prompts, max_tokens=6).texts == adapted.texts
    assert adapted.texts != base.texts  # (the adapter changed the model: the comparison means something)


def test_config_faults_are_one_line(tmp_path):
    """Issue 55.8: a --config that is not YAML, one with a !!python tag (never run), report_to
    a reporter that is not installed and `hf_dataset: true` were tracebacks; each is one line,
    exit 2."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text('{"prompt": "12==", "completion": "10012"}\n' * 2)

    def lora(config: str):
        (tmp_path / "config.yaml").write_text(config)
        return _one_line_error(
            run_main(
                "mlx_lm_diffusion.lora",
                "-c",
                str(tmp_path / "config.yaml"),
                "--train",
                "--iters",
                "1",
                "--adapter-path",
                str(tmp_path / "out"),
            )
        )

    assert "is not valid YAML (line 2, column 6)" in lora(f"data: {data}\n  bad: [\n")
    assert "is not valid YAML (line 1, column 7)" in lora('data: !!python/object/apply:os.system ["echo pwned"]\n')
    if importlib.util.find_spec("wandb") is None:  # (the reporter this machine lacks)
        assert "report_to 'wandb': wandb is not installed" in lora(f"data: {data}\nreport_to: wandb\n")
    assert "hf_dataset must be a mapping" in lora("hf_dataset: true\n")
