"""`python -m mlx_lm_diffusion.chat`: the chat REPL (mlx_lm_diffusion.cli.chat)."""

import sys

from mlx_lm_diffusion.cli.chat import main

if __name__ == "__main__":
    sys.exit(main())
