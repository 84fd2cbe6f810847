"""The first ten minutes, as a newcomer meets them (issue 12, part 9): the shipped demo
driven the way a new user drives it, so none of it can come back unnoticed. (The README's
own commands run as written, their output compared, in tests/test_docs.py.)

- `--model <the demo>` named explicitly, at several max_tokens (none, mlx-lm's 100, 8,
  64, 256, 512 and one past the context), with and without threshold 0.9;
- the Python API and stock mlx-lm after install() at their default max_tokens;
- the chat REPL (ours, and stock mlx_lm.chat after install()) under a pseudo-terminal;
- the server, started as its console script, through the openai client: chat and
  completions, streamed or not, with and without max_tokens.

The demo adds two numbers: "357+468=" must answer 825 at any length and in chat.
"""

import contextlib
import importlib
import io
import os
import re
import sys
from pathlib import Path

import pytest
from pty_run import run_in_pty
from server_runs import console_server

BIN = Path(sys.executable).parent
PROMPT, ANSWER = "357+468=", "825"
TIMEOUT = 150
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}

cli = importlib.import_module("mlx_lm_diffusion.cli.generate")


@pytest.fixture(scope="module")
def demo_path():
    from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

    return str(DEMO_MODEL_PATH)


@pytest.fixture(scope="module")
def demo(demo_path):
    import mlx_lm_diffusion as mld

    return mld.load(demo_path)


def answer_lines(stdout):
    """The lines of stdout that are not the verbose frame (=====, Prompt:, ...)."""
    skip = ("==========", "Prompt:", "Generation:", "Peak memory:")
    return [line.strip() for line in stdout.splitlines() if line.strip() and not line.startswith(skip)]


def plain(text):
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


# ----------------------------------------------------------------------------- --model, any max_tokens


def run_cli(*flags):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(list(flags))
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("rule", [[], ["--threshold", "0.9"]], ids=["defaults", "threshold-0.9"])
@pytest.mark.parametrize("max_tokens", [None, 100, 8, 64, 256, 512, 100000])
def test_model_named_explicitly_at_any_max_tokens(demo_path, max_tokens, rule):
    flags = ["--model", demo_path, "--prompt", PROMPT, "--verbose", "False", *rule]
    if max_tokens is not None:
        flags += ["--max-tokens", str(max_tokens)]
    rc, out, err = run_cli(*flags)
    assert rc == 0, err
    assert answer_lines(out) == [ANSWER], (max_tokens, out)


def test_python_api_and_stock_mlx_lm_at_their_defaults(demo):
    import mlx_lm

    import mlx_lm_diffusion as mld

    model, tok = demo
    assert mld.generate(model, tok, PROMPT).strip() == ANSWER  # max_tokens 256
    responses = list(mld.stream_generate(model, tok, PROMPT))
    assert "".join(r.text for r in responses).strip() == ANSWER and responses[-1].finish_reason == "stop"
    mld.install()
    try:
        assert mlx_lm.generate(model, tok, PROMPT).strip() == ANSWER  # mlx-lm's default: 100
        if tok.has_chat_template:
            ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
            assert mlx_lm.generate(model, tok, ids).strip() == ANSWER
    finally:
        mld.uninstall()


# ----------------------------------------------------------------------------- the chat REPL


def test_chat_repl_on_a_terminal(demo_path):
    code, out, _ = run_in_pty(
        [str(BIN / "mlx_lm_diffusion.chat"), "--model", demo_path],
        [PROMPT, "r", PROMPT, b"\x04"],
        timeout=TIMEOUT,
        wait_for="\u203a",
    )
    out = plain(out)
    assert code == 0, out
    assert "Traceback" not in out
    assert len(re.findall(rf"(?m)^{ANSWER}\s*$", out)) == 2, out  # both turns, each on its own line
    assert "bye" in out


def test_stock_mlx_lm_chat_after_install_on_a_terminal(demo_path):
    script = (
        "import sys, mlx_lm_diffusion as mld; mld.install(); import mlx_lm.chat as c; "
        "sys.argv = ['mlx_lm.chat', '--model', sys.argv[1]]; c.main()"
    )
    code, out, _ = run_in_pty(
        [sys.executable, "-c", script, demo_path], [PROMPT, "q"], timeout=TIMEOUT, wait_for="\u203a"
    )
    out = plain(out)
    assert code == 0, out
    assert "Traceback" not in out and re.search(rf"(?m)^{ANSWER}\s*$", out), out


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai

    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**ENV, "HF_HUB_CACHE": str(log.parent / "hub")}
    # (no --model: the embedded demo, as a newcomer starts it)
    with console_server([str(BIN / "mlx_lm_diffusion.server")], env, log) as port:
        assert "embedded demo model" in log.read_text()
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.mark.parametrize("max_tokens", [None, 8, 64, 512])
def test_server_chat(client, max_tokens):
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    r = client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": PROMPT}], temperature=0, **extra
    )
    assert (r.choices[0].message.content or "").strip() == ANSWER
    assert r.choices[0].finish_reason == "stop"


def test_server_chat_streamed(client):
    chunks = client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": PROMPT}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == ANSWER


@pytest.mark.parametrize("max_tokens", [None, 8, 512])
def test_server_completions(client, max_tokens):
    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    r = client.completions.create(model="default_model", prompt=PROMPT, temperature=0, **extra)
    assert r.choices[0].text.strip() == ANSWER
    assert r.choices[0].finish_reason == "stop"
