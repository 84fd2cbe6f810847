"""Throughput and latency of the diffusion server under concurrent clients, batched
(continuous batching, mlx_lm_diffusion.serving.scheduler) against one request at a time (--no-batch).

    python bench/bench_server.py [--clients 1 4 8 16] [--requests 16] [--max-tokens 32]
                                 [--models sdar llada llada-fast nemotron-spec]

Side by side in one run, for each micro model (tiny random checkpoints written by
mlx_lm_diffusion/testing: SDAR with block 4, LLaDA with block 32, and with --models
llada-fast the same LLaDA with Fast-dLLM's preset: dual cache, threshold 0.9, nemotron-spec a
partly predictable Nemotron-Labs Diffusion with self-speculation, windows up to 32) two servers run
in-process on 127.0.0.1, one batched and one with --no-batch; at each client count both
serve the same `--requests` streamed chat requests (prompt lengths and max_tokens vary a
little; temperature 0), the batched server first, then the serial one. Reported per
mode: requests/s, generated tokens/s, p50/p95 latency, p50/p95 time to first token, and
batched/serial throughput ratios. Then the second turn of a chat with a ~--history-token
history (bench_kv_reuse.second_turn: SDAR, a larger micro model), cold (prompt cache
emptied) and reusing the first turn's KV, through the batched server and the serial one:
prefill (request -> first draft), time to first token, total, cached tokens, and whether
the texts agree. Timings on a shared CPU are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence


def percentile(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


MODELS = {
    "sdar": "SDAR (block 4)",
    "llada": "LLaDA (block 32)",
    "llada-fast": "LLaDA (fast preset)",
    "nemotron-spec": "Nemotron (self_spec)",
}


def checkpoints(folder: Path, models: Sequence[str] = ("sdar", "llada")) -> dict:
    """{name: (checkpoint, request fields)} of the chosen `models` (MODELS' keys)."""
    from mlx_lm_diffusion.testing.block_checkpoints import write_sdar
    from mlx_lm_diffusion.testing.checkpoints import write_llada
    from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_speculable_nemotron

    llada = str(write_llada(folder / "llada")) if {"llada", "llada-fast"} & set(models) else None
    chosen = {
        "sdar": lambda: (str(write_sdar(folder / "sdar")), {}),
        "llada": lambda: (llada, {"block_length": 32}),
        "llada-fast": lambda: (llada, {"preset": "fast"}),
        # (drafts partly accepted, as a trained model's are: mlx_lm_diffusion/testing/nemotron_gemma_checkpoints.py)
        "nemotron-spec": lambda: (
            str(write_speculable_nemotron(folder / "nemotron_spec", attractors=tuple(range(40, 48)), strength=0.45)),
            {"self_spec": True, "block_length": 32},
        ),
    }
    return {MODELS[m]: chosen[m]() for m in models}


class Server:
    """One in-process server and an openai client for it."""

    def __init__(self, model_path: str, max_tokens: int, batched: bool):
        import openai

        from mlx_lm_diffusion.serving import startup as server

        flags = ["--model", model_path, "--port", "0", "--max-tokens", str(max_tokens), "--log-level", "WARNING"]
        self.httpd, self.generator = server.start(server.parse_args(flags + ([] if batched else ["--no-batch"])))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.httpd.server_address[1]}/v1", api_key="unused", max_retries=0, timeout=600
        )

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.generator.stop_and_join()

    def ask(self, kw: dict) -> tuple:
        """(latency, time to first token, completion tokens) of one streamed request."""
        tic, first, tokens = time.perf_counter(), None, 0
        stream = self.client.chat.completions.create(
            model="default_model", stream=True, stream_options={"include_usage": True}, **kw
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - tic
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        latency = time.perf_counter() - tic
        return latency, first if first is not None else latency, tokens


def requests(n: int, max_tokens: int, fields: dict) -> list:
    return [
        dict(
            messages=[{"role": "user", "content": "Question " + "and more " * (i % 4) + f"{i}: what next?"}],
            max_tokens=max_tokens - (i % 3) * 4,
            temperature=0.0,
            extra_body=fields,
        )
        for i in range(n)
    ]


def measure(server: Server, batch: list, clients: int) -> dict:
    tic = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(server.ask, batch))
    wall = time.perf_counter() - tic
    latencies, ttfts, tokens = zip(*results)
    return {
        "req_per_s": len(batch) / wall,
        "tok_per_s": sum(tokens) / wall,
        "p50_s": percentile(latencies, 0.5),
        "p95_s": percentile(latencies, 0.95),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p95_s": percentile(ttfts, 0.95),
    }


def bench_model(name: str, path: str, fields: dict, args) -> list:
    servers = {"batched": Server(path, args.max_tokens, True), "serial": Server(path, args.max_tokens, False)}
    rows = []
    try:
        for server in servers.values():  # warm up both
            server.ask(requests(1, args.max_tokens, fields)[0])
        for clients in args.clients:
            batch = requests(args.requests, args.max_tokens, fields)
            for mode, server in servers.items():
                rows.append({"model": name, "clients": clients, "mode": mode, **measure(server, batch, clients)})
                print_row(rows[-1], flush=True)
    finally:
        for server in servers.values():
            server.close()
    return rows


HEADER = (
    f"{'model':<20}{'clients':>8}{'mode':>9}{'req/s':>8}{'tok/s':>9}{'p50 s':>8}{'p95 s':>8}{'ttft50':>8}{'ttft95':>8}"
)


def print_row(r: dict, flush: bool = False) -> None:
    print(
        f"{r['model']:<20}{r['clients']:>8}{r['mode']:>9}{r['req_per_s']:>8.2f}{r['tok_per_s']:>9.1f}"
        f"{r['p50_s']:>8.2f}{r['p95_s']:>8.2f}{r['ttft_p50_s']:>8.2f}{r['ttft_p95_s']:>8.2f}",
        flush=flush,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--requests", type=int, default=16, help="Requests per client count and mode")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--history", type=int, default=1000, help="Second-turn history, tokens (0: skip)")
    p.add_argument("--json", default=None, help="Also write the figures to this file")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["sdar", "llada"])
    args = p.parse_args(argv)

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print(HEADER, flush=True)
        for name, (path, fields) in checkpoints(Path(tmp), args.models).items():
            rows += bench_model(name, path, fields, args)
    print(f"\nmax_tokens {args.max_tokens}, {args.requests} streamed requests per client count and mode\n")
    print(HEADER)
    for r in rows:
        print_row(r)
    print("\nbatched / serial generated tok/s:")
    for r in rows:
        if r["mode"] == "batched":
            serial = next(
                s for s in rows if s["model"] == r["model"] and s["clients"] == r["clients"] and s["mode"] == "serial"
            )
            print(f"  {r['model']:<20} {r['clients']:>2} clients: {r['tok_per_s'] / serial['tok_per_s']:.2f}x")
    if args.history:
        turns = second_turns(args)
        print(
            f"\nsecond chat turn, ~{args.history}-token history, 16 new tokens (SDAR micro model "
            f"{turns[0]['size']}), median of 3; prefill = request -> first draft (first forward)"
        )
        print(
            f"{'server':9}{'prompt':>7}{'cached':>7}{'prefill cold':>13}{'reuse':>7}{'ratio':>7}"
            f"{'ttft cold':>10}{'reuse':>7}{'total cold':>11}{'reuse':>7}{'same':>6}"
        )
        for r in turns:
            print(
                f"{r['mode']:9}{r['prompt_tokens']:>7}{r['cached_reuse']:>7}{r['cold_first_draft']:>13.3f}"
                f"{r['reuse_first_draft']:>7.3f}{r['reuse_first_draft'] / r['cold_first_draft']:>7.2f}"
                f"{r['cold_first_token']:>10.3f}{r['reuse_first_token']:>7.3f}{r['cold_total']:>11.3f}"
                f"{r['reuse_total']:>7.3f}{str(r['same_text']):>6}"
            )
        rows += turns
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def second_turns(args) -> list:
    """Second-turn latency, cold and with KV reuse, batched and serial (bench_kv_reuse)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_kv_reuse

    from mlx_lm_diffusion.testing.block_checkpoints import write_sdar

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_sdar(Path(tmp) / "sdar", head_dim=32, inter=512, max_len=4096, **bench_kv_reuse.SIZE)
        for mode, flags in (("batched", ()), ("serial", ("--no-batch",))):
            r = bench_kv_reuse.second_turn("sdar", path, args.history, 16, 3, flags)
            out.append({"mode": mode, "size": bench_kv_reuse.SIZE, **r})
    return out


if __name__ == "__main__":
    sys.exit(main())
