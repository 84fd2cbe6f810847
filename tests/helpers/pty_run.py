"""Run a command under a pseudo-terminal (stdin, stdout and stderr all a tty), as a
person at a terminal runs it: feed it lines, read everything it prints, bounded."""

from __future__ import annotations

import os
import pty
import select
import signal
import time
from typing import Optional, Sequence, Tuple

QUIET_SECONDS = 0.5
TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)  # (default at a person's terminal)


def run_in_pty(
    argv: Sequence[str],
    inputs: Sequence[object] = (),
    timeout: float = 120.0,
    env: Optional[dict] = None,
    wait_for: Optional[str] = None,
) -> Tuple[Optional[int], str, float]:
    """Run `argv` on a pty; returns (exit code or None if killed at `timeout`,
    everything printed, seconds it ran). Each item of `inputs` is written once the
    output so far holds `wait_for` (or at once without it), then `wait_for` must
    appear again before the next one: a str is typed (with a newline), b"\\x03" is
    Ctrl-C (typed: the terminal sends SIGINT, as to a person's), b"\\x04" is end of input."""
    env = {**os.environ, **(env or {}), "HF_HUB_OFFLINE": "1", "TERM": "xterm", "COLUMNS": "100"}
    start = time.monotonic()
    pid, fd = pty.fork()
    if pid == 0:  # the child
        try:
            # A person's terminal starts a program with the default dispositions. A test run
            # started in the background by a non-interactive shell (`pytest &`, nohup, some CI
            # runners) inherits SIGINT and SIGQUIT ignored, and exec keeps what is ignored:
            # the child would then never see the terminal's Ctrl-C (and Python installs no
            # KeyboardInterrupt handler for a SIGINT ignored at start).
            for number in TERMINAL_SIGNALS:
                signal.signal(number, signal.SIG_DFL)
            os.execvpe(argv[0], list(argv), env)
        finally:
            os._exit(127)
    out = b""
    last_output = start
    pending = list(inputs)
    seen = 0  # prompts consumed so far
    status, timed_out = None, False
    try:
        while True:
            if time.monotonic() - start > timeout:
                waiting = f"{len(pending)} input(s) not typed, {seen} typed" if inputs else "no inputs"
                out += _hung_report(pid, fd, timeout, waiting).encode()
                os.kill(pid, signal.SIGKILL)
                timed_out = True  # (reaped below: reported as killed, never as a clean exit)
                break
            text = out.decode("utf-8", "replace")
            # Type only once the program has been quiet for a moment after its prompt: a
            # line editor entering raw mode flushes input typed before it reads (TCSAFLUSH).
            quiet = time.monotonic() - last_output > QUIET_SECONDS
            if pending and quiet and (wait_for is None or text.count(wait_for) > seen):
                item = pending.pop(0)
                seen += 1
                if isinstance(item, bytes):  # (Ctrl-C: the line discipline signals the foreground group)
                    os.write(fd, item)
                else:
                    os.write(fd, (str(item) + "\n").encode())
            r, _, _ = select.select([fd], [], [], 0.1)
            if r:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: the child closed the terminal
                    chunk = b""
                if not chunk:
                    break
                out += chunk
                last_output = time.monotonic()
            done, exited = os.waitpid(pid, os.WNOHANG)  # ((0, 0) while it runs)
            if done:
                status = exited
                out += _drain(fd, quiet=0.2, limit=timeout)  # what is left
                break
        if status is None:
            status = _reap(pid, start + timeout)
    finally:
        os.close(fd)
    elapsed = time.monotonic() - start
    if timed_out:
        code = None
    elif os.WIFSIGNALED(status):
        code = None if os.WTERMSIG(status) == signal.SIGKILL else -os.WTERMSIG(status)
    else:
        code = os.WEXITSTATUS(status)
    return code, out.decode("utf-8", "replace").replace("\r\n", "\n"), elapsed


def _hung_report(pid: int, fd: int, timeout: float, waiting: str) -> str:
    """What a child that outlived `timeout` was doing, for the failure message: each
    thread's kernel state, signal masks and system call, the terminal's modes, then
    SIGABRT (a child run with `python -X faulthandler` prints every thread's Python
    stack) and what it printed in the next 2 s."""
    import glob
    import termios

    lines = [f"\n[pty_run: no exit within {timeout:g} s; {waiting}]"]
    try:
        lflag = termios.tcgetattr(fd)[3]
        lines.append(
            "terminal: "
            + " ".join(f"{name}={bool(lflag & getattr(termios, name))}" for name in ("ICANON", "ECHO", "ISIG"))
        )
    except OSError as e:
        lines.append(f"terminal: {e}")
    for task in sorted(glob.glob(f"/proc/{pid}/task/*")):
        try:
            status = dict(line.split(":\t", 1) for line in open(f"{task}/status").read().splitlines() if ":\t" in line)
            syscall = open(f"{task}/syscall").read().split()[0]
            fields = " ".join(
                f"{k}={status[k].strip()}" for k in ("Name", "State", "SigBlk", "SigPnd", "ShdPnd", "SigCgt", "SigIgn")
            )
            lines.append(f"thread {task.rsplit('/', 1)[1]}: {fields} syscall={syscall}")
        except (OSError, KeyError, IndexError) as e:
            lines.append(f"thread {task}: {e}")
    try:
        os.kill(pid, signal.SIGABRT)
    except ProcessLookupError:
        pass
    dump = _drain(fd, quiet=2.0, limit=2.0)
    lines.append("after SIGABRT:\n" + dump.decode("utf-8", "replace"))
    return "\n".join(lines)


def _drain(fd: int, quiet: float, limit: float) -> bytes:
    """What the terminal still has to read: until it closes, stays silent for `quiet`
    seconds, or `limit` seconds have passed."""
    out, until = b"", time.monotonic() + limit
    while time.monotonic() < until:
        r, _, _ = select.select([fd], [], [], min(quiet, max(until - time.monotonic(), 0)))
        if not r:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    return out


def _reap(pid: int, deadline: float) -> int:
    """The child's wait status, waiting until `deadline` at most (then SIGKILL): its
    terminal closed does not mean that it ends."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitpid(pid, 0)[1]
