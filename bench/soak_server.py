"""Soak the server with thousands of hostile bodies (issue 13), outside the test suite.

Starts `python -m mlx_lm_diffusion.server` on the embedded demo model (or --model), sends
--requests bodies spread over the three routes from a few concurrent clients (the bodies of
mlx_lm_diffusion/testing/fuzz_bodies.py, seeded), and prints the table of the closing note:

    tried / clean (2xx or 4xx, strict JSON) / 5xx / non-JSON / dropped (no answer, a cut
    connection or stream) / hung (no answer within --timeout) / crashed (the server died)

and, at the end, whether the server still answers a plain request right, and the server's
resident memory (VmRSS) every --rss-every requests: the curve that shows a leak. --route
sends one route's bodies only, to find which kind of request grows it.

    python bench/soak_server.py --requests 3000 --clients 4
    python bench/soak_server.py --requests 2000 --route /v1/completions
"""

import argparse
import collections
import concurrent.futures
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from mlx_lm_diffusion.testing.fuzz_bodies import ROUTES, check_answer, encode, random_body  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "mlx_lm_diffusion" / "demo" / "model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int, within: float = 240) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def send(port: int, route: str, data: bytes, timeout: float) -> str:
    """The outcome of one request: clean, 5xx, non-JSON, dropped or hung."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", route, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
    except socket.timeout:
        return "hung"
    except (OSError, http.client.HTTPException):
        return "dropped"
    finally:
        conn.close()
    problem = check_answer(resp.status, resp.getheader("Content-Type", ""), payload)
    if problem is None:
        return "clean" if resp.status >= 400 else "clean-2xx"
    return "5xx" if problem.startswith("status 5") else "non-JSON"


def rss_mb(pid: int) -> float:
    """The process's resident memory (VmRSS) in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def plain_answer(port: int) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": "357+468="}], "temperature": 0}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    return json.loads(conn.getresponse().read())["choices"][0]["message"]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO))
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--route", choices=ROUTES, default=None, help="send this route's bodies only")
    parser.add_argument("--rss-every", type=int, default=200, help="sample the server's VmRSS every N requests")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="passed on to the server (repeat), e.g. --server-arg=--no-batch",
    )
    args = parser.parse_args()

    port = free_port()
    log = open(os.devnull, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm_diffusion.server", "--model", args.model, "--port", str(port), *args.server_arg],
        stdout=log,
        stderr=log,
    )
    try:
        wait_ready(proc, port)
        before = plain_answer(port)
        rng = random.Random(args.seed)
        jobs = []
        for _ in range(args.requests):
            route = args.route or rng.choice(ROUTES)
            body_rng = random.Random(rng.getrandbits(64))
            jobs.append((route, encode(random_body(body_rng, route), body_rng)))
        tally = collections.Counter()
        rss = [(0, rss_mb(proc.pid))]
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            for done, outcome in enumerate(pool.map(lambda job: send(port, *job, args.timeout), jobs), 1):
                tally[outcome.split("-")[0]] += 1
                tally["2xx"] += outcome == "clean-2xx"
                if done % args.rss_every == 0 and proc.poll() is None:
                    rss.append((done, rss_mb(proc.pid)))
        elapsed = time.monotonic() - started
        crashed = proc.poll() is not None
        after = None if crashed else plain_answer(port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print("| tried | clean (of which 2xx) | 5xx | non-JSON | dropped | hung | crashed | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.requests} | {tally['clean']} ({tally['2xx']}) | {tally['5xx']} | {tally['non-JSON']} | {tally['dropped']} "
        f"| {tally['hung']} | {int(crashed)} | {elapsed:.0f} |"
    )
    print(f"plain request before: {before!r}, after: {after!r}, server exit code {proc.returncode}")
    print("RSS MB by requests done: " + ", ".join(f"{n}: {mb:.0f}" for n, mb in rss))


if __name__ == "__main__":
    main()
