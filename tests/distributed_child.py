"""What each rank runs under `mlx.launch` for tests/test_distributed.py.

    distributed_child.py decode CASES.json OUT_DIR    every case: sharded load, decode, report
    distributed_child.py die CASES.json OUT_DIR       decode the first case forever; rank 1 dies

`decode` writes OUT_DIR/rank<r>.json: per case the generated tokens, forwards, the
parameter bytes this rank holds, and whether the ranks agreed on a sampled decode.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

import mlx_lm_diffusion as mld
from decoding import engine_decode
from mlx_lm_diffusion.distributed import check_agreement, parameter_bytes


def decode_cases(group, cases: list) -> dict:
    out = {}
    for case in cases:
        model, tokenizer = mld.load(case["path"], group=group, autoregressive=case.get("autoregressive", False))
        tokens, forwards = engine_decode(model, tokenizer, case["prompt"], **case["options"])
        check_agreement(group, tokens)  # raises if the ranks' greedy decodes differ
        # sampled without a seed: the ranks draw from the random state they share
        sampler = make_sampler(0.8)
        sampled, _ = engine_decode(model, tokenizer, case["prompt"], **{**case["options"], "sampler": sampler})
        check_agreement(group, sampled)  # ... or their draws
        out[case["name"]] = {"tokens": tokens, "forwards": forwards, "bytes": parameter_bytes(model),
                             "sampled": sampled}
    return out


def die(group, cases: list, out_dir: Path) -> None:
    """Decode until killed: rank 1 ends itself (SIGKILL, no goodbye) mid-decode; rank 0
    must then fail with the ring's error, which the front doors turn into one line."""
    case = cases[0]
    model, tokenizer = mld.load(case["path"], group=group)
    from mlx_lm_diffusion.distributed import fail, is_group_failure

    (out_dir / f"pid{group.rank()}").write_text(str(os.getpid()))
    try:
        for i in range(10_000):
            engine_decode(model, tokenizer, case["prompt"], **case["options"])
            if i == 1 and group.rank() == 1:
                os.kill(os.getpid(), 9)
    except RuntimeError as e:
        if is_group_failure(e):
            fail(group, f"the distributed group failed: {e}", code=3)
        raise
    fail(group, "the peer never died", code=4)


def main() -> None:
    mode, cases_file, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    group = mx.distributed.init(strict=True, backend="ring")
    cases = json.loads(cases_file.read_text())
    if mode == "die":
        die(group, cases, out_dir)
    out = decode_cases(group, cases)
    (out_dir / f"rank{group.rank()}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
