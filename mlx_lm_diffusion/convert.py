"""Convert (and optionally quantize) a diffusion checkpoint to MLX with mlx-lm's converter.

    python -m mlx_lm_diffusion.convert --hf-path X --mlx-path Y [-q --q-bits 4|8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from model_adapters import family_module, register


def convert(
    hf_path: str,
    mlx_path: str = "mlx_model",
    quantize: bool = False,
    q_group_size: int = 64,
    q_bits: int = 4,
    dtype: Optional[str] = None,
) -> None:
    from mlx_lm.convert import convert as mlx_lm_convert
    from mlx_lm.utils import _download, load_config

    register()
    family_module(str(load_config(_download(hf_path)).get("model_type")))
    if q_bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"q_bits must be one of 2, 3, 4, 5, 6, 8, got {q_bits}")
    if Path(mlx_path).exists():
        raise ValueError(f"{mlx_path} already exists; choose a new --mlx-path")
    mlx_lm_convert(
        hf_path,
        mlx_path,
        quantize=quantize,
        q_group_size=q_group_size,
        q_bits=q_bits,
        dtype=dtype,
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="mlx_lm_diffusion.convert", description=__doc__)
    p.add_argument("--hf-path", required=True, help="Hugging Face repo or local checkpoint")
    p.add_argument("--mlx-path", default="mlx_model", help="Where to write the MLX checkpoint")
    p.add_argument("-q", "--quantize", action="store_true", help="Quantize the weights")
    p.add_argument("--q-bits", type=int, default=4, help="Bits per weight when quantizing")
    p.add_argument("--q-group-size", type=int, default=64, help="Quantization group size")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None)
    args = p.parse_args(argv)
    try:
        convert(args.hf_path, args.mlx_path, args.quantize, args.q_group_size, args.q_bits, args.dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
