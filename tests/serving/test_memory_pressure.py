"""The server short of memory (issue 55.5), under an address-space limit (RLIMIT_AS, as
`prlimit --as` sets it). Before: at 1.6 GB the server started, said /health 200, hung on its
first completion (OpenBLAS retries an allocation that fails forever), dropped later
connections unanswered ("can't start new thread") and ignored SIGTERM; at 1.2 GB its start
hung; lower, it ended with a traceback or an abort. Now a request that would start short of
memory is a 503 and /health a 503 saying so, a connection whose thread cannot start a 503,
a stop always ends the process, and a start-up short of memory one line and exit 2.

The limits are set from what this machine's processes take (measured by a child), not from
fixed sizes: the footprint depends on what is installed (torch is, with the test extra).
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_runs import running_server

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH
from mlx_lm_diffusion.serving import memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, sets RLIMIT_AS")

ROOT = Path(__file__).parents[2]
MIB = 1 << 20
START_BOUND = 120  # seconds for a start-up, or its failure, on a busy 2-core machine
PAGE = os.sysconf("SC_PAGE_SIZE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body=None, timeout: float = 60):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def _address_space(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[0]) * PAGE


def _serve(tmp_path, *flags, prefix=(), script=None):
    """`python -m mlx_lm_diffusion.server --model <demo> --port P *flags` (or `python -c
    script ...`), its output in server.log; (process, port) once /health answers."""
    port = _free_port()
    command = ["-m", "mlx_lm_diffusion.server"] if script is None else ["-c", script]
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [*prefix, sys.executable, *command, "--model", str(DEMO_MODEL_PATH), "--port", str(port), *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.monotonic() + START_BOUND
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _request(port, "GET", "/health", timeout=5)[0] == 200:
                return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    proc.wait(timeout=30)
    pytest.fail("the server did not come up: " + (tmp_path / "server.log").read_text()[-3000:])


def _kill(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


COMPLETION = {"prompt": "357+468=", "max_tokens": 8}
CHAT = {"messages": [{"role": "user", "content": "1+2="}], "max_tokens": 8}


def _assert_out_of_memory(status: int, body: dict) -> None:
    assert status == 503, body
    error = body["error"]
    assert error["type"] == "server_error" and error["code"] == "out_of_memory", error
    assert "out of memory" in error["message"] and "address space" in error["message"], error


def test_a_server_short_of_address_space_answers_503_until_it_is_back(tmp_path):
    """The running server's limit is lowered to what it holds plus 32 MiB (less than a
    decode needs: memory.RESERVE_BYTES): completions and chats are 503s with OpenAI's body,
    /health a 503 naming the shortage; the limit raised again, both are served; SIGTERM ends
    it, exit 0. (Before, such a request decoded into whatever the allocators did.)"""
    proc, port = _serve(tmp_path)
    try:
        assert _request(port, "POST", "/v1/completions", COMPLETION)[0] == 200  # (its first decode: warm)
        _, hard = resource.prlimit(proc.pid, resource.RLIMIT_AS)
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (_address_space(proc.pid) + 32 * MIB, hard))
        _assert_out_of_memory(*_request(port, "POST", "/v1/completions", COMPLETION))
        _assert_out_of_memory(*_request(port, "POST", "/v1/chat/completions", CHAT))
        status, health = _request(port, "GET", "/health")
        assert status == 503 and health["reason"].startswith("out of memory"), health
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (resource.RLIM_INFINITY, hard))
        assert _request(port, "POST", "/v1/completions", COMPLETION)[0] == 200
        assert _request(port, "POST", "/v1/chat/completions", CHAT)[0] == 200
        assert _request(port, "GET", "/health")[0] == 200
        resource.prlimit(proc.pid, resource.RLIMIT_AS, (_address_space(proc.pid) + 32 * MIB, hard))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log = (tmp_path / "server.log").read_text()
        assert "Traceback" not in log and "terminate called" not in log, log[-3000:]
    finally:
        _kill(proc)


@pytest.fixture(scope="module")
def import_footprint() -> int:
    """The address space a process holds once the server's modules are imported."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import mlx_lm_diffusion.serving.startup; print(open('/proc/self/statm').read().split()[0])",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START_BOUND,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout) * PAGE


def _start_under(limit: int, tmp_path) -> tuple:
    """(exit code, output) of the server started under `prlimit --as=limit`."""
    port = _free_port()
    out = subprocess.run(
        [
            "prlimit",
            f"--as={limit}",
            sys.executable,
            "-m",
            "mlx_lm_diffusion.server",
            "--model",
            str(DEMO_MODEL_PATH),
            "--port",
            str(port),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START_BOUND,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    return out.returncode, out.stdout + out.stderr


@pytest.mark.skipif(
    subprocess.run(["prlimit", "--version"], capture_output=True).returncode != 0, reason="needs util-linux's prlimit"
)
@pytest.mark.parametrize("share, what", [(0.5, "import"), (None, "load")])
def test_a_start_up_short_of_memory_ends_with_one_line(share, what, import_footprint, tmp_path):
    """Under half of what the imports take, an import fails (a library that cannot be mapped,
    MemoryError, transformers' "Could not import module"); with 120 MiB over it the
    model cannot be loaded (memory.START_RESERVE_BYTES). Either way: one line, exit 2. (Before:
    a traceback, an abort or a segfault at the first; a start-up that hung at the second.)"""
    # (half, not 85%: close to the footprint the first allocation to fail can be a C++ library's,
    # which aborts (std::bad_alloc) where Python never sees it; seen once at 85% in a busy full run)
    limit = int(import_footprint * share) if share else import_footprint + 120 * MIB
    code, output = _start_under(limit, tmp_path)
    lines = output.strip().splitlines()
    assert code == 2, (code, output[-3000:])
    assert "Traceback" not in output and "Fatal Python error" not in output, output[-3000:]
    assert lines[-1].startswith("mlx_lm_diffusion.server: error: "), output[-3000:]
    if what == "import":
        assert len(lines) == 1, output
    else:
        assert "needed to load the model" in lines[-1], lines[-1]


STUCK = """
import sys, threading
from mlx_lm_diffusion.serving import starting
starting.take_signals()
from mlx_lm_diffusion.serving import generator, startup
# (--no-batch: the generation thread decodes) a decode that never returns
generator.DiffusionResponseGenerator._serve_alone = lambda *args, **kwargs: threading.Event().wait()
sys.argv[0] = "mlx_lm_diffusion.server"
sys.exit(startup.main())
"""


def test_sigterm_ends_a_server_whose_decode_never_returns(tmp_path):
    """A decode stuck in native code (as OpenBLAS is where its allocation fails) held the
    stop forever: the process ended neither on SIGTERM nor after its grace period. Now the
    stop has --shutdown-grace + 5 + startup.STOP_MARGIN seconds, then the process leaves,
    exit 1, one line in the log."""
    from mlx_lm_diffusion.serving.startup import STOP_MARGIN

    grace = 1.0
    proc, port = _serve(tmp_path, "--shutdown-grace", str(grace), "--no-batch", script=STUCK)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps(COMPLETION), {"Content-Type": "application/json"})
        time.sleep(1.0)  # (the decode is stuck now)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        code = proc.wait(timeout=grace + 5 + STOP_MARGIN + 60)
        assert code == 1 and time.monotonic() - sent >= grace + 5 + STOP_MARGIN - 1
        conn.close()
        log = (tmp_path / "server.log").read_text()
        assert "did not stop within" in log and "Traceback" not in log, log[-3000:]
    finally:
        _kill(proc)


def test_a_connection_whose_thread_cannot_start_gets_a_503(monkeypatch):
    """ "can't start new thread" for a connection: the client is answered (503, OpenAI's body)
    and the log has one line, where the connection used to be closed unanswered after a
    traceback."""
    import socketserver

    def no_thread(self, request, client_address):
        raise RuntimeError("can't start new thread")

    with running_server(["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "CRITICAL"]) as (httpd, _):
        port = httpd.server_address[1]
        monkeypatch.setattr(socketserver.ThreadingMixIn, "process_request", no_thread)
        status, body = _request(port, "POST", "/v1/completions", COMPLETION, timeout=30)
        assert status == 503 and "cannot start a thread" in body["error"]["message"], body
        monkeypatch.undo()
        assert _request(port, "POST", "/v1/completions", COMPLETION)[0] == 200


def test_what_counts_as_out_of_memory():
    assert memory.is_out_of_memory(MemoryError())
    for text in (
        "can't start new thread",
        "[metal::malloc] Unable to allocate 34359738368 bytes",
        "libtorch_cpu.so: failed to map segment from shared object",
        "[Errno 12] Cannot allocate memory",
    ):
        assert memory.is_out_of_memory(RuntimeError(text)), text
    assert not memory.is_out_of_memory(ValueError("max_tokens must be positive"))
