"""A fresh server's first request, its kernel cache cold (a new directory: what every start
paid when each server compiled into a private directory of its own) and warm (the per-user
cache a previous start filled), side by side (a benchmark, not a test).

The server runs on the demo as a program; the request is a chat completion with n=2 and
temperature 1 (a batched, sampled decode: the settings that made a first request slow),
timed from its sending to its answer; then the server is stopped with SIGTERM and started
again on the same cache.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python bench/bench_first_request.py
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

BODY = {"messages": [{"role": "user", "content": "357+468="}], "max_tokens": 8, "n": 2, "temperature": 1.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_request(cache: str) -> float:
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": cache, "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm_diffusion.server", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(1200):
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        tic = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        conn.request("POST", "/v1/chat/completions", json.dumps(BODY), {"Content-Type": "application/json"})
        answer = json.loads(conn.getresponse().read())
        seconds = time.perf_counter() - tic
        assert [c["message"]["content"] for c in answer["choices"]], answer
        return seconds
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        cold = first_request(cache)
        warm = first_request(cache)
    print(
        f"first request of a fresh server: cold kernel cache {cold:.2f} s, warm (the previous start's) "
        f"{warm:.2f} s ({cold / warm:.1f}x)"
    )


if __name__ == "__main__":
    main()
