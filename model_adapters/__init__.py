"""One module per diffusion family; each defines `ModelArgs`, `Model` and `Adapter`.

`register()` makes every family resolvable by mlx-lm's own loader, which imports
`mlx_lm.models.<model_type>`: loading, quantized reloads, conversion, the server
and chat then find these models like any other.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten

from model_adapters.base import Adapter, DecodeSetup, FamilyDefaults
from model_adapters.families.ar import ArAdapter

# The runtime's face: what the engine and the doors may use of the machinery the families run
# on (.importlinter's "runtime-private": mlx_lm_diffusion imports these from here, never from
# model_adapters.runtime): the prompt's keys and values across decodes, the prompt cache's
# token list, tables of compiled calls kept per thread, what a model keeps between forwards.
from model_adapters.runtime.batched import bounded_compile
from model_adapters.runtime.model_cache import model_cache
from model_adapters.runtime.prefix_kv import PrefixKV
from model_adapters.runtime.prompt_cache import TokenCache
from model_adapters.runtime.thread_compiled import ThreadTables

# model_type (as written in config.json) -> the module that defines its family
FAMILIES: dict[str, str] = {
    "llada": f"{__name__}.families.llada",
    "Dream": f"{__name__}.families.dream",
    "sdar": f"{__name__}.families.sdar",
    "llada2_moe": f"{__name__}.families.llada2",
    "nemotron_labs_diffusion": f"{__name__}.families.nemotron_labs_diffusion",
    "diffusion_gemma": f"{__name__}.families.diffusion_gemma",
    "idlm": f"{__name__}.families.idlm",  # (its checkpoints say "sdar": model_adapters.evidence picks it)
    "qwen3_5_diffusion": f"{__name__}.families.qwen3_5_diffusion",  # (Qwen3.5 + block_diffusion.json: evidence)
    "lfm2_diffusion": f"{__name__}.families.lfm2_diffusion",
}


def family_module(model_type: str) -> ModuleType:
    if model_type not in FAMILIES:
        raise ValueError(
            f"Unsupported model_type {model_type!r}; supported diffusion families: "
            + ", ".join(f"{t!r} ({_family_name(t)})" for t in FAMILIES)
        )
    return importlib.import_module(FAMILIES[model_type])


def _family_name(model_type: str) -> str:
    return importlib.import_module(FAMILIES[model_type]).Adapter.family


def register_family(model_type: str, module: str) -> None:
    """Add a family defined outside this package: `module` (its module name) defines
    ModelArgs, Model and Adapter. Its options join the options schema, and mlx-lm's
    loader finds it like the built-in ones."""
    FAMILIES[model_type] = module
    register()


def register() -> None:
    """Expose each family as `mlx_lm.models.<model_type>` (idempotent). Refuses, before
    registering any, to shadow a module that the installed mlx-lm ships itself."""
    import mlx_lm.models

    shadowed = [t for t in FAMILIES if _shipped_by_mlx_lm(f"mlx_lm.models.{t}")]
    if shadowed:
        raise ValueError(
            f"the installed mlx-lm ships its own mlx_lm.models.{shadowed[0]}; registering the "
            f"diffusion family {shadowed[0]!r} would shadow it (model types: {', '.join(shadowed)})"
        )
    for model_type in FAMILIES:
        module = family_module(model_type)
        sys.modules[f"mlx_lm.models.{model_type}"] = module
        setattr(mlx_lm.models, model_type, module)


def _shipped_by_mlx_lm(name: str) -> bool:
    """Whether `name` is a module of mlx-lm's own. A family registered before sits in
    sys.modules under that name but keeps its own `__name__` (model_adapters.families.llada, or
    wherever `register_family` found it)."""
    registered = sys.modules.get(name)
    if registered is not None:
        return registered.__name__ == name
    return importlib.util.find_spec(name) is not None


def family_options() -> list:
    """Every option a registered family declares (its adapter's `options`)."""
    return [option for model_type in FAMILIES for option in family_module(model_type).Adapter.options]


def is_diffusion_model(model: nn.Module) -> bool:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) in FAMILIES


def check_weights(model: nn.Module) -> None:
    """Refuse (ValueError) a diffusion checkpoint whose config.json contradicts its weights:
    a vocabulary size other than the embedding's rows, or a mask or EOS token id outside them
    (such a model loaded and decoded nonsense: mask 99 on a 16-token vocabulary)."""
    if not is_diffusion_model(model):
        return
    rows = {v.shape[0] for k, v in tree_flatten(model.parameters()) if k.endswith("embed_tokens.weight")}
    if len(rows) != 1:
        return  # (no single token embedding to check against)
    (rows,) = rows
    vocab_size = getattr(model, "vocab_size", None)
    if isinstance(vocab_size, int) and vocab_size != rows:
        raise ValueError(
            f"config.json's vocabulary size ({vocab_size}) is not the weights' ({rows} embedding "
            "rows): the checkpoint is inconsistent"
        )
    eos = getattr(model.args, "eos_token_id", None)
    outside = [i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int) and not 0 <= i < rows]
    if outside:
        raise ValueError(
            f"config.json's eos_token_id ({outside[0]}) lies outside the vocabulary of the weights "
            f"[0, {rows}): the model could never end an answer"
        )
    mask_id = getattr(model.args, "mask_token_id", None)
    if isinstance(mask_id, int) and not 0 <= mask_id < rows:
        raise ValueError(
            f"config.json's mask_token_id ({mask_id}) lies outside the vocabulary of the weights [0, {rows})"
        )


def adapter_for(model: nn.Module, tokenizer: Any = None) -> Adapter:
    """The family adapter for a loaded model; any other mlx-lm causal LM gets the
    autoregressive adapter (a degenerate diffusion model, see model_adapters.families.ar)."""
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    if model_type not in FAMILIES and hasattr(model, "layers"):
        return ArAdapter(model, tokenizer)
    return family_module(str(model_type)).Adapter(model, tokenizer)


__all__ = [
    "check_weights",
    "Adapter",
    "DecodeSetup",
    "FamilyDefaults",
    "PrefixKV",
    "TokenCache",
    "ThreadTables",
    "bounded_compile",
    "model_cache",
    "FAMILIES",
    "adapter_for",
    "register",
    "register_family",
    "family_module",
    "family_options",
]
