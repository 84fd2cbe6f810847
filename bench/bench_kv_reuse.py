"""Second-turn latency of a chat with a long history, with and without prompt KV reuse
(a benchmark, not a test).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python bench/bench_kv_reuse.py [--history 1000] [--max-tokens 16] [--repeats 3]

For each micro model (random weights, mlx_lm_diffusion.testing layouts) an in-process
`mlx_lm_diffusion.server` gets a chat of about --history prompt tokens, then its second
turn (the history, the model's reply, a new user message), streamed with `"drafts": true`
so that the first forward is visible as the first draft comment (and the same through the
library, compat.stream_generate over mlx-lm's LRUPromptCache, without HTTP):

* cold:  the second turn with the prompt cache emptied first (a full prefill);
* reuse: the second turn right after the first turn (its KV is in the cache).

Side by side, alternated, median of --repeats: prefill (request sent -> first draft, i.e.
the first forward: the prompt not cached plus the first block), time to first token and
total latency, with the ratio reuse / cold; the cached tokens the server reports; and
whether both gave the same text (they must).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

SIZE = dict(hidden=256, n_layers=4, n_heads=8, n_kv_heads=4)
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
    "boxing matches near the old harbour and count every cloud "
).split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n_words))


def conversation(tokenizer, history: int) -> list:
    """System + user/assistant pairs + a user message, about `history` prompt tokens."""
    messages = [{"role": "system", "content": text(30, 0)}]
    seed = 1
    while len(tokenizer.apply_chat_template(messages, add_generation_prompt=True)) < history - 60:
        messages += [{"role": "user", "content": text(8, seed)}, {"role": "assistant", "content": text(10, seed + 1)}]
        seed += 2
    return messages + [{"role": "user", "content": text(8, seed)}]


def stream(port: int, messages: list, max_tokens: int) -> dict:
    """One streamed chat request: seconds to the first draft (first forward), to the first
    token and to the end; the text; the cached tokens usage reports."""
    body = json.dumps(
        {
            "model": "default_model",
            "messages": messages,
            "stream": True,
            "drafts": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    out = {"first_draft": None, "first_token": None, "text": "", "cached": None}
    tic = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    while True:
        line = response.readline().decode()
        if not line:
            break
        now = time.perf_counter() - tic
        if line.startswith(": draft") and out["first_draft"] is None:
            out["first_draft"] = now
        if not line.startswith("data: ") or line.strip() == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices", []):
            content = choice.get("delta", {}).get("content")
            if content:
                out["first_token"] = out["first_token"] or now
                out["text"] += content
        if chunk.get("usage"):
            out["cached"] = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
            out["prompt"] = chunk["usage"]["prompt_tokens"]
    out["total"] = time.perf_counter() - tic
    conn.close()
    return out


def library_turn(model, tokenizer, lru, ids: list, max_tokens: int) -> dict:
    """The server's path without HTTP: the nearest cache from `lru` (mlx-lm's
    LRUPromptCache), compat.stream_generate over it, the cache put back. Seconds to the
    first forward's step (the prefill: the prompt not cached plus the first block's first
    forward) and to the end; the tokens."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_diffusion.api import compat

    cache, rest = lru.fetch_nearest_cache("m", ids)
    cache = cache if cache is not None else make_prompt_cache(model)
    out = {"first_step": None, "cached": []}
    tic = time.perf_counter()

    def on_step(step):
        out["first_step"] = out["first_step"] or time.perf_counter() - tic

    tokens = [
        r.token
        for r in compat.stream_generate(
            model,
            tokenizer,
            rest,
            max_tokens=max_tokens,
            prompt_cache=cache,
            draft_callback=on_step,
            cached_tokens_callback=out["cached"].append,
        )
    ]
    out["total"] = time.perf_counter() - tic
    lru.insert_cache("m", ids + tokens, cache)
    out["tokens"], out["cached"] = tokens, out["cached"][0]
    return out


def library_second_turn(path: Path, history: int, max_tokens: int, repeats: int) -> dict:
    from mlx_lm.models.cache import LRUPromptCache

    import mlx_lm_diffusion as mld

    model, tokenizer = mld.load(str(path))
    first = tokenizer.apply_chat_template(conversation(tokenizer, history), add_generation_prompt=True)
    lru = LRUPromptCache()
    reply = library_turn(model, tokenizer, lru, first, max_tokens)["tokens"]
    turn = first + reply + tokenizer.encode(text(8, 99), add_special_tokens=False)
    library_turn(model, tokenizer, LRUPromptCache(), turn, max_tokens)  # warm-up
    runs = {"cold": [], "reuse": []}
    for _ in range(repeats):
        runs["cold"].append(library_turn(model, tokenizer, LRUPromptCache(), turn, max_tokens))
        lru = LRUPromptCache()
        library_turn(model, tokenizer, lru, first, max_tokens)  # the first turn leaves its KV
        runs["reuse"].append(library_turn(model, tokenizer, lru, turn, max_tokens))
    same = len({tuple(r["tokens"]) for rs in runs.values() for r in rs}) == 1
    med = {
        f"lib_{m}_{k}": statistics.median(r[k] for r in rs) for m, rs in runs.items() for k in ("first_step", "total")
    }
    return {"lib_prompt": len(turn), "lib_cached": runs["reuse"][0]["cached"], "lib_same_tokens": same, **med}


def second_turn(name: str, path: Path, history: int, max_tokens: int, repeats: int, flags: tuple = ()) -> dict:
    """`flags`: more server flags (bench_server.py passes --no-batch for the serial path)."""
    import mlx_lm_diffusion as mld
    from mlx_lm_diffusion.serving import startup as server

    tokenizer = mld.load(str(path))[1]
    args = server.parse_args(
        ["--model", str(path), "--port", "0", "--max-tokens", str(max_tokens), "--log-level", "WARNING", *flags]
    )
    httpd, generator = server.start(args)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    port = httpd.server_address[1]
    try:
        first = conversation(tokenizer, history)
        reply = stream(port, first, max_tokens)["text"]
        turn = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": text(8, 99)}]
        stream(port, turn, max_tokens)  # warm-up (compiles the shapes)
        runs = {"cold": [], "reuse": []}

        def empty_cache():
            # (the generation thread stores a request's cache after its last event, holding
            # decode_lock: wait for it, or the entry lands after the emptying)
            with generator.decode_lock:
                generator.prompt_cache.trim_to(n_sequences=0)

        for _ in range(repeats):
            empty_cache()  # cold: nothing cached
            runs["cold"].append(stream(port, turn, max_tokens))
            empty_cache()
            stream(port, first, max_tokens)  # the first turn leaves its KV in the cache
            runs["reuse"].append(stream(port, turn, max_tokens))
    finally:
        httpd.shutdown()
        httpd.server_close()
        generator.stop_and_join()
        mld.uninstall()
    med = {
        mode: {k: statistics.median(r[k] for r in rs) for k in ("first_draft", "first_token", "total")}
        for mode, rs in runs.items()
    }
    texts = {r["text"] for rs in runs.values() for r in rs}
    return {
        "model": name,
        "prompt_tokens": runs["cold"][0]["prompt"],
        "cached_cold": runs["cold"][0]["cached"],
        "cached_reuse": runs["reuse"][0]["cached"],
        "same_text": len(texts) == 1,
        **{f"{m}_{k}": v for m, d in med.items() for k, v in d.items()},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--history", type=int, default=1000, help="Prompt tokens of the second turn, about")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default="sdar,llada2,nemotron", help="Any of sdar, llada2, nemotron")
    p.add_argument("--json", default=None, help="Also write the figures to this file")
    args = p.parse_args(argv)

    from transformers.utils import logging as hf_logging

    from mlx_lm_diffusion.testing.block_checkpoints import write_llada2, write_sdar
    from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_nemotron

    hf_logging.set_verbosity_error()
    writers = {
        "sdar": lambda d: write_sdar(d, head_dim=32, inter=512, max_len=4096, **SIZE),
        "llada2": lambda d: write_llada2(d, inter=512, moe_inter=128, max_len=4096, **SIZE),
        "nemotron": lambda d: write_nemotron(d, head_dim=32, inter=512, max_len=4096, **SIZE),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = writers[name](Path(tmp) / name)
            rows.append(
                {
                    **second_turn(name, path, args.history, args.max_tokens, args.repeats),
                    **library_second_turn(path, args.history, args.max_tokens, args.repeats),
                }
            )
            print(json.dumps(rows[-1]), flush=True)

    print(
        f"\nsecond chat turn, ~{args.history}-token history, {args.max_tokens} new tokens, micro models {SIZE}, "
        f"median of {args.repeats}"
    )
    print(
        "library (compat.stream_generate over mlx-lm's LRUPromptCache, no HTTP): prefill = call -> first forward's step"
    )
    print(
        f"{'model':9} {'prompt':>6} {'cached':>6} {'prefill cold':>12} {'reuse':>7} {'ratio':>6} "
        f"{'total cold':>10} {'reuse':>7} {'ratio':>6} {'same':>5}"
    )
    for r in rows:
        print(
            f"{r['model']:9} {r['lib_prompt']:6d} {r['lib_cached']:6d} {r['lib_cold_first_step']:12.3f} "
            f"{r['lib_reuse_first_step']:7.3f} {r['lib_reuse_first_step'] / r['lib_cold_first_step']:6.2f} "
            f"{r['lib_cold_total']:10.3f} {r['lib_reuse_total']:7.3f} {r['lib_reuse_total'] / r['lib_cold_total']:6.2f} "
            f"{str(r['lib_same_tokens']):>5}"
        )
    print("server (openai-style SSE with drafts): prefill = request sent -> first draft; ttft; total")
    print(
        f"{'model':9} {'prompt':>6} {'cached':>6} {'prefill cold':>12} {'reuse':>7} {'ratio':>6} "
        f"{'ttft cold':>9} {'reuse':>7} {'total cold':>10} {'reuse':>7} {'ratio':>6} {'same':>5}"
    )
    for r in rows:
        print(
            f"{r['model']:9} {r['prompt_tokens']:6d} {r['cached_reuse']:6d} {r['cold_first_draft']:12.3f} "
            f"{r['reuse_first_draft']:7.3f} {r['reuse_first_draft'] / r['cold_first_draft']:6.2f} "
            f"{r['cold_first_token']:9.3f} {r['reuse_first_token']:7.3f} {r['cold_total']:10.3f} "
            f"{r['reuse_total']:7.3f} {r['reuse_total'] / r['cold_total']:6.2f} {str(r['same_text']):>5}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
