"""`python -m mlx_lm_diffusion.convert`: the converter (mlx_lm_diffusion.cli.convert)."""

import sys

from mlx_lm_diffusion.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
