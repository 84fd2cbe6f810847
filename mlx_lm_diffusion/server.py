"""`python -m mlx_lm_diffusion.server` (and the `mlx_lm_diffusion.server` command): the
OpenAI-compatible server (mlx_lm_diffusion.serving.startup).

Run from the command line, its first lines, before the imports that take seconds (mlx-lm,
transformers, torch), make a SIGINT or SIGTERM end the start-up at once and cap malloc's
arenas under an address-space limit; a start-up that runs out of memory, or whose imports
fail, ends with one line and exit 2 (mlx_lm_diffusion.serving.starting, .memory).
"""

import sys
from typing import Optional, Sequence

from mlx_lm_diffusion.serving import memory, starting


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The server on `argv` (None: the command line, which also takes the signals and
    exits the process; otherwise serving.startup.main in the caller's process, as it was)."""
    if argv is not None:
        from mlx_lm_diffusion.serving.startup import main as serve

        return serve(argv)
    starting.take_signals()
    memory.cap_malloc_arenas()
    try:
        from mlx_lm_diffusion.serving.startup import main as serve
    except Exception as e:  # noqa: BLE001 (short of memory, transformers says "Could not import module")
        starting.cannot_import(e)
    try:
        return serve()
    except Exception as e:  # noqa: BLE001 (MemoryError is an Exception)
        if memory.is_out_of_memory(e):
            starting.out_of_memory(e)
        raise


if __name__ == "__main__":
    sys.exit(main())
