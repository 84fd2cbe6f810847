"""A diffusion server in this process on 127.0.0.1:<free port>, for the server tests."""

import contextlib
import http.client
import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.serving import startup as dserver

TIMEOUT = 120


@contextlib.contextmanager
def running_server(argv):
    """(httpd, response generator) of `mlx_lm_diffusion.server argv`, shut down after."""
    httpd, generator = dserver.start(dserver.parse_args(list(argv)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd, generator
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        thread.join(timeout=TIMEOUT)
        mld.uninstall()


def demo_server(mode: str):
    """The demo served batched (`mode` "batched") or one request at a time ("serial")."""
    from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

    flags = [] if mode == "batched" else ["--no-batch"]
    return running_server(["--model", str(DEMO_MODEL_PATH), "--port", "0", "--log-level", "WARNING", *flags])


def post_json(port: int, path: str, body, timeout: float = TIMEOUT):
    """(status, JSON answer) of one POST of `body` to 127.0.0.1:`port` `path`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def get_json(port: int, path: str, timeout: float = TIMEOUT):
    """The JSON answer of one GET of 127.0.0.1:`port` `path`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, port: int, within: float, why=lambda: "") -> None:
    """Until the server process `proc` answers GET /health with 200 on `port` (it must not exit)."""
    deadline = time.monotonic() + within
    while True:
        assert proc.poll() is None, why()
        assert time.monotonic() < deadline, "server did not come up"
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.5)


@contextlib.contextmanager
def console_server(command, env, log, ready_within=240):
    """The server as its own process (`command` + --port), on 127.0.0.1; yields the port once
    /health answers 200, and stops the process after (its output goes to `log`)."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([*command, "--port", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, port, ready_within, lambda: Path(log).read_text()[-2000:])
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
