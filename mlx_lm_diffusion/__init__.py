"""Diffusion language models on mlx-lm's doors: load, generate, stream_generate, CLI."""

from __future__ import annotations

import sys
import types
from typing import Any, Dict, Optional

from model_adapters import FAMILIES, family_module, register

register()  # mlx-lm resolves our model types from here on

from . import generation_defaults  # noqa: E402
from .engine import Engine, Step  # noqa: E402
from .generation import DiffusionResponse, generate, generate_batch, stream_generate  # noqa: E402
from .install import install, uninstall  # noqa: E402
from .options import DecodeOptions  # noqa: E402

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


def _check_local_path(path_or_hf_repo: str) -> None:
    """A name that can only be a local path (not 'namespace/name') must exist: the Hub
    would answer with "Repo id must be in the form ..." instead of saying so."""
    import os

    name = str(path_or_hf_repo)
    if os.path.exists(name):
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name:
        raise FileNotFoundError(
            f"no model at {name}: that path does not exist (a Hugging Face repo is named 'namespace/name')"
        )


def load(
    path_or_hf_repo: str,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    revision: Optional[str] = None,
    autoregressive: bool = False,
    adapter_path: Optional[str] = None,
    trust_remote_code: bool = False,
    group: Any = None,
):
    """Load a diffusion checkpoint (Hugging Face layout or converted MLX) with mlx-lm's
    own loader; returns (model, tokenizer) as `mlx_lm.load` does, or (model, processor)
    as `mlx_vlm.load` does for a checkpoint with a vision tower and processor files
    (DiffusionGemma: mlx-vlm's DiffusionGemma4Processor; pass it where the tokenizer
    goes, with `image=[...]`).

    Remote code is never run unless `trust_remote_code=True` (as in mlx-lm): the
    released checkpoints name their modeling code in config.json's `auto_map`, but
    the models are built here and their tokenizers load without it, so transformers
    is told `trust_remote_code=False` and never asks ("Do you wish to run the custom
    code? [y/N]") nor waits. A `trust_remote_code` in `tokenizer_config` wins.

    With `autoregressive=True` any mlx-lm causal LM loads too and is decoded through
    the "ar" adapter (a degenerate diffusion model: model_adapters.ar).

    The checkpoint's generation_config.json gives the decoding defaults for what a call
    leaves unset (block_length, steps, strategy, max_new_tokens, ...), over the family's
    reference defaults: mlx_lm_diffusion.generation_defaults.

    With `group` (an `mx.distributed.Group` of more than one process, e.g.
    `mx.distributed.init()` under mlx.launch) the weights are loaded lazily and only
    this rank's shard is read (tensor parallelism: mlx_lm_diffusion.distributed)."""
    from mlx_lm.utils import _download, load as mlx_lm_load, load_config

    _check_local_path(path_or_hf_repo)
    model_path = _download(path_or_hf_repo, revision=revision)
    config = load_config(model_path)
    if not autoregressive or str(config.get("model_type")) in FAMILIES:
        family_module(str(config.get("model_type")))  # clear error for other model types
    from .install import quiet_config_warnings

    with quiet_config_warnings():
        sharded = group is not None and group.size() > 1
        model, tokenizer = mlx_lm_load(
            str(model_path),
            tokenizer_config={"trust_remote_code": bool(trust_remote_code), **(tokenizer_config or {})},
            model_config=model_config,
            adapter_path=adapter_path,
            lazy=sharded,
            trust_remote_code=bool(trust_remote_code),
        )
        if sharded:
            from .distributed import shard_loaded

            shard_loaded(model, group)
        processor = _processor(model, model_path, config)
    # the checkpoint's decoding defaults (generation_config.json), below explicit options
    generation_defaults.attach(model, model_path)
    if processor is None:
        return model, tokenizer
    processor._mlx_lm_tokenizer = tokenizer  # the text doors keep mlx-lm's wrapper
    return model, processor


def _processor(model: Any, model_path: Any, config: dict) -> Any:
    """The image processor of a checkpoint whose model loaded a vision tower, or None."""
    if not getattr(model, "has_vision", False):
        return None
    from pathlib import Path

    from .images import load_processor

    return load_processor(Path(model_path), config)


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
