"""`load`: a diffusion checkpoint through mlx-lm's own loader (and mlx-vlm's processor)."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _download, load_config
from mlx_lm.utils import load as mlx_lm_load

from mlx_lm_diffusion.api.checkpoint_dir import is_write_failure
from mlx_lm_diffusion.api.install import quiet_config_warnings
from mlx_lm_diffusion.decoding import attach_generation_defaults
from mlx_lm_diffusion.media.images import load_processor
from mlx_lm_diffusion.parallel.distributed import shard_loaded
from model_adapters import FAMILIES, check_weights, evidence, family_module, idlm_lora


def _check_local_path(path_or_hf_repo: str) -> None:
    """A name that can only be a local path (not 'namespace/name') must exist: the Hub
    would answer with "Repo id must be in the form ..." instead of saying so."""
    name = str(path_or_hf_repo)
    if os.path.exists(name):
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name:
        raise FileNotFoundError(
            f"no model at {name}: that path does not exist (a Hugging Face repo is named 'namespace/name')"
        )


def check_regular_files(*folders: Any) -> None:
    """Refuse (ValueError) a checkpoint or adapter directory whose files are not regular
    files: a FIFO named model.safetensors (or config.json, adapters.safetensors, ...) made
    every door wait for a writer that never comes."""
    for folder in folders:
        if folder is None or not Path(folder).is_dir():
            continue
        for entry in Path(folder).iterdir():
            if (
                entry.suffix in (".json", ".safetensors", ".jinja", ".model", ".txt")
                and not entry.is_file()
                and not entry.is_dir()
            ):
                raise ValueError(f"{entry} is not a regular file (a pipe or a device): give the checkpoint's files")


def missing_adapter_files(adapter_path: Any) -> Optional[str]:
    """What an adapter directory lacks of what mlx-lm's load_adapters reads (adapter_config.json,
    adapters.safetensors), or None: checked before loading, so that the message names the adapter."""
    folder = Path(adapter_path).expanduser()
    if not folder.is_dir():
        return "adapter_config.json is missing (no such directory)"
    if idlm_lora.is_peft_lora(folder):  # (I-DLM's LoRA flavour: model_adapters.idlm_lora)
        return None
    for name in ("adapter_config.json", "adapters.safetensors"):
        if not (folder / name).is_file():
            return f"{name} is missing"
    return None


def load(
    path_or_hf_repo: str,
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    revision: Optional[str] = None,
    autoregressive: bool = False,
    adapter_path: Optional[str] = None,
    trust_remote_code: bool = False,
    group: Any = None,
    family: Optional[str] = None,
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
    the "ar" adapter (a degenerate diffusion model: model_adapters.families.ar).

    The checkpoint's generation_config.json gives the decoding defaults for what a call
    leaves unset (block_length, steps, strategy, max_new_tokens, ...), over the family's
    reference defaults: mlx_lm_diffusion.decoding.generation_defaults.

    With `group` (an `mx.distributed.Group` of more than one process, e.g.
    `mx.distributed.init()` under mlx.launch) the weights are loaded lazily and only
    this rank's shard is read (tensor parallelism: mlx_lm_diffusion.parallel.distributed).

    The family comes from config.json's model_type and, where a checkpoint borrows another
    model's type, its evidence (model_adapters.evidence: I-DLM's "sdar", Trida's sidecar); a
    checkpoint with the evidence of two families is refused unless `family` (a model type of
    `mlx_lm_diffusion.FAMILIES`, e.g. "idlm") decides."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(sorted(FAMILIES))}; got {family!r}")
    _check_local_path(path_or_hf_repo)
    model_path = _download(path_or_hf_repo, revision=revision)
    check_regular_files(model_path, adapter_path)
    with checkpoint_errors(model_path):
        return _load(
            model_path, tokenizer_config, model_config, autoregressive, adapter_path, trust_remote_code, group, family
        )


@contextmanager
def checkpoint_errors(model_path: Any) -> Iterator[None]:
    """A checkpoint that breaks the loading (a corrupt or truncated weights file, a config
    whose values break the model's construction) as one ValueError naming it, not a
    traceback from deep inside mlx or mlx-lm."""
    try:
        yield
    except (RuntimeError, ArithmeticError, TypeError, AttributeError, KeyError, IndexError) as e:
        if is_write_failure(e):  # (a write that failed, convert's on a full disk: not the checkpoint's fault)
            raise
        raise ValueError(f"the checkpoint at {model_path} cannot be loaded: {type(e).__name__}: {e}") from e


def read_config(model_path: Any) -> dict:
    """config.json of a checkpoint, which must be a JSON object."""
    try:
        raw = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}  # (a missing or unreadable file: mlx-lm's own error below)
    if not isinstance(raw, dict):
        raise ValueError(f"{model_path}/config.json must hold a JSON object")
    return load_config(Path(model_path))


def _load(
    model_path, tokenizer_config, model_config, autoregressive, adapter_path, trust_remote_code, group, family=None
):
    config = read_config(model_path)
    # I-DLM's LoRA flavour: a stock Qwen3 (or an I-DLM) with a PEFT LoRA for its mask rows
    mask_row_lora = adapter_path is not None and idlm_lora.is_peft_lora(adapter_path)
    if mask_row_lora and family is None and config.get("model_type") == "qwen3":
        family = "idlm"
    # a checkpoint that borrows a model_type (I-DLM's "sdar", Trida's "qwen3_5_text") loads as what it is
    overrides = evidence.family_overrides(model_path, config, family)
    model_type = str(overrides.get("model_type", config.get("model_type")))
    if mask_row_lora and model_type != "idlm":
        raise ValueError(
            f"{adapter_path} is a PEFT LoRA adapter, read only as I-DLM's LoRA flavour (a Qwen3 whose "
            "mask rows take the adapter); convert other adapters to mlx-lm's format"
        )
    if not autoregressive or model_type in FAMILIES:
        family_module(model_type)  # clear error for other model types
    model_config = {**(model_config or {}), **overrides}
    with quiet_config_warnings():
        sharded = group is not None and group.size() > 1
        model, tokenizer = mlx_lm_load(
            str(model_path),
            tokenizer_config={"trust_remote_code": bool(trust_remote_code), **(tokenizer_config or {})},
            model_config=model_config,
            adapter_path=None if mask_row_lora else adapter_path,
            lazy=sharded,
            trust_remote_code=bool(trust_remote_code),
        )
        if mask_row_lora:
            model.attach_mask_row_lora(adapter_path, tokenizer)
        check_weights(model)
        if not sharded:
            warn_non_finite(model, model_path)
        if adapter_path and not sharded:  # (mx.load's lazy adapter arrays, bound to this thread)
            mx.eval(model.parameters())
        if sharded:
            shard_loaded(model, group)
        processor = _processor(model, model_path, config)
    # the checkpoint's decoding defaults (generation_config.json), below explicit options
    attach_generation_defaults(model, model_path)
    if processor is None:
        return model, tokenizer
    processor._mlx_lm_tokenizer = tokenizer  # the text doors keep mlx-lm's wrapper
    return model, processor


def warn_non_finite(model: Any, model_path: Any) -> int:
    """Say on stderr (once, at load) how many weight tensors hold NaN or infinite values: such a
    checkpoint (a broken conversion, a diverged training run) loads and decodes meaningless
    tokens with no error. Returns that count. One pass over the weights, evaluated together."""
    named = [(k, v) for k, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    flags = [mx.any(mx.logical_not(mx.isfinite(v))) for _, v in named]
    mx.eval(flags)
    bad = [k for (k, _), flag in zip(named, flags) if flag.item()]
    if bad:
        print(
            f"warning: {model_path} has NaN or infinite values in {len(bad)} weight tensor(s) (first: {bad[0]}); "
            "its output will be meaningless",
            file=sys.stderr,
        )
    return len(bad)


def _processor(model: Any, model_path: Any, config: dict) -> Any:
    """The image processor of a checkpoint whose model loaded a vision tower, or None."""
    if not getattr(model, "has_vision", False):
        return None
    return load_processor(Path(model_path), config)
