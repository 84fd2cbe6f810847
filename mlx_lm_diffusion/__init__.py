"""Diffusion language models on mlx-lm's doors: load, generate, stream_generate, CLI.

The house, top to bottom (each layer imports only the ones below it; import-linter
checks it, see .importlinter):

    generate, chat, server, convert, evaluate   `python -m` entry points
    serving/     the OpenAI-compatible HTTP server and what only it uses
    cli/         the terminal doors: generate, chat, convert, the live canvas
    evaluation/  lm-evaluation-harness: the likelihood bound, accuracy against speed
    demo/        the embedded demo model: its data, training and evaluation
    api/         the Python door: load, generate, stream_generate, generate_batch,
                 install(), mlx-lm's calling convention, the step-schedule protocol
    output/ media/   infill, grammars, request constraints / images and video
    decoding/    the one engine: options, commit rules, schedules, decoders, batches
    parallel/ flags   tensor parallelism across processes / the CLIs' conventions
    model_adapters   the families (LLaDA, Dream, ...), their contracts and caches
"""

from __future__ import annotations

import sys
import types
from typing import Any

from model_adapters import FAMILIES, register

register()  # mlx-lm resolves our model types from here on

from mlx_lm_diffusion.api.generation import DiffusionResponse, generate, generate_batch, stream_generate  # noqa: E402
from mlx_lm_diffusion.api.install import install, uninstall  # noqa: E402
from mlx_lm_diffusion.api.loading import load  # noqa: E402
from mlx_lm_diffusion.decoding.engine import Engine, Step  # noqa: E402
from mlx_lm_diffusion.decoding.options import DecodeOptions  # noqa: E402

__version__ = "0.1.0"


class _Package(types.ModuleType):
    """Keeps `mlx_lm_diffusion.generate` the function (as in mlx-lm) once the CLI module
    `mlx_lm_diffusion.generate` is imported: Python's import system would otherwise
    rebind the package attribute to the submodule. The CLI module is not imported here,
    so that `python -m mlx_lm_diffusion.generate` runs without runpy's warning."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "generate" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "load",
    "generate",
    "stream_generate",
    "generate_batch",
    "DiffusionResponse",
    "DecodeOptions",
    "Engine",
    "Step",
    "FAMILIES",
    "install",
    "uninstall",
]
