"""`install()`: let stock mlx-lm callers drive diffusion models.

After `install()`, `mlx_lm.load`, `mlx_lm.generate`, `mlx_lm.stream_generate`,
`mlx_lm.server` and `mlx_lm.chat` work on diffusion checkpoints: every place where
mlx-lm looks up `stream_generate` gets a dispatcher that sends diffusion models to
`compat` and every other model to the original function with the original arguments,
untouched. `uninstall()` puts the originals back. mlx-lm's own `make_prompt_cache`
needs no patch: it calls the model's `make_cache()`, which gives diffusion models a
`TokenCache` (model_adapters.base.DiffusionModel).

Callers that bound `from mlx_lm import stream_generate` before `install()` keep the
original function: call `install()` first. That function reaches mlx-lm's
`generate_step`, which `install()` makes refuse diffusion models with an error naming
`install()` (`REFUSALS`); so do `mlx_lm.cache_prompt` (no key/value cache to
save) and what scores or trains next-token predictions, which a diffusion model does not
make (`mlx_lm.perplexity`, `mlx_lm.lora`, `mlx_lm.tuner.trainer` with its default
loss), each saying what to do instead, not a meaningless figure or a model trained for
another task. `mlx_lm.batch_generate` sends diffusion models to
`generate_batch` (ragged running batches, mlx_lm_diffusion.decoding.batch). `mlx_lm.load` of a
diffusion checkpoint loads its tokenizer without remote code unless asked, and keeps its
generation_config.json's decoding defaults on the model as `mlx_lm_diffusion.load` does
(`WRAPPED`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.api.batch_generate import generate_batch
from mlx_lm_diffusion.decoding import attach_generation_defaults
from model_adapters import FAMILIES, check_weights, evidence, is_diffusion_model, register

# (module, attribute) -> the diffusion implementation it dispatches to
TARGETS: Tuple[Tuple[str, str, Callable[..., Any]], ...] = (
    ("mlx_lm.generate", "stream_generate", compat.stream_generate),  # mlx_lm.generate() calls it
    ("mlx_lm", "stream_generate", compat.stream_generate),
    ("mlx_lm.server", "stream_generate", compat.stream_generate),
    ("mlx_lm.chat", "stream_generate", compat.stream_generate),
    ("mlx_lm.generate", "batch_generate", generate_batch),  # ragged running batches
    ("mlx_lm", "batch_generate", generate_batch),
)

_BOUND_BEFORE_INSTALL = (
    "mlx-lm's autoregressive generate_step cannot drive a diffusion model: this stream_generate "
    "(or generate) was bound before mlx_lm_diffusion.install(), e.g. by `from mlx_lm import "
    "stream_generate` done first; call mlx_lm_diffusion.install() before importing it, or call "
    "mlx_lm_diffusion.stream_generate"
)

_NEXT_TOKEN_SCORES = (
    "mlx_lm.perplexity scores each token by the model's prediction of the next one, and a diffusion "
    "model makes no such prediction (it fills masked positions from both sides of them): its perplexity "
    "would mean nothing. mlx_lm_diffusion has no likelihood estimate for diffusion models; compare them "
    "by what they generate"
)
_NEXT_TOKEN_TRAINING = (
    "mlx-lm's trainer (mlx_lm.lora, mlx_lm.tuner.trainer with its default loss) fits the next-token loss, "
    "and a diffusion model is trained to fill masked positions: fine-tuning or testing it with that loss "
    "would teach or measure another task. Pass a masked-diffusion loss= to mlx_lm.tuner.trainer.train / "
    "evaluate instead (mlx_lm_diffusion.demo.train trains the demo model with one)"
)


def _default_loss(arguments: dict) -> bool:
    """A trainer call that uses mlx-lm's next-token loss (a caller's own `loss` passes)."""
    from mlx_lm.tuner.trainer import default_loss

    return arguments.get("loss", default_loss) is default_loss


# (module, attribute, a condition besides a diffusion model as the `model` argument (None:
# none), why it is refused)
REFUSALS: Tuple[Tuple[str, str, Optional[Callable[[dict], bool]], str], ...] = (
    ("mlx_lm.generate", "generate_step", None, _BOUND_BEFORE_INSTALL),
    (
        "mlx_lm.cache_prompt",
        "generate_step",
        None,
        "mlx_lm.cache_prompt saves a key/value cache, and a diffusion model keeps none (every forward "
        "re-reads the prompt); pass the prompt itself to mlx_lm_diffusion.generate / stream_generate",
    ),
    ("mlx_lm.perplexity", "eval_ppl", None, _NEXT_TOKEN_SCORES),
    # (mlx_lm.lora's steps, refused before they add LoRA layers or write an adapter folder)
    ("mlx_lm.lora", "train_model", None, _NEXT_TOKEN_TRAINING),
    ("mlx_lm.lora", "evaluate_model", None, _NEXT_TOKEN_TRAINING),
    ("mlx_lm.tuner.trainer", "train", _default_loss, _NEXT_TOKEN_TRAINING),
    ("mlx_lm.tuner.trainer", "evaluate", _default_loss, _NEXT_TOKEN_TRAINING),
)


@contextlib.contextmanager
def quiet_config_warnings():
    """Around loading a diffusion checkpoint's tokenizer: AutoTokenizer reads its
    config.json with transformers' config classes, which warn about what they do not know
    and we do not use them for ("You are using a model of type llada to instantiate a model
    of type .", SDAR's "`rope_scaling` is deprecated")."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*rope_scaling.*", category=FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _loads_no_remote_code(original: Callable[..., Any]) -> Callable[..., Any]:
    """mlx_lm.utils.load_tokenizer for a diffusion checkpoint: trust_remote_code is False
    unless the caller set it. The released checkpoints name their tokenizer code in
    auto_map, and mlx_lm.load passes no trust_remote_code, so AutoTokenizer would ask
    "Do you wish to run the custom code? [y/N]" and wait 15 s (issue 12 part 3). And
    transformers' warnings about the config are kept quiet (quiet_config_warnings)."""

    @functools.wraps(original)
    def load_tokenizer(model_path, tokenizer_config_extra=None, *args, **kwargs):
        if not _is_diffusion_checkpoint(model_path):
            return original(model_path, tokenizer_config_extra, *args, **kwargs)
        if (tokenizer_config_extra or {}).get("trust_remote_code") is None:
            tokenizer_config_extra = {**(tokenizer_config_extra or {}), "trust_remote_code": False}
        with quiet_config_warnings():
            return original(model_path, tokenizer_config_extra, *args, **kwargs)

    load_tokenizer.__mlx_lm_diffusion__ = True
    return load_tokenizer


def _diffusion_config(model_path: Any) -> Optional[dict]:
    """config.json of a local diffusion checkpoint, or None (anything else, an ordinary Qwen3.5
    included: mlx-lm's own path, unchanged)."""
    try:
        config = json.loads((Path(str(model_path)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    # (a checkpoint of one of mlx-lm's own types that is a family by its evidence: Trida's sidecar)
    if config.get("model_type") in FAMILIES or evidence.family_overrides(model_path, config):
        return config
    return None


def _is_diffusion_checkpoint(model_path: Any) -> bool:
    return _diffusion_config(model_path) is not None


def _loads_generation_defaults(original: Callable[..., Any]) -> Callable[..., Any]:
    """mlx_lm.utils.load_model (every mlx-lm load: mlx_lm.load, the server's, the chat's)
    for a diffusion checkpoint: its generation_config.json's decoding defaults are kept on
    the model, as mlx_lm_diffusion.load keeps them (generation_defaults)."""

    signature = inspect.signature(original)

    @functools.wraps(original)
    def load_model(model_path, *args, **kwargs):
        config = _diffusion_config(model_path)
        if config is None:
            return original(model_path, *args, **kwargs)
        overrides = evidence.family_overrides(model_path, config)  # (I-DLM's "sdar" checkpoints load as I-DLM)
        if overrides:
            call = signature.bind(model_path, *args, **kwargs)
            call.arguments["model_config"] = {**(call.arguments.get("model_config") or {}), **overrides}
            args, kwargs = call.args[1:], call.kwargs
        loaded = original(model_path, *args, **kwargs)
        check_weights(loaded[0])
        attach_generation_defaults(loaded[0], model_path)
        return loaded

    load_model.__mlx_lm_diffusion__ = True
    return load_model


def _loads_adapters_evaluated(original: Callable[..., Any]) -> Callable[..., Any]:
    """mlx_lm.utils.load_adapters over a diffusion model: the adapter weights evaluated on
    the loading thread. mx.load's arrays are lazy, bound to the stream of the thread that
    loaded them, and mlx-lm leaves them so; the server loads on its generation thread and
    decodes on another ("There is no Stream(cpu, 1) in current thread")."""

    @functools.wraps(original)
    def load_adapters(model, *args, **kwargs):
        loaded = original(model, *args, **kwargs)
        if is_diffusion_model(model):
            import mlx.core as mx

            mx.eval(model.parameters())
        return loaded

    load_adapters.__mlx_lm_diffusion__ = True
    return load_adapters


# (module, attribute, wrapper) patched for diffusion checkpoints only
WRAPPED: Tuple[Tuple[str, str, Callable[..., Any]], ...] = (
    ("mlx_lm.utils", "load_tokenizer", _loads_no_remote_code),
    ("mlx_lm.utils", "load_model", _loads_generation_defaults),
    ("mlx_lm.utils", "load_adapters", _loads_adapters_evaluated),
)

_lock = threading.Lock()
_originals: Dict[Tuple[str, str], Callable[..., Any]] = {}
_dispatchers: Dict[Tuple[str, str], Callable[..., Any]] = {}


def _model_of(args: tuple, kwargs: dict) -> Any:
    return args[0] if args else kwargs.get("model")


def _dispatcher(original: Callable[..., Any], diffusion: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        if is_diffusion_model(_model_of(args, kwargs)):
            return diffusion(*args, **kwargs)
        return original(*args, **kwargs)

    dispatch.__mlx_lm_diffusion__ = True
    return dispatch


def _refuser(original: Callable[..., Any], only_when: Optional[Callable[[dict], bool]], why: str) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def refuse(*args, **kwargs):
        try:
            arguments = signature.bind(*args, **kwargs).arguments
        except TypeError:  # (a call the original itself rejects: let it say why)
            return original(*args, **kwargs)
        if is_diffusion_model(arguments.get("model")) and (only_when is None or only_when(arguments)):
            raise ValueError(why)
        return original(*args, **kwargs)

    refuse.__mlx_lm_diffusion__ = True
    return refuse


def _all_targets():
    for module_name, attr, diffusion in TARGETS:
        yield module_name, attr, lambda current, d=diffusion: _dispatcher(current, d)
    for module_name, attr, only_when, why in REFUSALS:
        yield module_name, attr, lambda current, c=only_when, w=why: _refuser(current, c, w)
    yield from WRAPPED


def _module(name: str):
    # `import mlx_lm.generate` names the function, not the module: go through importlib.
    return importlib.import_module(name)


def install() -> None:
    """Route mlx-lm's generation entry points to the diffusion engine for diffusion
    models (idempotent). Autoregressive models take the original code paths."""
    register()
    with _lock:
        for module_name, attr, wrap in _all_targets():
            key = (module_name, attr)
            module = _module(module_name)
            current = getattr(module, attr)
            if key in _dispatchers and current is _dispatchers[key]:
                continue
            _originals[key] = current
            _dispatchers[key] = wrap(current)
            setattr(module, attr, _dispatchers[key])


def uninstall() -> None:
    """Put mlx-lm's original functions back (idempotent). A name rebound by someone
    else since `install()` is left as it is."""
    with _lock:
        for (module_name, attr), original in list(_originals.items()):
            module = _module(module_name)
            if getattr(module, attr) is _dispatchers.get((module_name, attr)):
                setattr(module, attr, original)
            _originals.pop((module_name, attr))
            _dispatchers.pop((module_name, attr), None)


def installed() -> bool:
    """Whether every target currently dispatches diffusion models."""
    with _lock:
        return all(getattr(_module(m), a) is _dispatchers.get((m, a)) for m, a, _ in _all_targets())


__all__ = ["install", "uninstall", "installed", "TARGETS", "REFUSALS", "WRAPPED"]
