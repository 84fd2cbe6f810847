"""Every code block of README.md and docs/*.md runs, offline, and shows what it prints.

The pages are read with sybil's markdown parsers:

* ```python blocks run in one namespace per page (a page's later blocks see its earlier
  ones' names); a block that begins with `>>>` is a doctest (ELLIPSIS, NORMALIZE_WHITESPACE).
* ```console blocks run in ONE bash process per block (so `cd` and exports carry from one
  command to the next): a line `$ COMMAND` is a command (a trailing backslash continues
  it, a here-document's lines belong to it), the lines after it up to the next `$ ` are
  its expected stdout, compared line by line after trailing whitespace is stripped and
  terminal colours are removed; a line `...` stands for any number of lines, `...` within
  a line for any text. Every command must exit 0. The block runs in its own process group,
  killed when the block ends, so a server started with `&` never outlives its block.
* `<!-- skip: next "REASON" -->` skips the next block with that reason (pytest -rs shows it).

Every block runs with a scratch directory as its working directory, as a reader's shell
would: nothing is written there for a page but what its own blocks write (a page that loads
a tiny random checkpoint first shows `python -m mlx_lm_diffusion.testing checkpoints
--skip-existing --families ...`, which writes it under `checkpoints/`). What a reader copies
is what runs, with two substitutions the reader does not need: a free port for 8080, and a
kernel cache kept across the server starts (`--kernel-cache-dir`: MLX's CPU kernels are
compiled once per session, not once per server).
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300

BLOCK_TIMEOUT = 120  # seconds for one console block (its commands and anything they started)
DOC_PORT = "8080"  # the port the pages show; each block runs on a free one instead
SHELL_LANGUAGES = ("console",)
# the servers' kernel cache, kept across sessions (the server creates it 0700): a server's
# first requests would otherwise compile MLX's CPU kernels anew, seconds each
KERNEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx_lm_diffusion" / "docs-kernels"
# fenced blocks that are output to read, not code to run (benchmark tables, trees)
TEXT_LANGUAGES = ("text",)

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|[\x01\x02\r]")
SERVER_COMMAND = re.compile(r"(mlx_lm_diffusion\.server|-m mlx_lm_diffusion\.server)(?=\s|$)")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")


# --- console blocks -------------------------------------------------------------------


class Command:
    """One `$ ` command of a console block and the stdout the page shows for it."""

    def __init__(self, line: int, text: str, expected: List[str]):
        self.line, self.text, self.expected = line, text, expected


def parse_console(source: str) -> List[Command]:
    lines = source.splitlines()
    commands: List[Command] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.startswith("$ "):
            if commands:
                commands[-1].expected.append(line)
                i += 1
                continue
            if line.strip():
                raise ValueError(f"console block: line {i + 1} is neither a `$ ` command nor its output: {line!r}")
            i += 1
            continue
        text, start = [line[2:]], i
        i += 1
        while i < len(lines) and (lines[i].startswith("> ") or lines[i] == ">"):  # the shell's `> ` prompt
            text.append(lines[i][2:])
            i += 1
        while i < len(lines) and _continues("\n".join(text)):  # a trailing backslash, an open quote
            text.append(lines[i])
            i += 1
        heredoc = HEREDOC.search(" ".join(text))
        if heredoc:  # the here-document's lines, up to its terminator, belong to the command
            while i < len(lines):
                text.append(lines[i])
                i += 1
                if text[-1].strip() == heredoc.group(2):
                    break
        commands.append(Command(start, "\n".join(text), []))
    return commands


def _continues(command: str) -> bool:
    if command.endswith("\\"):
        return True
    try:
        shlex.split(command)
    except ValueError:  # (no closing quotation)
        return True
    return False


def matches(expected: List[str], actual: str) -> bool:
    """`...` alone on a line: any lines (none included); `...` within a line: any text."""
    want = _trimmed([line.rstrip() for line in expected])
    got = _trimmed([line.rstrip() for line in ANSI.sub("", actual).splitlines()])
    pattern = ""
    for line in want:
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += ".*?".join(re.escape(part) for part in line.split("...")) + r"\n"
    return (
        re.fullmatch(
            pattern,
            "".join(line + "\n" for line in got),
        )
        is not None
    )


def _trimmed(lines: List[str]) -> List[str]:
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ShellRunner:
    """Runs console blocks: the scratch directory, the environment and the kernel cache."""

    def __init__(self):
        self.workdir: Optional[Path] = None
        self.kernel_cache: Optional[Path] = None

    def environment(self) -> dict:
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env["HF_HUB_OFFLINE"] = "1"
        env["HF_HUB_CACHE"] = str(self.workdir / "hf-cache")  # (mlx_lm.server's /v1/models reads it)
        env["TOKENIZERS_PARALLELISM"] = "false"
        env.pop("PYTHONPATH", None)
        return env

    def script(self, commands: List[Command], out: Path, port: int) -> str:
        lines = ["exec </dev/null"]
        for n, command in enumerate(commands):
            text = command.text.replace(DOC_PORT, str(port))
            text = SERVER_COMMAND.sub(lambda m: f"{m.group(1)} --kernel-cache-dir {self.kernel_cache}", text)
            lines += [f"{{ {text}", f'}} >"{out}/{n}.out"; echo $? >"{out}/{n}.rc"']
        return "\n".join(lines) + "\n"

    def __call__(self, example: Example) -> Optional[str]:
        assert self.workdir is not None, "the docs' scratch directory is not set up"
        commands = parse_console(example.parsed)
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="docs-block-") as tmp:
            out = Path(tmp)
            (out / "block.sh").write_text(self.script(commands, out, port))
            stderr = out / "stderr"
            timed_out = self._run(out / "block.sh", stderr)
            problems = self._compare(commands, out, port)
            if timed_out:
                problems.insert(0, f"the block ran past {BLOCK_TIMEOUT} s and was killed")
            if problems:
                tail = stderr.read_text(errors="replace")[-3000:]
                return "\n\n".join(problems) + f"\n\n--- the block's stderr (last 3000 characters) ---\n{tail}"
        return None

    def _run(self, script: Path, stderr: Path) -> bool:
        with open(stderr, "wb") as err:
            process = subprocess.Popen(
                ["bash", str(script)],
                cwd=self.workdir,
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=err,
                stderr=err,
                start_new_session=True,
            )
            timed_out = False
            try:
                process.wait(timeout=BLOCK_TIMEOUT)
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(process.pid)
            process.wait()
        return timed_out

    def _compare(self, commands: List[Command], out: Path, port: int) -> List[str]:
        problems = []
        for n, command in enumerate(commands):
            rc_file, out_file = out / f"{n}.rc", out / f"{n}.out"
            rc = rc_file.read_text().strip() if rc_file.exists() else "(did not run)"
            actual = out_file.read_text(errors="replace") if out_file.exists() else ""
            actual = actual.replace(str(port), DOC_PORT)
            if rc != "0":
                problems.append(f"$ {command.text}\nexit status {rc}; its stdout:\n{actual}")
            elif not matches(command.expected, actual):
                problems.append(
                    f"$ {command.text}\nexpected:\n" + "\n".join(command.expected) + f"\ngot:\n{ANSI.sub('', actual)}"
                )
        return problems


def _kill_group(pgid: int) -> None:
    """End everything the block started (servers with `&` included): TERM, then KILL."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


# --- the pages --------------------------------------------------------------------------

SHELL = ShellRunner()
SYBIL = Sybil(
    parsers=[
        PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE),
        *(CodeBlockParser(language, SHELL) for language in SHELL_LANGUAGES),
        SkipParser(),
    ],
    path="..",
)


def _examples() -> List[Tuple[str, Example]]:
    examples = []
    for page in PAGES:
        for example in SYBIL.parse(page):
            name = f"{page.relative_to(ROOT)}:{example.line}"
            examples.append((name, example))
    return examples


EXAMPLES = _examples()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The scratch directory every block runs in: empty but for the server pages' Hub cache
    directory (the pages write the test checkpoints they load themselves)."""
    path = tmp_path_factory.mktemp("docs")
    (path / "hf-cache").mkdir()
    SHELL.workdir, SHELL.kernel_cache = path, KERNEL_CACHE
    yield path
    import mlx_lm_diffusion

    mlx_lm_diffusion.uninstall()  # (in case a page's install() example failed before its uninstall())
    SHELL.workdir = None


@pytest.mark.parametrize("example", [e for _, e in EXAMPLES], ids=[n for n, _ in EXAMPLES])
def test_example(example, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    try:
        example.evaluate()
    except unittest.SkipTest as skip:  # (said with the page and line, not sybil's frame)
        pytest.skip(f"{Path(example.path).relative_to(ROOT)}:{example.line}: {skip}")


# --- the pages' shape -------------------------------------------------------------------


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to a page under docs/"


def _nav_pages(nav) -> List[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return [p for item in nav for p in _nav_pages(item)]


def test_every_page_is_in_the_nav():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = set(_nav_pages(config["nav"]))
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages - listed == set(), "docs pages missing from mkdocs.yml's nav"
    assert listed - pages == set(), "mkdocs.yml's nav names pages that do not exist"


FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


def test_every_code_block_is_run():
    """A fenced block is python or console (run above) or text (output to read): a block
    in any other language would be skipped by the harness without a word."""
    unknown = []
    for page in PAGES:
        inside = None
        for n, line in enumerate(page.read_text().splitlines(), 1):
            match = FENCE.match(line.strip())
            if not match:
                continue
            if inside is None:
                inside = match.group(1)
                language = match.group(2).strip()
                if language not in ("python", *SHELL_LANGUAGES, *TEXT_LANGUAGES):
                    unknown.append(f"{page.relative_to(ROOT)}:{n}: ```{language}")
            elif match.group(1).startswith(inside) and not match.group(2).strip():
                inside = None
    assert unknown == [], "code blocks in a language the docs' tests do not run"


def test_console_parser():
    commands = parse_console(
        "$ echo a \\\n    b\na b\n$ cat <<'EOF'\nx\nEOF\nx\n$ true\n"
        "$ echo '{\n  1}'\n{\n  1}\n$ for i in 1; do\n>   echo $i\n> done\n1\n"
    )
    assert [(c.text, c.expected) for c in commands] == [
        ("echo a \\\n    b", ["a b"]),
        ("cat <<'EOF'\nx\nEOF", ["x"]),
        ("true", []),
        ("echo '{\n  1}'", ["{", "  1}"]),
        ("for i in 1; do\n  echo $i\ndone", ["1"]),
    ]
    assert matches(["a", "...", "z"], "a\nb\nc\nz\n") and matches(["a", "...", "z"], "a\nz")
    assert matches(["t: ... s"], "t: 1.5 s   \n") and not matches(["t: ... s"], "t: 1.5 ms\nmore")
    assert matches(["825"], "\x1b[1m825\x1b[0m\n\n") and not matches(["825"], "826")


def test_shell_cleanup_kills_background_jobs(tmp_path):
    """A block's `&` job dies with the block."""
    pidfile = tmp_path / "pid"
    runner = ShellRunner()
    runner.workdir, runner.kernel_cache = tmp_path, tmp_path
    (tmp_path / "hf-cache").mkdir()

    class Fake:
        parsed = f"$ sleep 300 & echo $! > {pidfile}\n"

    assert runner(Fake()) is None
    status = Path(f"/proc/{int(pidfile.read_text())}/status")
    assert not status.exists() or "zombie" in status.read_text()


def test_every_page_writes_the_checkpoints_it_loads():
    """A reader who follows one page alone has every test checkpoint it loads: a code block
    of the page writes that family (`python -m mlx_lm_diffusion.testing checkpoints
    --families ...`) before a block first names it."""
    for page in PAGES:
        written = set()
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), flags=re.S | re.M):
            for match in re.finditer(r"mlx_lm_diffusion\.testing checkpoints[^\n]*--families ([a-z0-9_ ]+)", block):
                written |= set(match.group(1).split())
            for name in re.findall(r"checkpoints/([a-z0-9_]+)", block):
                assert name in written, f"{page.name} loads checkpoints/{name} before writing it"
