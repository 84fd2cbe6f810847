"""A normal client's wait while hostile requests of each kind run (issue 33), outside the tests.

Starts `python -m mlx_lm_diffusion.server` (from the current directory's checkout: run it
from another worktree to measure another commit) on a tiny random LLaDA wide enough that a
forward costs something, then, per kind of hostile load, runs that load for --seconds while
one normal client sends short chat requests one after another (or the kind's own victim: a
long request beside much longer ones, a completion, GET /health), and prints per kind: the
normal requests' p50 / p99 / max wait, how many completed, the p50's ratio to the same
victim's p50 with no load (where that phase ran), and the server's threads and resident
memory (from /proc) at the end of the phase. Two kinds are not a body sent again and again:
9.9 MB prompts (under the 10 MB body limit; far past the model's context) and 520 idle
sockets held open from 127.0.0.2 (reopened as the server closes them; the victims connect
from 127.0.0.1).

    python bench/hostile_server.py --seconds 30
    (cd /tmp/before && python /work/main/bench/hostile_server.py --seconds 30)   # another commit
"""

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mlx_lm_diffusion.testing.checkpoints import write_llada  # noqa: E402

# (a valid InferenceRequest: an earlier version named the field "prompt", and its "protocol
# flood" was a flood of 400s)
PROMPT = {
    "prompt_tokens": [72, 101, 108, 108, 111],
    "target_length": 5 + 4,
    "num_steps": 4,
    "mask_schedule": "linear",
    "temperature_schedule": [0.0] * 4,
    "top_p": 1.0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: bytes, timeout: float = 300):
    """The status of one request (POST `body`, or GET where `body` is None), None if none came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def chat(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "Hi"}], **fields}).encode()


def protocol_body(forwards: int) -> dict:
    """A step-schedule request that takes `forwards` forwards (one position committed per step)."""
    return {
        **PROMPT,
        "target_length": len(PROMPT["prompt_tokens"]) + forwards,
        "num_steps": forwards,
        "temperature_schedule": [0.0] * forwards,
    }


# a prompt of 9.9 MB, under the server's 10 MB body limit (issue 55.1: tokenized in full, 15-30 s
# each, while a normal request waited 15.1 s and a chat 29.5 s)
HUGE_PROMPT = json.dumps({"prompt": "Hello " * 1_650_000, "max_tokens": 8}).encode()
IDLE_SOCKETS = 520  # held open from 127.0.0.2 (issue 55.3: everyone 503, /health 503, until they closed)
COMPLETION = json.dumps({"prompt": "Hi", "max_tokens": 8}).encode()

# each kind: (threads, the body a hostile thread sends again and again, the route); IDLE: held sockets
IDLE = "idle sockets"
KINDS = {
    "none": (0, None, None),
    "protocol flood": (4, json.dumps(PROMPT).encode(), "/v1/diffusion/generate"),
    "400,000 stop strings": (2, chat(stop=[f"s{i}" for i in range(400_000)], max_tokens=8), "/v1/chat/completions"),
    "long requests at the bound": (32, chat(max_tokens=512, block_length=32, steps=32), "/v1/chat/completions"),
    "lone decodes (suffix)": (
        2,
        json.dumps(
            {"prompt": "Hello", "suffix": " world", "max_tokens": 256, "block_length": 32, "steps": 32}
        ).encode(),
        "/v1/completions",
    ),
    "7 MB bad protocol bodies": (
        2,
        (json.dumps({**PROMPT, "pad": "x" * 7_000_000})[:-1] + ', "num_steps": -1}').encode(),
        "/v1/diffusion/generate",
    ),
    # a long request alone, then beside 32 much longer ones: 24 and 120 forwards, which are the
    # issue's 300 behind 16,384 at this bench's --long-request-forwards 16 (the server's default
    # 256 would make each a canvas this machine decodes in minutes)
    "none (victim: 24 forwards)": (0, None, None),
    "120-forward requests (victim: 24)": (32, json.dumps(protocol_body(120)).encode(), "/v1/diffusion/generate"),
    "none (victim: completion)": (0, None, None),
    "none (victim: /health)": (0, None, None),
    "9.9 MB prompts": (2, HUGE_PROMPT, "/v1/completions"),
    "9.9 MB prompts (victim: completion)": (2, HUGE_PROMPT, "/v1/completions"),
    f"{IDLE_SOCKETS} idle sockets from 127.0.0.2": (IDLE_SOCKETS, IDLE, None),
    f"{IDLE_SOCKETS} idle sockets from 127.0.0.2 (victim: /health)": (IDLE_SOCKETS, IDLE, None),
}
# a kind's own victim (the normal client's request, route), where it is not a short chat
LONG_VICTIM = (json.dumps(protocol_body(24)).encode(), "/v1/diffusion/generate")
VICTIMS = {
    "none (victim: 24 forwards)": LONG_VICTIM,
    "120-forward requests (victim: 24)": LONG_VICTIM,
    "none (victim: completion)": (COMPLETION, "/v1/completions"),
    "9.9 MB prompts (victim: completion)": (COMPLETION, "/v1/completions"),
    "none (victim: /health)": (None, "/health"),
    f"{IDLE_SOCKETS} idle sockets from 127.0.0.2 (victim: /health)": (None, "/health"),
}
ALONE = {}  # a kind -> the kind that measures its victim with no load (its ratio's denominator)
for _kind in KINDS:
    _victim = VICTIMS.get(_kind)
    ALONE[_kind] = next((k for k in KINDS if k.startswith("none") and VICTIMS.get(k) == _victim), None)


def hold_idle_sockets(port: int, count: int, stop: threading.Event) -> None:
    """Keep `count` connections from 127.0.0.2 open, sending nothing; those the server closed
    (or answered: a 503) are opened again once a second."""
    import select

    def connect():
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.settimeout(5)
        try:
            sock.connect(("127.0.0.1", port))
        except OSError:
            sock.close()
            return None
        return sock

    held = [s for s in (connect() for _ in range(count)) if s is not None]
    while not stop.wait(1.0):  # (once a second: a refill, not a storm of reconnections)
        readable, _, _ = select.select(held, [], [], 0) if held else ([], [], [])
        for sock in readable:  # (closed, or answered: either way no longer idle)
            held.remove(sock)
            sock.close()
        while len(held) < count and not stop.is_set():
            sock = connect()
            if sock is None:
                break
            held.append(sock)
    for sock in held:
        sock.close()


def proc_status(pid: int) -> dict:
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            fields[name] = value.strip()
    return {"threads": int(fields["Threads"]), "rss_mb": int(fields["VmRSS"].split()[0]) / 1024}


def phase(port: int, pid: int, kind: str, seconds: float) -> dict:
    count, body, route = KINDS[kind]
    stop = threading.Event()

    def hostile():
        while not stop.is_set():
            post(port, route, body, timeout=seconds + 5)

    if body is IDLE:
        threads = [threading.Thread(target=hold_idle_sockets, args=(port, count, stop), daemon=True)]
    else:
        threads = [threading.Thread(target=hostile, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    time.sleep(min(2.0, seconds / 10) if count else 0)  # (the load is on before the first normal request)
    waits = []
    victim, victim_route = VICTIMS.get(kind, (chat(max_tokens=8), "/v1/chat/completions"))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        started = time.monotonic()
        status = post(port, victim_route, victim, timeout=seconds * 4)
        waits.append(time.monotonic() - started if status == 200 else float("inf"))
    figures = proc_status(pid)
    stop.set()
    for thread in threads:
        thread.join(timeout=seconds + 10)
    waits.sort()
    done = [w for w in waits if w != float("inf")]
    return {
        "kind": kind,
        "normal requests": len(done),
        "failed": len(waits) - len(done),
        "p50 s": waits[len(waits) // 2] if waits else None,
        "p99 s": waits[min(len(waits) - 1, int(len(waits) * 0.99))] if waits else None,
        "max s": waits[-1] if waits else None,
        **figures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="each phase's length")
    parser.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    args = parser.parse_args()
    model = write_llada(Path(tempfile.mkdtemp()) / "llada", d_model=256, n_layers=4, max_len=2048)
    port = free_port()
    # (the long victims' kinds are measured at --long-request-forwards 16; the others at the server's default)
    flags = ["--long-request-forwards", "16"] if any(VICTIMS.get(k) == LONG_VICTIM for k in args.kinds) else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_lm_diffusion.server", "--model", str(model), "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while post(port, "/v1/chat/completions", chat(max_tokens=1), timeout=30) != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        rows = [phase(port, proc.pid, kind, args.seconds) for kind in args.kinds]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(f"commit {os.popen('git rev-parse --short HEAD').read().strip()}, {args.seconds:.0f} s per phase")
    alone = {r["kind"]: r["p50 s"] for r in rows}
    print("| hostile load | normal requests | failed | p50 s | p99 s | max s | p50 / alone | threads | RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = alone.get(ALONE[r["kind"]])
        ratio = f"{r['p50 s'] / base:.1f}x" if base and r["kind"] != ALONE[r["kind"]] else ""
        print(
            f"| {r['kind']} | {r['normal requests']} | {r['failed']} | {r['p50 s']:.3f} | {r['p99 s']:.3f} "
            f"| {r['max s']:.3f} | {ratio} | {r['threads']} | {r['rss_mb']:.0f} |"
        )


if __name__ == "__main__":
    main()
