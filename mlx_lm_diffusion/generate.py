"""`python -m mlx_lm_diffusion.generate`: the generate CLI (mlx_lm_diffusion.cli.generate).

As `mlx_lm.generate` does, this module also offers the generation functions:
`from mlx_lm_diffusion.generate import stream_generate` works as in mlx-lm.
"""

import sys

from mlx_lm_diffusion.api.generation import generate, generate_batch, stream_generate  # noqa: F401
from mlx_lm_diffusion.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
