"""`python -m mlx_lm_diffusion.fuse`: the fuse CLI (mlx_lm_diffusion.training.fusing)."""

import sys

from mlx_lm_diffusion.training.fusing import main

if __name__ == "__main__":
    sys.exit(main())
