"""The chat REPL: mlx_lm.chat's loop for diffusion models, multi-turn through the prompt cache."""

import io

import pytest
from chat_script import ScriptedUI, args_for

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.cli import chat


def turn_ids(tok, query):
    return tok.apply_chat_template([{"role": "user", "content": query}], add_generation_prompt=True)


def decode(model, tok, ids, **options):
    responses = list(mld.stream_generate(model, tok, ids, max_tokens=10, **options))
    tokens = [r.token for r in responses]
    return tokens, "".join(r.text for r in responses)


def test_turns_continue_the_conversation_in_the_prompt_cache(llada, llada_path):
    model, tok = llada
    ui = ScriptedUI(["Hello", "And then?", "h", "r", "And then?", "q", "never read"])
    chat.chat_loop(model, tok, args_for(llada_path), ui)
    first_ids = turn_ids(tok, "Hello")
    first_tokens, first_text = decode(model, tok, first_ids)
    second_ids = first_ids + first_tokens + turn_ids(tok, "And then?")
    _, second_text = decode(model, tok, second_ids)
    _, fresh_text = decode(model, tok, turn_ids(tok, "And then?"))
    assert ui.turns == [first_text, second_text, fresh_text]
    assert ui.events == ["help", "reset", "bye"]
    assert ui.queries == ["never read"]


def test_diffusion_flags_and_end_of_input(llada, llada_path):
    model, tok = llada
    ui = ScriptedUI(["Hello"])
    chat.chat_loop(model, tok, args_for(llada_path, "--block-length", "4", "--steps", "2"), ui)
    _, text = decode(model, tok, turn_ids(tok, "Hello"), block_length=4, steps=2)
    assert ui.turns == [text]
    assert ui.events == ["bye"]


def test_a_turn_past_the_context_is_reported_not_fatal(llada, llada_path):
    model, tok = llada
    ui = ScriptedUI(["x" * 600, "r", "Hello"])
    chat.chat_loop(model, tok, args_for(llada_path), ui)
    assert "error" in ui.turns[0] and "context" in ui.turns[0]
    assert ui.turns[1] == decode(model, tok, turn_ids(tok, "Hello"))[1]


def test_flags_are_mlx_lm_chat_flags_plus_diffusion():
    args = chat.setup_arg_parser().parse_args(
        ["--model", "m", "--temp", "0.5", "--max-kv-size", "64", "--threshold", "0.8", "--show-canvas"]
    )
    assert (args.temp, args.max_kv_size, args.threshold, args.show_canvas) == (0.5, 64, 0.8, True)
    assert args.system_prompt is None and args.seed == 0  # mlx_lm.chat's defaults


def test_main_runs_the_repl(llada_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nq\n"))
    assert chat.main(["--model", str(llada_path), "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "bye" in out and "tokens" in out  # the goodbye and the turn's statistics


def test_main_without_a_model_chats_with_the_demo(monkeypatch, capsys):
    """As mlx_lm_diffusion.generate does: no --model is the embedded demo model, said on
    stderr (a newcomer's `mlx_lm_diffusion.chat` runs offline)."""
    monkeypatch.setattr("sys.stdin", io.StringIO("357+468=\nq\n"))
    assert chat.main([]) == 0
    captured = capsys.readouterr()
    assert "embedded demo model" in captured.err
    assert "825" in captured.out and "bye" in captured.out


def test_the_demo_answers_each_message_on_its_own(monkeypatch, capsys):
    """The demo's template renders the last message only (one sum at a time): each turn
    stands alone, as without a template; its second answer is not read after the first."""
    from mlx_lm_diffusion.demo import load_demo

    _, tok = load_demo()
    assert tok.has_chat_template and not chat.keeps_turns(tok)
    monkeypatch.setattr("sys.stdin", io.StringIO("357+468=\n12+5=\n100+200=\nq\n"))
    assert chat.main([]) == 0
    answers = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().isdigit()]
    assert answers == ["825", "17", "300"]


def test_a_template_that_renders_the_turns_keeps_them(llada):
    _, tok = llada
    assert tok.has_chat_template and chat.keeps_turns(tok)


# ----------------------------------------------------------------------------- issue 12, part 5


@pytest.fixture(scope="module")
def untemplated_path(llada_path, tmp_path_factory):
    """The llada checkpoint without a chat template (a base model, as the demo was)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("base") / "llada"
    shutil.copytree(llada_path, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_a_model_without_a_chat_template_gets_the_raw_prompt(untemplated_path):
    model, tok = mld.load(str(untemplated_path))
    assert not tok.has_chat_template
    ui = ScriptedUI(["Hello", "And then?"])
    chat.chat_loop(model, tok, args_for(untemplated_path), ui)
    # each message on its own, as its raw prompt (no turns to tell apart)
    assert ui.turns == [decode(model, tok, tok.encode(q))[1] for q in ("Hello", "And then?")]
    assert ui.events == ["bye"]


def test_main_says_once_that_there_is_no_chat_template(untemplated_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\n"))  # then end of input
    assert chat.main(["--model", str(untemplated_path), "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count(chat.NO_TEMPLATE_NOTICE) == 1 and "bye" in out and "tokens" in out


def test_ctrl_c_at_the_prompt_and_during_a_reply(llada, llada_path):
    model, tok = llada

    class InterruptingUI(ScriptedUI):
        def prompt(self):
            if self.queries and self.queries[0] is KeyboardInterrupt:
                raise KeyboardInterrupt
            return super().prompt()

        def stream_token(self, text):
            if self.interrupt:
                self.interrupt = False
                raise KeyboardInterrupt
            super().stream_token(text)

    ui = InterruptingUI(["Hello", "Hello", KeyboardInterrupt, "never read"])
    ui.interrupt = True  # the first reply is cut at its first token
    chat.chat_loop(model, tok, args_for(llada_path), ui)
    assert ui.turns[0].endswith("[interrupted]") and ui.events == ["bye"]
    assert ui.queries == [KeyboardInterrupt, "never read"]


def test_show_canvas_holds_each_reply_until_final(llada, llada_path):
    model, tok = llada
    frames = []

    class View:
        closed = 0

        def __call__(self, step):
            frames.append(step.forwards)

        def close(self):
            View.closed += 1

    ui = ScriptedUI(["Hello"])
    chat.chat_loop(model, tok, args_for(llada_path), ui, draft_callback=View())
    assert ui.turns == [decode(model, tok, turn_ids(tok, "Hello"))[1]] and frames and View.closed == 1


def _repl(path, inputs, *flags):
    import sys

    from pty_run import run_in_pty

    # (-X faulthandler: a REPL that does not exit prints its threads' stacks when pty_run aborts it)
    return run_in_pty(
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "mlx_lm_diffusion.chat",
            "--model",
            str(path),
            "--max-tokens",
            "4",
            *flags,
        ],
        inputs,
        timeout=150,
        wait_for="\u203a",
    )


@pytest.mark.parametrize("last", [b"\x03", b"\x04", "q"], ids=["ctrl-c", "end-of-input", "q"])
def test_repl_on_a_terminal_exits_cleanly(untemplated_path, last):
    code, out, _ = _repl(untemplated_path, ["Hello", "h", last])
    assert code == 0, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    assert chat.NO_TEMPLATE_NOTICE in out and "bye" in out and "tokens" in out


def test_repl_bad_model_is_one_line_exit_2(tmp_path):
    import os
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "mlx_lm_diffusion.chat", "--model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "does not exist" in lines[0], r.stderr


def test_piped_chat_is_plain_text_under_its_own_name():
    """Issue 54.4: into a pipe the REPL writes no ANSI codes (a plain '> ' prompt), and its
    banner names this door, not mlx_lm.chat; NO_COLOR is honoured the same way."""
    from cli_run import run

    done = run("mlx_lm_diffusion.chat", stdin="357+468=\nq\n")
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "mlx_lm_diffusion.chat" in done.stdout and "mlx_lm.chat" not in done.stdout
    assert "> 357+468=\n825" in done.stdout


def test_plain_output_drops_ansi_unless_a_terminal_without_no_color(monkeypatch):
    import sys

    from mlx_lm_diffusion.cli.plain_output import plain_unless_terminal

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for no_color, expect_colour in (("", True), ("1", False)):
        monkeypatch.setenv("NO_COLOR", no_color)
        out = Terminal()
        monkeypatch.setattr(sys, "stdout", out)
        with plain_unless_terminal() as colour:
            print("\x1b[1;35m›\x1b[0m hi")
        assert colour is expect_colour
        assert ("\x1b" in out.getvalue()) is expect_colour
