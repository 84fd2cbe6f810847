"""JSON-schema-constrained decoding against unconstrained, side by side in one run.

    python bench/bench_constraints.py [--decodes 40]

Two models: the embedded demo model (adds two numbers; schema: an integer in
[0, 1998]) and a micro random LLaDA checkpoint (d_model 64, 2 layers, byte vocabulary;
schema: a small object). For each decoding setting it runs the same prompts and seeds
unconstrained and with an llguidance JSON-schema processor (a fresh one per decode, its
grammar compile included in the time), and reports tokens per forward (emitted tokens,
the stopping EOS included, over the forwards), tok/s, and the fraction of outputs that
parse and validate against the schema. Compare the rows with each other only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jsonschema  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402

import mlx_lm_diffusion as mld  # noqa: E402
from mlx_lm_diffusion.demo import load_demo  # noqa: E402
from mlx_lm_diffusion.output.grammar import json_schema_processor  # noqa: E402
from mlx_lm_diffusion.testing.checkpoints import write_llada  # noqa: E402

DEMO_SCHEMA = {"type": "integer", "minimum": 0, "maximum": 1998}
MICRO_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


def decode(model, tok, prompt, schema, constrained, options, seed):
    processors = [json_schema_processor(tok, model.vocab_size, schema)] if constrained else []
    sampler = make_sampler(1.0) if options.get("sampled") else None
    fields = {k: v for k, v in options.items() if k != "sampled"}
    out = list(
        mld.stream_generate(model, tok, prompt, logits_processors=processors, sampler=sampler, seed=seed, **fields)
    )
    text = "".join(r.text for r in out)
    try:
        jsonschema.validate(json.loads(text), schema)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return len(out), out[-1].forwards, valid


def measure(model, tok, prompts, schema, options, constrained):
    tokens = forwards = valid = 0
    tic = time.perf_counter()
    for seed, prompt in enumerate(prompts):
        n, f, ok = decode(model, tok, prompt, schema, constrained, options, seed)
        tokens, forwards, valid = tokens + n, forwards + f, valid + ok
    elapsed = time.perf_counter() - tic
    return tokens / forwards, tokens / elapsed, valid / len(prompts)


def run(decodes: int):
    demo_model, demo_tok = load_demo()
    demo_prompts = [f"{100 + 7 * i}+{200 + 11 * i}=" for i in range(decodes)]
    micro_model, micro_tok = mld.load(str(write_llada(Path(tempfile.mkdtemp()) / "micro")))
    micro_prompts = ["JSON: "] * decodes
    cases = [
        ("demo", demo_model, demo_tok, demo_prompts, DEMO_SCHEMA, "defaults", dict(max_tokens=5)),
        ("demo", demo_model, demo_tok, demo_prompts, DEMO_SCHEMA, "threshold 0.9", dict(max_tokens=5, threshold=0.9)),
        (
            "micro",
            micro_model,
            micro_tok,
            micro_prompts,
            MICRO_SCHEMA,
            "block 16, threshold 0.9",
            dict(max_tokens=64, block_length=16, threshold=0.9),
        ),
        (
            "micro",
            micro_model,
            micro_tok,
            micro_prompts,
            MICRO_SCHEMA,
            "block 16, threshold 0.3",
            dict(max_tokens=64, block_length=16, threshold=0.3),
        ),
        (
            "micro",
            micro_model,
            micro_tok,
            micro_prompts,
            MICRO_SCHEMA,
            "block 16, thr 0.3, sampled",
            dict(max_tokens=64, block_length=16, threshold=0.3, sampled=True),
        ),
    ]
    for _, model, tok, prompts, schema, _, options in cases[::2]:  # warm up compiles and the tokenizers
        measure(model, tok, prompts[:2], schema, options, True)
    rows = []
    for name, model, tok, prompts, schema, label, options in cases:
        free = measure(model, tok, prompts, schema, options, False)
        bound = measure(model, tok, prompts, schema, options, True)
        rows.append((name, label, free, bound))
    return rows


def table(rows, decodes: int) -> str:
    head = (
        f"{'model':<7}{'setting':<28}{'tok/fwd free':>13}{'tok/fwd json':>13}"
        f"{'tok/s free':>12}{'tok/s json':>12}{'valid free':>11}{'valid json':>11}"
    )
    lines = [f"{decodes} decodes per cell (same prompts and seeds); greedy unless 'sampled'", head, "-" * len(head)]
    for name, label, free, bound in rows:
        lines.append(
            f"{name:<7}{label:<28}{free[0]:>13.2f}{bound[0]:>13.2f}{free[1]:>12.0f}{bound[1]:>12.0f}"
            f"{free[2]:>11.2f}{bound[2]:>11.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=int, default=40)
    args = parser.parse_args(argv)
    print(table(run(args.decodes), args.decodes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
