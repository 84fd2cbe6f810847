"""The one decoding engine: options, commit rules, mask schedules, decoders, running batches.

Its public face: what the packages above it (api, output, serving, evaluation, training,
the demo, the CLIs) may import, by these names from `mlx_lm_diffusion.decoding`, never from
its modules (.importlinter's "decoding-face" contract). Imported on first use (PEP 562),
as the package's own names: importing an option's declaration does not import the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_OPTIONS = "mlx_lm_diffusion.decoding.options"

# each public name -> (the module that defines it, its name there)
_FACE: dict[str, tuple[str, str]] = {
    # a request's options: declared, checked, resolved against an adapter, bounded
    **{
        name: (_OPTIONS, name)
        for name in (
            "DecodeOptions",
            "ResolvedOptions",
            "resolve",
            "add_arguments",
            "check_fields",
            "check_forward_budget",
            "default_max_tokens",
            "forward_bound",
            "named_options",
            "schema",
            "IMPLIED_RULES",
        )
    },
    "GENERIC_NAMES": ("mlx_lm_diffusion.decoding.option_schema", "GENERIC_NAMES"),
    "MAX_TEMPERATURE": ("mlx_lm_diffusion.decoding.option_schema", "MAX_TEMPERATURE"),
    "attach_generation_defaults": ("mlx_lm_diffusion.decoding.generation_defaults", "attach"),
    # commit rules and schedules a door builds itself (the step-schedule protocol, the studio)
    "Quota": ("mlx_lm_diffusion.decoding.commit_rules", "Quota"),
    "StepInputs": ("mlx_lm_diffusion.decoding.commit_rules", "StepInputs"),
    "ScheduleQuota": ("mlx_lm_diffusion.decoding.schedules", "ScheduleQuota"),
    "GAMMAS": ("mlx_lm_diffusion.decoding.schedules", "GAMMAS"),
    # running a decode: alone, or as a row of a running batch
    "Engine": ("mlx_lm_diffusion.decoding.engine", "Engine"),
    "Step": ("mlx_lm_diffusion.decoding.engine", "Step"),
    "MAX_PROPOSALS": ("mlx_lm_diffusion.decoding.engine", "MAX_PROPOSALS"),
    "RunningBatch": ("mlx_lm_diffusion.decoding.batch", "RunningBatch"),
    "RowEvent": ("mlx_lm_diffusion.decoding.batch", "RowEvent"),
    "FREE": ("mlx_lm_diffusion.decoding.decoders.base", "FREE"),
    "decoder_class": ("mlx_lm_diffusion.decoding.decoders", "decoder_class"),
    "check_greedy": ("mlx_lm_diffusion.decoding.decoders.speculative", "check_greedy"),
    # the prompt's keys and values reused across decodes
    "PromptReuse": ("mlx_lm_diffusion.decoding.kv_reuse", "PromptReuse"),
    "CachedTokensTap": ("mlx_lm_diffusion.decoding.kv_reuse", "CachedTokensTap"),
    "cache_occupancy": ("mlx_lm_diffusion.decoding.kv_reuse", "cache_occupancy"),
    # threads that decode while the interpreter exits
    "thread_streams": ("mlx_lm_diffusion.decoding.interpreter_exit", "thread_streams"),
    "release_thread_streams": ("mlx_lm_diffusion.decoding.interpreter_exit", "release_thread_streams"),
}


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _FACE[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_FACE))


__all__ = sorted(_FACE)
