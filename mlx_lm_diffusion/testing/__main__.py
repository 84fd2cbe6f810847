"""`python -m mlx_lm_diffusion.testing OUT_DIR`: the tiny random checkpoints, one per family."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

from mlx_lm_diffusion.flags import one_line_errors


def writers() -> Dict[str, Callable[[Path], Path]]:
    """Family name -> the writer of its checkpoint (imported when used: DiffusionGemma's
    need torch, its vision checkpoint mlx-vlm)."""
    from mlx_lm_diffusion.testing import block_checkpoints, checkpoints, hybrid_checkpoints, nemotron_gemma_checkpoints

    def gemma_vision(path: Path) -> Path:
        from mlx_lm_diffusion.testing.gemma_vision_checkpoints import write_gemma_with_vision

        return write_gemma_with_vision(path)

    return {
        "llada": checkpoints.write_llada,
        "dream": checkpoints.write_dream,
        "sdar": block_checkpoints.write_sdar,
        "idlm": block_checkpoints.write_idlm,
        "trida": hybrid_checkpoints.write_trida,
        "lfm2_diffusion": hybrid_checkpoints.write_lfm2_diffusion,
        "llada2": block_checkpoints.write_llada2,
        "llada2_2": block_checkpoints.write_llada2_2,
        "nemotron_labs_diffusion": nemotron_gemma_checkpoints.write_nemotron,
        "diffusion_gemma": nemotron_gemma_checkpoints.write_diffusion_gemma,
        "diffusion_gemma_vision": gemma_vision,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    families = list(writers())
    parser = one_line_errors(argparse.ArgumentParser(prog="python -m mlx_lm_diffusion.testing", description=__doc__))
    parser.add_argument("out", type=Path, help="the directory to write them under (one subdirectory per family)")
    parser.add_argument(
        "--families",
        nargs="+",
        choices=families,
        default=families,
        metavar="FAMILY",
        help=f"which to write (default: all of {', '.join(families)})",
    )
    parser.add_argument(
        "--skip-existing",
        action="store_true",
        help="leave a family's directory that exists as it is (its path is printed all the same)",
    )
    args = parser.parse_args(argv)
    chosen = writers()
    for family in args.families:
        path = args.out / family
        if path.exists() and args.skip_existing:
            print(path)
            continue
        if path.exists():
            print(f"error: {path} exists; choose a new directory", file=sys.stderr)
            return 2
        try:
            chosen[family](path)
        except ImportError as e:
            print(f'error: {family} needs {e.name} (pip install -e ".[test]" in a clone)', file=sys.stderr)
            return 2
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
