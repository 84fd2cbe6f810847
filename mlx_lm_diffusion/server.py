"""`python -m mlx_lm_diffusion.server`: the OpenAI-compatible server (mlx_lm_diffusion.serving.startup)."""

import sys

from mlx_lm_diffusion.serving.startup import main

if __name__ == "__main__":
    sys.exit(main())
