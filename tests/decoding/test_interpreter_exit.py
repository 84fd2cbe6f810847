"""A program that exits while a daemon thread decodes ends cleanly (issue 55.4).

Before mlx_lm_diffusion.decoding.interpreter_exit, the interpreter finalized while MLX was
evaluating on the daemon thread and the process aborted ("terminate called without an
active exception", exit 134): 3 of 3 runs of the reproduction below on a busy 2-core
machine. The runs go side by side, so the CPUs are busy as they were then.
"""

import subprocess
import sys

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

# the one-liner: a daemon thread streams a long decode; the main thread leaves
EXIT_WHILE_DECODING = f"""
import sys, threading, time
import mlx_lm_diffusion as m
model, tokenizer = m.load({str(DEMO_MODEL_PATH)!r})
def decode():
    for _ in m.stream_generate(model, tokenizer, '357+468=', max_tokens=100, block_length=100, steps=6000):
        pass
threading.Thread(target=decode, daemon=True).start()
time.sleep(3)
sys.exit(0)
"""

# a main thread that raises while its daemon thread decodes (an error path, exit 1)
RAISE_WHILE_DECODING = EXIT_WHILE_DECODING.replace("sys.exit(0)", "raise SystemExit('stopped by the user')")


def _run_side_by_side(programs: list[str]) -> list[subprocess.CompletedProcess]:
    procs = [
        subprocess.Popen([sys.executable, "-c", p], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for p in programs
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def test_exit_while_a_daemon_thread_decodes_never_aborts():
    results = _run_side_by_side([EXIT_WHILE_DECODING] * 3 + [RAISE_WHILE_DECODING])
    for r in results[:3]:
        assert r.returncode == 0, r.stderr[-2000:]
    assert results[3].returncode == 1, results[3].stderr[-2000:]
    assert results[3].stderr.strip().splitlines()[-1] == "stopped by the user"
    for r in results:
        assert "terminate called" not in r.stderr and "Traceback" not in r.stderr


def test_a_server_that_cannot_start_says_one_line_and_never_aborts(tmp_path):
    """A start-up failure ends with exit 2 and one line naming the flag at fault; with the
    generation thread that tried to load still there, 1 of 6 such starts aborted."""
    (tmp_path / "empty").mkdir()
    server = [sys.executable, "-m", "mlx_lm_diffusion.server", "--model", str(DEMO_MODEL_PATH), "--port", "0"]
    runs = [[*server, "--adapter-path", str(tmp_path / "nope")]] * 2 + [
        [*server, "--adapter-path", str(tmp_path / "empty")]
    ] * 4
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv in runs]
    for argv, proc in zip(runs, procs):
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, err[-2000:]
        line = err.strip().splitlines()[-1]
        assert line.startswith("mlx_lm_diffusion.server: error: cannot load --adapter-path"), err[-2000:]
        assert "terminate called" not in err and "Traceback" not in err


# a program that serves in process (mlx_lm_diffusion.serving.startup.start), answers one
# request, shuts the server down in order and returns
SERVE_ONE_REQUEST_AND_RETURN = f"""
import http.client, json, threading
from mlx_lm_diffusion.serving import startup
httpd, generator = startup.start(startup.parse_args(["--model", {str(DEMO_MODEL_PATH)!r}, "--port", "0"]))
threading.Thread(target=httpd.serve_forever, daemon=True).start()
connection = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=120)
body = {{"messages": [{{"role": "user", "content": "357+468="}}], "stream": True}}
connection.request("POST", "/v1/chat/completions", json.dumps(body), {{"Content-Type": "application/json"}})
assert connection.getresponse().read().endswith(b"data: [DONE]\\n\\n")
httpd.shutdown()
httpd.server_close()
generator.stop_and_join()
"""


def test_a_program_that_served_in_process_returns_cleanly():
    """The server's own threads (generation, scheduler, workers) release their MLX streams
    before they end: without it, 3 of 16 such programs aborted at exit (0 of 12 with it)."""
    for r in _run_side_by_side([SERVE_ONE_REQUEST_AND_RETURN] * 4) + _run_side_by_side(
        [SERVE_ONE_REQUEST_AND_RETURN] * 4
    ):
        assert r.returncode == 0, r.stderr[-2000:]
        assert "terminate called" not in r.stderr and "Traceback" not in r.stderr
