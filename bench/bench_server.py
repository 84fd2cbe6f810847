"""Throughput and latency of the diffusion server under concurrent clients.

    python bench/bench_server.py [--model PATH] [--clients 8] [--requests 4] [--max-tokens 32]

Starts `mlx_lm_diffusion.server` in-process on 127.0.0.1 (a free port) and drives it
with the `openai` client, side by side in one run:

* library: the same decodes called directly (no HTTP), one after another;
* serial:  one client, one request at a time;
* concurrent: `--clients` clients, each sending `--requests` requests back to back.

Reports requests/s and p50/p95 latency of each, and the ratios. Without --model a
tiny random LLaDA checkpoint (tests/checkpoints.py) is written to a temporary folder.
Diffusion requests are served one at a time, so concurrent latency includes queueing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path


def percentile(values, q):
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summary(name, latencies, wall):
    return {
        "mode": name,
        "requests": len(latencies),
        "req_per_s": len(latencies) / wall,
        "p50_s": percentile(latencies, 0.5),
        "p95_s": percentile(latencies, 0.95),
        "mean_s": statistics.fmean(latencies),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Checkpoint to serve (default: a tiny random LLaDA)")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="Requests per client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", default=None, help="Also write the figures to this file")
    args = p.parse_args(argv)

    import openai
    from transformers.utils import logging as hf_logging

    from mlx_lm_diffusion import compat, server

    hf_logging.set_verbosity_error()
    tmp = tempfile.TemporaryDirectory()
    model_path = args.model
    if model_path is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from checkpoints import write_llada

        model_path = str(write_llada(Path(tmp.name) / "llada"))

    server_args = server.parse_args(
        ["--model", model_path, "--port", "0", "--max-tokens", str(args.max_tokens),
         "--log-level", "WARNING"]
    )
    httpd, generator = server.start(server_args)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{httpd.server_address[1]}/v1",
                           api_key="unused", max_retries=0, timeout=600)
    total = args.clients * args.requests
    prompts = [[{"role": "user", "content": f"Question number {i}: what happens next?"}]
               for i in range(total)]

    def ask(messages):
        tic = time.perf_counter()
        r = client.chat.completions.create(model="default_model", messages=messages, temperature=0)
        return time.perf_counter() - tic, r.usage.completion_tokens

    try:
        ask(prompts[0])  # loads the model, warms up
        model, tok = generator.model_provider.model, generator.model_provider.tokenizer

        lib = []
        tic = time.perf_counter()
        for messages in prompts:
            t = time.perf_counter()
            ids = tok.apply_chat_template(messages, add_generation_prompt=True)
            for _ in compat.stream_generate(model, tok, ids, max_tokens=args.max_tokens):
                pass
            lib.append(time.perf_counter() - t)
        rows = [summary("library", lib, time.perf_counter() - tic)]

        tic = time.perf_counter()
        serial = [ask(m)[0] for m in prompts]
        rows.append(summary("serial", serial, time.perf_counter() - tic))

        def client_run(c):
            return [ask(prompts[c * args.requests + i])[0] for i in range(args.requests)]

        tic = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            together = [t for ts in pool.map(client_run, range(args.clients)) for t in ts]
        rows.append(summary(f"concurrent x{args.clients}", together, time.perf_counter() - tic))
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        tmp.cleanup()

    print(f"model: {model_path}  max_tokens: {args.max_tokens}  requests per mode: {total}")
    print(f"{'mode':<16}{'req/s':>9}{'p50 s':>9}{'p95 s':>9}{'mean s':>9}")
    for r in rows:
        print(f"{r['mode']:<16}{r['req_per_s']:>9.2f}{r['p50_s']:>9.3f}{r['p95_s']:>9.3f}{r['mean_s']:>9.3f}")
    lib_rps, serial_rps, conc_rps = (r["req_per_s"] for r in rows)
    print(f"serial server / library throughput: {serial_rps / lib_rps:.2f}")
    print(f"concurrent / serial throughput:     {conc_rps / serial_rps:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
