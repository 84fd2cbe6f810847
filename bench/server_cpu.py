"""CPU time per generated token of the diffusion server under concurrent clients, by thread:
batched (mlx_lm_diffusion.serving.scheduler) and --no-batch, alternating, in one process as
bench/bench_server.py runs them (the servers and the openai clients share the process).

    python bench/server_cpu.py [--model sdar] [--clients 8] [--requests 32] [--rounds 3] [--profile]

Per round and mode: generated tok/s, wall ms per token and CPU ms per token (the process's
and each thread kind's, read from /proc/self/task/*/stat before and after the round:
the scheduler thread, the serial generation thread, the HTTP handler threads, the openai
client threads, and the threads Python did not start, i.e. MLX's and OpenBLAS's). Then
the batched / serial tok/s ratio of each round and their median. `--profile`: cProfile
of the scheduler thread during the last batched round (top functions by own time).
Timings on a shared CPU are noisy: compare the modes round by round.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_server import MODELS, Server, checkpoints, requests  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def stat_cpu(path: str) -> float:
    """CPU seconds (user + system) in a /proc stat file (fields after the command's ')')."""
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu() -> dict:
    """native thread id -> CPU seconds (user + system) of this process's threads."""
    out = {}
    for task in os.listdir("/proc/self/task"):
        try:
            out[int(task)] = stat_cpu(f"/proc/self/task/{task}/stat")
        except OSError:  # (the thread ended meanwhile)
            continue
    return out


def kind(name: str) -> str:
    if name == "diffusion-scheduler":
        return "scheduler"
    if name.startswith("ThreadPoolExecutor"):
        return "clients"
    if "process_request_thread" in name or name.startswith("Thread-") and "(process_request" in name:
        return "http"
    return "python other"


def by_kind(before: dict, after: dict, names: dict) -> dict:
    out: dict = {}
    for tid, cpu in after.items():
        spent = cpu - before.get(tid, 0.0)
        k = names.get(tid)
        label = kind(k) if k is not None else "native (MLX, BLAS)"
        out[label] = out.get(label, 0.0) + spent
    return out


class NameLog:
    """Native id -> Python thread name of every thread started while it runs (HTTP threads
    end with their request: their names are caught by a sampler)."""

    def __init__(self):
        self.names: dict = {}
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            self.snap()
            time.sleep(0.05)

    def snap(self):
        for t in threading.enumerate():
            if t.native_id is not None:
                self.names[t.native_id] = t.name


def process_cpu() -> float:
    return stat_cpu("/proc/self/stat")


def run_round(server: Server, batch: list, clients: int, names: NameLog) -> dict:
    client_cpu = []

    def ask(kw):  # (the client's own CPU: its thread ends with the pool, /proc loses it)
        tic = time.thread_time()
        try:
            return server.ask(kw)
        finally:
            client_cpu.append(time.thread_time() - tic)

    names.snap()
    before, total0, tic = thread_cpu(), process_cpu(), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(ask, batch))
    wall = time.perf_counter() - tic
    names.snap()
    after, total1 = thread_cpu(), process_cpu()
    tokens = sum(r[2] for r in results)
    kinds = by_kind(before, after, names.names)
    kinds.pop("clients", None)
    kinds["clients"] = sum(client_cpu)
    # (threads that ended during the round, less the clients': the HTTP handler threads)
    kinds["ended (http)"] = max(0.0, total1 - total0 - sum(kinds.values()))
    return {
        "tok_per_s": tokens / wall,
        "wall_ms": 1e3 * wall / tokens,
        "cpu_ms": {k: 1e3 * v / tokens for k, v in kinds.items()},
        "cores": sum(kinds.values()) / wall,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="sdar", choices=list(MODELS))
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s)")
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    names = NameLog()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        [(name, (path, fields))] = checkpoints(Path(tmp), [args.model]).items()
        servers = {"batched": Server(path, args.max_tokens, True), "serial": Server(path, args.max_tokens, False)}
        try:
            for server in servers.values():  # warm up both (the batched one: every row count it will see)
                run_round(server, requests(args.requests, args.max_tokens, fields), args.clients, names)
            print(
                f"{name}, {args.clients} clients, {args.requests} streamed requests per round and mode, "
                f"load {open('/proc/loadavg').read().split()[:3]}",
                flush=True,
            )
            for round_ in range(args.rounds):
                figures = {}
                for mode, server in servers.items():
                    profiler = None
                    if args.profile and mode == "batched" and round_ == args.rounds - 1:
                        profiler = profile_scheduler(server)
                    figures[mode] = run_round(
                        server, requests(args.requests, args.max_tokens, fields), args.clients, names
                    )
                    if profiler is not None:
                        profiler()
                    f = figures[mode]
                    cpu = f["cpu_ms"]
                    parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
                    print(
                        f"round {round_ + 1} {mode:>8}: {f['tok_per_s']:6.1f} tok/s, wall {f['wall_ms']:.2f} ms/tok, "
                        f"CPU {sum(cpu.values()):.2f} ms/tok on {f['cores']:.2f} cores ({parts})",
                        flush=True,
                    )
                ratios.append(figures["batched"]["tok_per_s"] / figures["serial"]["tok_per_s"])
                print(
                    f"round {round_ + 1} ratio {ratios[-1]:.2f}x, load {open('/proc/loadavg').read().split()[:3]}",
                    flush=True,
                )
        finally:
            names.stop = True
            for server in servers.values():
                server.close()
    print(f"batched / serial tok/s: {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}x")
    return 0


def profile_scheduler(server: Server):
    """Start cProfile in the batched server's scheduler thread; returns the stopper (prints)."""
    import cProfile
    import pstats

    scheduler = server.generator.scheduler
    profiler = cProfile.Profile()
    state = {"on": True}
    original = scheduler._step

    def step(group):
        if state["on"]:
            profiler.enable()
            try:
                return original(group)
            finally:
                profiler.disable()
        return original(group)

    scheduler._step = step

    def stop():
        state["on"] = False
        scheduler._step = original
        pstats.Stats(profiler).sort_stats("tottime").print_stats(30)

    return stop


if __name__ == "__main__":
    sys.exit(main())
