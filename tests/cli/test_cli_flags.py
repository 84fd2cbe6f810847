"""mlx-lm's flags on the CLIs (issue 12, parts 4 and 7): every mlx_lm.generate,
mlx_lm.chat and mlx_lm.convert flag is accepted and means the same; the ones that
cannot apply to a diffusion model are refused at start with one line (exit 2);
--show-canvas never shares a line with the answer."""

import contextlib
import importlib
import io
import json
import sys

import pytest
from pty_run import run_in_pty

from mlx_lm_diffusion import generate as _pkg_generate  # noqa: F401  (the function)
from mlx_lm_diffusion.cli import chat

cli = importlib.import_module("mlx_lm_diffusion.cli.generate")


def option_strings(parser):
    return {s for a in parser._actions for s in a.option_strings}


def run_generate(path, *flags, prompt="Hi"):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["--model", str(path), "--prompt", prompt, "--max-tokens", "12", *flags])
    return rc, out.getvalue(), err.getvalue()


def one_error_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    return lines[0]


# ----------------------------------------------------------------------------- generate


def test_generate_takes_every_mlx_lm_generate_flag():
    mlx_generate = importlib.import_module("mlx_lm.generate")
    assert option_strings(mlx_generate.setup_arg_parser()) <= option_strings(cli.setup_arg_parser())


@pytest.mark.parametrize(
    "flags",
    [
        ["--draft-model", "x"],
        ["--num-draft-tokens", "4"],
        ["--max-kv-size", "64"],
        ["--kv-bits", "4"],
        ["--kv-group-size", "32"],
        ["--quantized-kv-start", "0"],
        ["--prompt-cache-file", "cache.safetensors"],
        ["--prefill-step-size", "512"],
    ],
)
def test_flags_that_cannot_apply_are_refused_at_start(flags, tmp_path):
    # the model path does not exist: the refusal comes before any loading
    rc, out, err = run_generate(tmp_path / "never-loaded", *flags)
    assert rc == 2 and out == ""
    line = one_error_line(err)
    assert flags[0] in line and "does not apply to a diffusion model" in line


def test_sampling_flags_mean_what_they_mean_in_mlx_lm(llada_path):
    rc, greedy, _ = run_generate(llada_path, "--verbose", "False")
    assert rc == 0 and greedy.strip()
    # top-k 1 and min-p 1.0 leave only the most likely token: greedy at any temperature
    for flags in (["--top-k", "1"], ["--min-p", "1.0"]):
        rc, out, _ = run_generate(llada_path, "--verbose", "F", "--temp", "0.8", "--seed", "3", *flags)
        assert (rc, out) == (0, greedy), flags
    rc, hot, _ = run_generate(
        llada_path,
        "--verbose",
        "F",
        "--temp",
        "5",
        "--seed",
        "3",
        "--xtc-probability",
        "0.0",
        "--min-tokens-to-keep",
        "2",
    )
    assert rc == 0 and hot != greedy


def test_extra_eos_token_stops_there(llada_path):
    _, greedy, _ = run_generate(llada_path, "--verbose", "F")
    text = greedy.rstrip("\n")
    stop = next(c for c in text[1:] if c.isascii() and c.isprintable() and c != " ")
    rc, out, _ = run_generate(llada_path, "--verbose", "F", "--extra-eos-token", stop)
    assert rc == 0 and out.rstrip("\n") == text[: text.index(stop)]


def test_verbose_in_mlx_lm_form_and_bare(llada_path):
    rc, out, _ = run_generate(llada_path, "--verbose")
    assert rc == 0 and "==========" in out and "forwards" in out
    for value in ("True", "T"):
        assert "==========" in run_generate(llada_path, "--verbose", value)[1]
    for value in ("False", "F"):
        rc, out, _ = run_generate(llada_path, "--verbose", value)
        assert rc == 0 and "==========" not in out and out.strip()


def test_chat_template_flags(llada_path):
    rc, out, _ = run_generate(
        llada_path,
        "--verbose",
        "F",
        "--chat-template-config",
        '{"enable_thinking": false}',
        "--system-prompt",
        "Be brief.",
        "--prefill-response",
        "Sure",
    )
    assert rc == 0 and out.strip()
    rc, _, err = run_generate(llada_path, "--chat-template-config", "{not json")
    assert rc == 2 and "--chat-template-config" in one_error_line(err)
    rc, _, err = run_generate(llada_path, "--chat-template-config", "[1]")
    assert rc == 2 and "JSON object" in one_error_line(err)


def test_bad_model_is_one_line(tmp_path):
    rc, _, err = run_generate(tmp_path / "missing" / "model")
    line = one_error_line(err)
    assert rc == 2 and "does not exist" in line


# ----------------------------------------------------------------------------- chat


def test_chat_takes_every_mlx_lm_chat_flag():
    mlx_chat = importlib.import_module("mlx_lm.chat")
    assert option_strings(mlx_chat.setup_arg_parser()) <= option_strings(chat.setup_arg_parser())


@pytest.mark.parametrize("flags", [["--max-kv-size", "64"], ["--prefill-step-size", "128"], ["--pipeline"]])
def test_chat_refuses_flags_that_cannot_apply(flags, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        chat.main(["--model", str(tmp_path / "never-loaded"), *flags])
    assert e.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert flags[0] in line and "does not apply" in line


@pytest.mark.parametrize("model", ["/no/such/model", "./nope"])
def test_chat_bad_model_is_one_line_exit_2(model, capsys):
    with pytest.raises(SystemExit) as e:
        chat.main(["--model", model])
    assert e.value.code == 2
    assert "does not exist" in one_error_line(capsys.readouterr().err)


def test_chat_not_a_diffusion_model_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit) as e:
        chat.main(["--model", str(tmp_path)])
    assert e.value.code == 2
    one_error_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- convert


def test_convert_takes_every_mlx_lm_convert_flag():
    from mlx_lm.convert import configure_parser

    from mlx_lm_diffusion.cli.convert import setup_arg_parser

    assert option_strings(configure_parser()) <= option_strings(setup_arg_parser())


def _quantization(path):
    return json.loads((path / "config.json").read_text())["quantization"]


def test_convert_keeps_embeddings_and_head_at_8_bits(tmp_path, dream_path):
    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.cli.convert import main

    assert main(["--hf-path", str(dream_path), "--mlx-path", str(tmp_path / "q4"), "-q", "--q-bits", "4"]) == 0
    q = _quantization(tmp_path / "q4")
    assert q["bits"] == 4 and q["lm_head"]["bits"] == 8 and q["model.embed_tokens"]["bits"] == 8
    model, tok = mld.load(str(tmp_path / "q4"))
    assert (model.lm_head.bits, model.layers[0].self_attn.q_proj.bits) == (8, 4)
    assert isinstance(mld.generate(model, tok, "Hi", max_tokens=4), str)

    # overridable: uniform 4 bits
    assert main(["--hf-path", str(dream_path), "--mlx-path", str(tmp_path / "u4"), "-q", "--q-head-bits", "4"]) == 0
    q = _quantization(tmp_path / "u4")
    assert q["lm_head"]["bits"] == 4 and q["model.embed_tokens"]["bits"] == 4

    # mlx_lm.convert's --dequantize undoes it
    assert main(["--hf-path", str(tmp_path / "q4"), "--mlx-path", str(tmp_path / "dq"), "--dequantize"]) == 0
    assert "quantization" not in json.loads((tmp_path / "dq" / "config.json").read_text())
    model, _ = mld.load(str(tmp_path / "dq"))
    assert type(model.lm_head).__name__ == "Linear"


def test_llada_head_is_kept_too(tmp_path, llada_path):
    from mlx_lm_diffusion.cli.convert import convert

    convert(str(llada_path), str(tmp_path / "q"), quantize=True, q_bits=4, q_mode="affine")
    q = _quantization(tmp_path / "q")
    heads = {k: v["bits"] for k, v in q.items() if isinstance(v, dict)}
    assert heads and set(heads.values()) == {8}, q


@pytest.mark.parametrize(
    "flags,word",
    [
        (["-q", "-d"], "either"),
        (["-q", "--q-bits", "7"], "q_bits"),
        (["-q", "--q-head-bits", "7"], "q_head_bits"),
        (["--upload-repo", "me/model"], "HF_HUB_OFFLINE"),
    ],
)
def test_convert_errors_are_one_line(flags, word, tmp_path, llada_path, capsys, monkeypatch):
    from mlx_lm_diffusion.cli.convert import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["--hf-path", str(llada_path), "--mlx-path", str(tmp_path / "out"), *flags]) == 2
    assert word in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_convert_of_a_missing_local_path_says_so(tmp_path, capsys):
    from mlx_lm_diffusion.cli.convert import main

    assert main(["--hf-path", "./no-such-model", "--mlx-path", str(tmp_path / "out")]) == 2
    assert "no model at ./no-such-model" in one_error_line(capsys.readouterr().err)  # (not the Hub's repo-id rules)


# ----------------------------------------------------------------------------- argparse's own errors


def cli_mains():
    from mlx_lm_diffusion.cli import convert
    from mlx_lm_diffusion.serving import startup as server

    return {"generate": cli.main, "chat": chat.main, "convert": convert.main, "server": server.parse_args}


@pytest.mark.parametrize("cli_name", ["generate", "chat", "convert", "server"])
@pytest.mark.parametrize(
    "flags",
    [["--bogus"], ["--max-tokens", "abc"], ["--block-length", "abc"]],
    ids=["unknown flag", "bad value", "bad diffusion value"],
)
def test_argparse_errors_are_one_line_exit_2(cli_name, flags, capsys):
    """An unknown flag or a value of the wrong type: one line on stderr, exit 2 (argparse
    would print the whole usage, ~40 lines of mlx-lm's flags, first), nothing loaded."""
    if cli_name == "convert" and flags[0] != "--bogus":
        flags = ["--q-bits", "abc"]  # (convert has no decoding flags)
    with pytest.raises(SystemExit) as e:
        cli_mains()[cli_name]([*flags])
    assert e.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "error: " in lines[0] and "--help" in lines[0], captured.err
    assert flags[0].lstrip("-").split("-")[0] in lines[0]
    assert captured.out == ""


@pytest.mark.parametrize("cli_name", ["generate", "chat", "convert", "server"])
def test_help_is_still_the_whole_usage(cli_name, capsys):
    with pytest.raises(SystemExit) as e:
        cli_mains()[cli_name](["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--model" in out or cli_name == "convert"
    if cli_name in ("generate", "chat", "server"):  # (each falls back to the demo without --model)
        assert "the embedded demo model" in out


# ----------------------------------------------------------------------------- --show-canvas


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


class FakeStep:
    def __init__(self, tokens, forwards, prompt_len=1):
        import numpy as np

        self.canvas = np.array([[0] + tokens])
        self.prompt_len, self.forwards = prompt_len, forwards


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_canvas_on_a_terminal_is_one_line_redrawn_in_place():
    from mlx_lm_diffusion.cli.canvas_view import CLEAR_LINE, MASK_GLYPH, CanvasView

    out = FakeTTY()
    view = CanvasView(CharTokenizer(), mask_id=0, out=out)
    view(FakeStep([0, 0, 0], 1))
    view(FakeStep([ord("8"), 0, ord("\n")], 2))
    view(FakeStep([ord("8"), ord("2"), ord("5")], 3))
    assert "\n" not in out.getvalue()  # nothing but \r-redraws so far
    frames = out.getvalue().split(CLEAR_LINE)[1:]
    assert frames == [f"[forward 1] {MASK_GLYPH * 3}", f"[forward 2] 8{MASK_GLYPH}\u21b5", "[forward 3] 825"]
    view.close()
    view.close()
    assert out.getvalue().endswith("825\n") and out.getvalue().count("\n") == 1


def test_canvas_draws_a_token_without_text_as_a_dot():
    """The demo model's <blank> padding has no text: drawn, the canvas keeps its width."""
    from mlx_lm_diffusion.cli.canvas_view import EMPTY_GLYPH, MASK_GLYPH, CanvasView
    from mlx_lm_diffusion.demo import load_demo
    from mlx_lm_diffusion.demo.vocab import BLANK_ID, ID, MASK_ID

    _, tok = load_demo()
    view = CanvasView(tok, mask_id=MASK_ID, out=io.StringIO())
    frame = view.render(FakeStep([BLANK_ID, BLANK_ID, MASK_ID, ID["2"], ID["5"]], 1))
    assert frame == f"{EMPTY_GLYPH}{EMPTY_GLYPH}{MASK_GLYPH}25"


def test_canvas_off_a_terminal_is_one_line_per_forward():
    from mlx_lm_diffusion.cli.canvas_view import CanvasView

    out = io.StringIO()
    view = CanvasView(CharTokenizer(), mask_id=0, out=out)
    for i, tokens in enumerate(([0, 0], [ord("\n"), 0], [ord("a"), ord("b")]), 1):
        view(FakeStep(tokens, i))
    view.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(line.startswith(f"[forward {i}] ") for i, line in enumerate(lines, 1))
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_show_canvas_under_a_terminal_keeps_the_answer_off_the_canvas_line(llada_path):
    from mlx_lm_diffusion.cli.canvas_view import CLEAR_LINE

    code, out, _ = run_in_pty(
        [
            sys.executable,
            "-m",
            "mlx_lm_diffusion.generate",
            "--model",
            str(llada_path),
            "--prompt",
            "Hi",
            "--max-tokens",
            "6",
            "--block-length",
            "6",
            "--steps",
            "3",
            "--show-canvas",
        ],
        timeout=120,
    )
    assert code == 0, out
    assert out.count(CLEAR_LINE) == 3  # one redraw per forward
    tail = out[out.rindex(CLEAR_LINE) :]
    canvas_line, rest = tail.split("\n", 1)
    assert canvas_line.startswith(CLEAR_LINE + "[forward 3] ")
    assert rest.startswith("==========\n") and "[forward" not in rest and "Generation: 6 tokens" in rest
