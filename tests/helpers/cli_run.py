"""Running the package's command lines in tests: in a child process, or in process.

A child pays ~5 s of imports (mlx_lm imports transformers, which imports torch) before
its first line; the tests that check what only a process shows (its exit status from
`python -m`, stdin, a terminal) run one (`run`). The rest call the CLI's `main` here
(`run_main`), which parses, loads and prints through the same code: its return value or
SystemExit code is the exit status, and what it wrote to sys.stdout / sys.stderr is the
output."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess
import sys
from types import SimpleNamespace


def run(*args, stdin=None, timeout=120) -> subprocess.CompletedProcess:
    """`python -m <args>` in a child process, offline."""
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def run_main(module: str, *argv: str) -> SimpleNamespace:
    """`module`'s main(argv) in this process, offline: returncode, stdout and stderr as
    `run` gives them."""
    import huggingface_hub.constants as hf_constants

    main = importlib.import_module(module).main
    out, err = io.StringIO(), io.StringIO()
    saved = hf_constants.HF_HUB_OFFLINE
    hf_constants.HF_HUB_OFFLINE = True
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as e:  # (argparse's errors)
                code = e.code
    finally:
        hf_constants.HF_HUB_OFFLINE = saved
    return SimpleNamespace(returncode=0 if code is None else code, stdout=out.getvalue(), stderr=err.getvalue())
