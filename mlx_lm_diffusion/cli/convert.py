"""Convert (and optionally quantize) a diffusion checkpoint to MLX with mlx-lm's converter.

    python -m mlx_lm_diffusion.convert --hf-path X --mlx-path Y [-q --q-bits 4 --q-head-bits 8]

mlx_lm.convert's flags, meaning the same (--q-mode, --q-group-size, --quant-predicate,
--dtype, -d/--dequantize, --upload-repo, --trust-remote-code, ...). One difference: with
-q the token embeddings and the output head stay at 8 bits (`--q-head-bits`, default 8):
a diffusion model re-reads its whole canvas through the head at every denoising step, and
uniform 4-bit heads degrade under that repetition (mlx-vlm #1359). `--q-head-bits` equal
to --q-bits quantizes them like every other layer.

A checkpoint with a vision tower (DiffusionGemma) converts whole: the tower and projector
are kept and, as mlx-vlm's convert does, never quantized (the family's quant_predicate);
`vision_config` (which mlx-lm drops for a tower it does not find at `model.vision_tower`)
and the processor files are carried over.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

from mlx_lm_diffusion import kernel_cache
from mlx_lm_diffusion.api.checkpoint_dir import written_whole
from mlx_lm_diffusion.api.install import install, installed, quiet_config_warnings, uninstall
from mlx_lm_diffusion.api.loading import _check_local_path, checkpoint_errors, read_config
from mlx_lm_diffusion.flags import exit_status, one_line_errors
from model_adapters import FAMILIES, check_weights, evidence, family_module, register

QUANT_BITS = (2, 3, 4, 5, 6, 8)
DEFAULT_HEAD_BITS = 8


def head_predicate(
    model: Any, head_bits: int, group_size: Optional[int] = None, own: Optional[Callable] = None
) -> Callable[[str, Any], Union[bool, dict]]:
    """mlx-lm's quant_predicate keeping the embeddings (every nn.Embedding) and the
    output head (a Linear whose outputs are the vocabulary) at `head_bits` (affine);
    every other layer gets `own` (the model's predicate) or the converter's defaults."""
    import mlx.nn as nn

    vocab = {int(m.weight.shape[0]) for _, m in model.named_modules() if isinstance(m, nn.Embedding)}
    vocab.add(int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0))
    params = {"group_size": group_size or 64, "bits": head_bits, "mode": "affine"}

    def predicate(path: str, module: Any) -> Union[bool, dict]:
        if isinstance(module, nn.Embedding):
            return dict(params)
        if isinstance(module, nn.Linear) and int(module.weight.shape[0]) in vocab:
            return dict(params)
        return own(path, module) if own is not None else True

    return predicate


def convert(
    hf_path: str,
    mlx_path: str = "mlx_model",
    quantize: bool = False,
    q_group_size: Optional[int] = None,
    q_bits: Optional[int] = None,
    dtype: Optional[str] = None,
    q_mode: str = "affine",
    quant_predicate: Optional[Union[str, Callable]] = None,
    upload_repo: Optional[str] = None,
    revision: Optional[str] = None,
    dequantize: bool = False,
    trust_remote_code: bool = False,
    q_head_bits: Optional[int] = DEFAULT_HEAD_BITS,
) -> None:
    """mlx_lm.convert's `convert` for diffusion checkpoints (same arguments) plus
    `q_head_bits`: with `quantize`, the embeddings and the output head are kept at
    this many bits (None: like every other layer). A `quant_predicate` recipe name
    (mlx-lm's mixed_*) decides every layer itself."""
    from mlx_lm.utils import _download, load_model

    register()
    _check_local_path(hf_path)  # (a missing local path: said so, not the Hub's repo-id rules)
    source = Path(_download(hf_path, revision=revision))
    # (a checkpoint of one of mlx-lm's own types that is a family by its evidence loads as that family)
    source_config = read_config(source)
    overrides = evidence.family_overrides(source, source_config)
    family_module(str(overrides.get("model_type", source_config.get("model_type"))))
    for name, bits in (("q_bits", q_bits), ("q_head_bits", q_head_bits)):
        if bits is not None and bits not in QUANT_BITS:
            raise ValueError(f"{name} must be one of {', '.join(map(str, QUANT_BITS))}, got {bits}")
    if quantize and dequantize:
        raise ValueError("choose either quantize (-q) or dequantize (-d), not both")
    if Path(mlx_path).exists():
        raise ValueError(f"{mlx_path} already exists; choose a new --mlx-path")

    with quiet_config_warnings(), checkpoint_errors(source):  # (mlx-lm's convert loads the tokenizer too)
        # (a config the weights contradict: refused, not converted)
        check_weights(load_model(source, lazy=True, model_config=overrides)[0])
        borrowed = bool(overrides) and source_config.get("model_type") not in FAMILIES
        was_installed = installed()
        if borrowed:
            install()  # (mlx-lm's convert then loads it as the family: a type mlx-lm does not know, or its own)
        try:  # (a full disk leaves nothing half-written, and says so in one line)
            with written_whole(Path(mlx_path)) as staging:
                staging.rmdir()  # (mlx-lm's convert makes its directory, and refuses one that exists)
                _convert(
                    hf_path,
                    str(staging),
                    quantize,
                    q_group_size,
                    q_bits,
                    dtype,
                    q_mode,
                    quant_predicate,
                    upload_repo,
                    revision,
                    dequantize,
                    trust_remote_code,
                    q_head_bits,
                )
                if borrowed:
                    keep_identity(source, staging, overrides)
                keep_vision(source, staging)
        finally:
            if borrowed and not was_installed:
                uninstall()
    keep_vision(source, Path(mlx_path))


def keep_identity(source: Path, converted: Path, overrides: dict) -> None:
    """The converted copy says what the source said (its model_type, the block-diffusion
    sidecar), not the family's overrides: it reloads as the family by the same evidence, and
    the checkpoint's own tools still read it."""
    import json
    import shutil

    config_path = converted / "config.json"
    config = json.loads(config_path.read_text())
    for key in overrides:
        config.pop(key, None)
    config.update({k: v for k, v in read_config(source).items() if k in overrides})
    config_path.write_text(json.dumps(config, indent=4))
    if (source / evidence.BLOCK_DIFFUSION_SIDECAR).is_file():
        shutil.copy(source / evidence.BLOCK_DIFFUSION_SIDECAR, converted / evidence.BLOCK_DIFFUSION_SIDECAR)


# the processor's files (mlx-vlm's and transformers' names), copied with a vision tower
PROCESSOR_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


def keep_vision(source: Path, converted: Path) -> None:
    """Put the source's vision_config back into the converted config when the converted
    weights hold the vision tower, and copy the processor files."""
    import json
    import shutil

    src = json.loads((source / "config.json").read_text())
    config_path = converted / "config.json"
    config = json.loads(config_path.read_text())
    if not src.get("vision_config") or config.get("vision_config"):
        return
    index = converted / "model.safetensors.index.json"
    names = json.loads(index.read_text())["weight_map"] if index.exists() else {}
    if not any(".vision_tower." in name for name in names):
        return
    config["vision_config"] = src["vision_config"]
    config_path.write_text(json.dumps(config, indent=4))
    for name in PROCESSOR_FILES:
        if (source / name).exists() and not (converted / name).exists():
            shutil.copy(source / name, converted / name)


def _convert(
    hf_path,
    mlx_path,
    quantize,
    q_group_size,
    q_bits,
    dtype,
    q_mode,
    quant_predicate,
    upload_repo,
    revision,
    dequantize,
    trust_remote_code,
    q_head_bits,
) -> None:
    import mlx_lm.utils as mlx_utils
    from mlx_lm.convert import convert as mlx_lm_convert

    if quantize and q_head_bits is not None and quant_predicate is None:
        # mlx-lm builds the model inside convert: choose the heads once it is built
        real_quantize = mlx_utils.quantize_model

        def quantize_model(model, config, group_size, bits, mode="affine", quant_predicate=None, **kw):
            own = quant_predicate or getattr(model, "quant_predicate", None)
            group = group_size if mode == "affine" else None
            predicate = head_predicate(model, q_head_bits, group, own)
            return real_quantize(model, config, group_size, bits, mode=mode, quant_predicate=predicate, **kw)

        mlx_convert = importlib.import_module("mlx_lm.convert")  # (the name alone is mlx_lm's function)
        mlx_convert.quantize_model = quantize_model
        try:
            _run(
                mlx_lm_convert,
                hf_path,
                mlx_path,
                quantize,
                q_group_size,
                q_bits,
                q_mode,
                dtype,
                upload_repo,
                revision,
                dequantize,
                None,
                trust_remote_code,
            )
        finally:
            mlx_convert.quantize_model = real_quantize
        return
    _run(
        mlx_lm_convert,
        hf_path,
        mlx_path,
        quantize,
        q_group_size,
        q_bits,
        q_mode,
        dtype,
        upload_repo,
        revision,
        dequantize,
        quant_predicate,
        trust_remote_code,
    )


def _run(
    mlx_lm_convert,
    hf_path,
    mlx_path,
    quantize,
    q_group_size,
    q_bits,
    q_mode,
    dtype,
    upload_repo,
    revision,
    dequantize,
    quant_predicate,
    trust_remote_code,
) -> None:
    mlx_lm_convert(
        hf_path,
        mlx_path,
        quantize=quantize,
        q_group_size=q_group_size,
        q_bits=q_bits,
        q_mode=q_mode,
        dtype=dtype,
        upload_repo=upload_repo,
        revision=revision,
        dequantize=dequantize,
        quant_predicate=quant_predicate,
        trust_remote_code=trust_remote_code,
    )


def setup_arg_parser() -> argparse.ArgumentParser:
    """mlx_lm.convert's parser (same flags) plus --q-head-bits."""
    from mlx_lm.convert import configure_parser

    p = configure_parser()
    p.prog = "mlx_lm_diffusion.convert"
    p.description = "Convert a diffusion checkpoint to MLX format (mlx_lm.convert's flags)"
    p.add_argument(
        "--q-head-bits",
        type=int,
        default=DEFAULT_HEAD_BITS,
        help="With -q, bits for the token embeddings and the output head (default 8: uniform 4-bit heads "
        "degrade under repeated denoising); give the same as --q-bits to quantize them uniformly",
    )
    return one_line_errors(p)


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:  # (as a program: MLX's kernels in the user's own cache, not a shared /tmp)
        kernel_cache.use_for_cli()
    p = setup_arg_parser()
    args = p.parse_args(argv)
    if args.hf_path is None:
        print("error: --hf-path is required: a Hugging Face repo or a local checkpoint", file=sys.stderr)
        return 2
    if args.upload_repo is not None and os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("", "0", "false", "no"):
        print("error: --upload-repo needs the network, and HF_HUB_OFFLINE is set; drop one", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer/AutoConfig warn about model types they do not know
    return exit_status(lambda: convert(**vars(args)))


if __name__ == "__main__":
    sys.exit(main())
