"""Loading never asks to run remote code and never runs it (issue 12, part 3).

The released LLaDA/Dream/SDAR/LLaDA2/Nemotron checkpoints name their modeling code in
config.json's `auto_map`; transformers' AutoTokenizer then asks "Do you wish to run the
custom code? [y/N]" and waits 15 s unless told `trust_remote_code`. The fixtures here
carry auto_map (config.json and tokenizer_config.json) and run under a pseudo-terminal.
"""

import json
import shutil
import subprocess
import sys

import pytest
from pty_run import run_in_pty

AUTO_MAP = {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"}
PROMPT_WORDS = ("custom code", "[y/N]", "trust_remote_code=True")


@pytest.fixture(scope="module")
def auto_map_path(llada_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("released") / "llada"
    shutil.copytree(llada_path, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "auto_map": AUTO_MAP}))
    tok = json.loads((path / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": [None, "tokenization_llada.LLaDATokenizer"]}
    (path / "tokenizer_config.json").write_text(json.dumps(tok))
    # the code auto_map names, as a released checkpoint ships it: running it would say so
    for name in ("configuration_llada.py", "modeling_llada.py", "tokenization_llada.py"):
        (path / name).write_text("raise SystemExit('REMOTE CODE RAN')\n")
    return path


LOAD_SCRIPT = (
    "import sys, time; import mlx_lm_diffusion as mld; load = mld.load; t = time.monotonic(); "  # (imports first)
    "m, tok = load(sys.argv[1]); print(f'LOADED in {time.monotonic() - t:.2f}s', flush=True)"
)


def _loaded_fast(out):
    line = next(line for line in out.splitlines() if line.startswith("LOADED in "))
    return float(line.split()[2].rstrip("s")) < 5.0  # the prompt alone waits 15 s


def test_load_on_a_terminal_neither_asks_nor_waits(auto_map_path):
    code, out, _ = run_in_pty([sys.executable, "-c", LOAD_SCRIPT, str(auto_map_path)], timeout=120)
    assert code == 0, out
    assert not any(w in out for w in PROMPT_WORDS), out
    assert "REMOTE CODE RAN" not in out and _loaded_fast(out), out


STOCK_LOAD_SCRIPT = (
    "import sys, time; import mlx_lm, mlx_lm_diffusion as mld; mld.install(); t = time.monotonic(); "
    "m, tok = mlx_lm.load(sys.argv[1]); print(f'LOADED in {time.monotonic() - t:.2f}s', flush=True)"
)


def test_stock_mlx_lm_load_after_install_neither_asks_nor_waits(auto_map_path):
    """mlx_lm.load passes no trust_remote_code to the tokenizer: install() makes it False
    for diffusion checkpoints (before, this asked "[y/N]" and waited 15 s)."""
    code, out, _ = run_in_pty([sys.executable, "-c", STOCK_LOAD_SCRIPT, str(auto_map_path)], timeout=120)
    assert code == 0, out
    assert not any(w in out for w in PROMPT_WORDS), out
    assert "REMOTE CODE RAN" not in out and _loaded_fast(out), out


def test_load_off_a_terminal_with_stdin_open_neither_asks_nor_waits(auto_map_path):
    p = subprocess.Popen(
        [sys.executable, "-c", LOAD_SCRIPT, str(auto_map_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = p.communicate(timeout=120)  # stdin stays open: an input() would wait
    finally:
        p.kill()
    assert p.returncode == 0, out
    assert not any(w in out for w in PROMPT_WORDS) and _loaded_fast(out), out


def test_generate_cli_on_a_terminal(auto_map_path):
    code, out, _ = run_in_pty(
        [
            sys.executable,
            "-m",
            "mlx_lm_diffusion.generate",
            "--model",
            str(auto_map_path),
            "--prompt",
            "Hi",
            "--max-tokens",
            "4",
        ],
        timeout=120,
    )
    assert code == 0, out
    assert not any(w in out for w in PROMPT_WORDS) and "REMOTE CODE RAN" not in out, out
    assert "forwards" in out


def test_trust_remote_code_reaches_the_tokenizer(auto_map_path, monkeypatch):
    """`trust_remote_code` is mlx-lm's: False unless asked, then passed to AutoTokenizer."""
    import mlx_lm.tokenizer_utils as tu

    import mlx_lm_diffusion as mld

    seen = []
    real = tu.AutoTokenizer

    class Recording:
        @staticmethod
        def from_pretrained(path, **kwargs):
            seen.append(kwargs.get("trust_remote_code"))
            return real.from_pretrained(path, **{**kwargs, "trust_remote_code": False})

    monkeypatch.setattr(tu, "AutoTokenizer", Recording)
    mld.load(str(auto_map_path))
    mld.load(str(auto_map_path), trust_remote_code=True)
    assert seen == [False, True]


def test_cli_flags_exist():
    from mlx_lm_diffusion.cli import chat
    from mlx_lm_diffusion.cli.generate import setup_arg_parser

    assert setup_arg_parser().parse_args(["--trust-remote-code"]).trust_remote_code is True
    assert setup_arg_parser().parse_args([]).trust_remote_code is False
    assert chat.setup_arg_parser().parse_args(["--trust-remote-code"]).trust_remote_code is True


def test_chat_repl_on_a_terminal(auto_map_path):
    code, out, _ = run_in_pty(
        [sys.executable, "-m", "mlx_lm_diffusion.chat", "--model", str(auto_map_path), "--max-tokens", "4"],
        ["Hi", "q"],
        timeout=120,
        wait_for="\u203a",
    )
    assert code == 0, out
    assert not any(w in out for w in PROMPT_WORDS) and "REMOTE CODE RAN" not in out, out
    assert "bye" in out and "Traceback" not in out
