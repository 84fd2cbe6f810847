"""`python -m mlx_lm_diffusion.evaluate`: the evaluate CLI (mlx_lm_diffusion.evaluation.command).

As `mlx_lm.evaluate` offers `MLXLM`, this module offers the lm-eval model,
`DiffusionLM` (imported on first use: it needs lm-eval, the eval extra).
"""

import sys
from typing import Any

from mlx_lm_diffusion.evaluation.command import main


def __getattr__(name: str) -> Any:
    if name == "DiffusionLM":
        from mlx_lm_diffusion.evaluation.harness import DiffusionLM

        return DiffusionLM
    raise AttributeError(name)


if __name__ == "__main__":
    sys.exit(main())
