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

Importing the package is light: the names below are imported on first use (PEP 562), so
that `python -m mlx_lm_diffusion.server` runs its own first lines (its start-up's signal
handling) before mlx-lm, transformers and torch are imported, which takes seconds. The
families are registered with mlx-lm (`model_adapters.register`) as soon as mlx_lm is
imported, by anyone, or at once when it already is: `import mlx_lm_diffusion` then
`mlx_lm.load(path)` finds them, as before.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import types
from typing import Any

__version__ = "0.1.0"

# each public name -> the module that defines it, imported when the name is first read
_LAZY = {
    "load": "mlx_lm_diffusion.api.loading",
    "generate": "mlx_lm_diffusion.api.generation",
    "stream_generate": "mlx_lm_diffusion.api.generation",
    "generate_batch": "mlx_lm_diffusion.api.generation",
    "DiffusionResponse": "mlx_lm_diffusion.api.generation",
    "install": "mlx_lm_diffusion.api.install",
    "uninstall": "mlx_lm_diffusion.api.install",
    "Engine": "mlx_lm_diffusion.decoding",
    "Step": "mlx_lm_diffusion.decoding",
    "DecodeOptions": "mlx_lm_diffusion.decoding",
    "FAMILIES": "model_adapters",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


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


# -- the families, registered with mlx-lm once mlx_lm is imported

_WATCHED = ("mlx_lm", "model_adapters")
_registered = False


def _imported(name: str, finished: str = "") -> bool:
    module = sys.modules.get(name)
    return module is not None and (name == finished or not getattr(module.__spec__, "_initializing", False))


def _register_when_ready(finished: str = "") -> None:
    """Register once mlx_lm is imported (`finished`: the module whose import just ran).
    model_adapters imports mlx_lm itself: when that is how mlx_lm came in, model_adapters
    is still half-run when mlx_lm's import ends, and its own end registers."""
    global _registered
    if (
        _registered
        or not _imported("mlx_lm", finished)
        or ("model_adapters" in sys.modules and not _imported("model_adapters", finished))
    ):
        return
    _registered = True
    importlib.import_module("model_adapters").register()


class _ThenRegister(importlib.abc.Loader):
    """A watched module's own loader, then `_register_when_ready`."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__.loader = module.__loader__ = self._loader  # (the module keeps its own loader)
        self._loader.exec_module(module)
        _register_when_ready(finished=module.__name__)


class _WatchImports(importlib.abc.MetaPathFinder):
    """Finds mlx_lm and model_adapters as the other finders do, with `_ThenRegister` as
    their loader. (Left in sys.meta_path once done, returning None: removing a finder
    while another thread's import walks the list could make it skip the next one.)"""

    def find_spec(self, name, path=None, target=None):
        if _registered or name not in _WATCHED:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenRegister(spec.loader)
                return spec
        return None


if _imported("mlx_lm"):
    _register_when_ready()
else:
    sys.meta_path.insert(0, _WatchImports())


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
