"""`python -m mlx_lm_diffusion.lora`: the lora CLI (mlx_lm_diffusion.training.command)."""

import sys

from mlx_lm_diffusion.training.command import main

if __name__ == "__main__":
    sys.exit(main())
