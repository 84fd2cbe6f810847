"""What each rank runs under `mlx.launch` for tests/parallel/test_distributed.py.

    distributed_child.py JOB.json OUT_DIR

1. Every case of the job: a sharded load and a decode; OUT_DIR/rank<r>.json gets, per
   case, the generated tokens, forwards, the parameter bytes this rank holds and a
   sampled decode.
2. The generate CLI with the job's `cli` arguments, in this process, as `python -m
   mlx_lm_diffusion.generate ARGS` runs on each rank (one launch, one import of the
   stack: the CLI is the same code either way).
3. The CLI again with `die_cli`: rank 1 kills itself (SIGKILL) at the decode's
   `die_at_step`-th forward, after writing the time to OUT_DIR/killed_at; rank 0 ignores
   SIGTERM, so that mlx.launch (which terminates the others once a rank dies) cannot
   end it: it must end by itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.parallel.distributed import check_agreement, parameter_bytes
from mlx_lm_diffusion.testing.engine_runs import engine_decode


def decode_cases(group, cases: list) -> dict:
    out = {}
    for case in cases:
        model, tokenizer = mld.load(case["path"], group=group, autoregressive=case.get("autoregressive", False))
        tokens, forwards = engine_decode(model, tokenizer, case["prompt"], **case["options"])
        check_agreement(group, tokens)  # raises if the ranks' greedy decodes differ
        # sampled without a seed: the ranks draw from the random state they share
        sampler = make_sampler(0.8)
        # (a greedy-only decoder, LLaDA2.2's edit decoding, samples with its edits off)
        sampled_options = {**case["options"], **case.get("sampled_options", {}), "sampler": sampler}
        sampled, _ = engine_decode(model, tokenizer, case["prompt"], **sampled_options)
        check_agreement(group, sampled)  # ... or their draws
        out[case["name"]] = {
            "tokens": tokens,
            "forwards": forwards,
            "bytes": parameter_bytes(model, vision=False),
            "sampled": sampled,
        }
    return out


def main() -> None:
    job, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    group = mx.distributed.init(strict=True, backend="ring")
    out = decode_cases(group, job["cases"])
    (out_dir / f"rank{group.rank()}.json").write_text(json.dumps(out))
    from mlx_lm_diffusion.cli.generate import main as cli

    if cli(job["cli"]) != 0:
        sys.exit(1)
    if group.rank() == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        _die_at_step(job["die_at_step"], out_dir)
    cli(job["die_cli"])
    sys.exit(5)  # (not reached: rank 1 is dead, rank 0 exits with the group's error)


def _die_at_step(step: int, out_dir: Path) -> None:
    """Kill this process at the decode's `step`-th forward (the CLI's progress callback)."""
    from mlx_lm_diffusion.parallel import distributed

    progress = distributed.DistributedRun.progress
    seen = []

    def dying(run, callback=None):
        inner = progress(run, callback)

        def on_step(s):
            seen.append(s)
            if len(seen) == step:
                (out_dir / "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if inner is not None:
                inner(s)

        return on_step

    distributed.DistributedRun.progress = dying


if __name__ == "__main__":
    main()
