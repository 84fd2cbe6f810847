"""The fuse CLI: mlx_lm.fuse for diffusion checkpoints.

    python -m mlx_lm_diffusion.fuse --model PATH --adapter-path DIR [--save-path DIR] [--dequantize]

mlx_lm.fuse's flags and steps, through mlx-lm's own functions: the model is loaded with
its adapters (`mlx_lm_diffusion.load`, which builds the family's model), every adapted
layer's `fuse` merges its low-rank update into the base weight (de-quantizing with
--dequantize, then `dequantize_model` as mlx_lm.fuse does), and `mlx_lm.utils.save`
writes the checkpoint: the weights (under the model's names, which each family's
idempotent `sanitize` reads back), the source's config.json as loaded (model_type,
auto_map, mask and block settings kept), its remote-code *.py files and
generation_config.json, and the tokenizer, all into a directory beside --save-path that
takes its place once everything is written (a full disk: one line, exit 2, nothing left
half-written: api.checkpoint_dir). `mlx_lm_diffusion.load` reads the result like the source. mlx_lm.fuse's --upload-repo and --export-gguf (llama-family GGUF
only) are refused. Without --model the embedded demo is fused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from mlx_lm_diffusion import kernel_cache
from mlx_lm_diffusion.api.checkpoint_dir import written_whole
from mlx_lm_diffusion.api.loading import load, missing_adapter_files, read_config
from mlx_lm_diffusion.demo import MODEL_HELP, model_or_demo
from mlx_lm_diffusion.flags import exit_status, one_line_errors

PROG = "mlx_lm_diffusion.fuse"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Fuse fine-tuned adapters into a diffusion model.")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--save-path", default="fused_model", help="The path to save the fused model.")
    p.add_argument(
        "--adapter-path", type=str, default="adapters", help="Path to the trained adapter weights and config."
    )
    p.add_argument("--dequantize", action="store_true", help="Generate a dequantized model.")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="Enable trusting remote code for tokenizer/model loading."
    )
    return one_line_errors(p)


def fuse(
    model_path: str, adapter_path: str, save_path: str, dequantize: bool = False, trust_remote_code: bool = False
) -> Path:
    """Merge the adapters at `adapter_path` into the model at `model_path`; the fused
    checkpoint is written to `save_path` (returned)."""
    from mlx.utils import tree_unflatten
    from mlx_lm.utils import _download, dequantize_model, save

    missing = missing_adapter_files(adapter_path)
    if missing is not None:
        raise FileNotFoundError(f"no adapters at {adapter_path}: {missing}")
    source = _download(model_path)
    model, tokenizer = load(str(source), adapter_path=adapter_path, trust_remote_code=trust_remote_code)
    config = read_config(source)
    fused = [
        (name, module.fuse(dequantize=dequantize)) for name, module in model.named_modules() if hasattr(module, "fuse")
    ]
    if fused:
        model.update_modules(tree_unflatten(fused))
    if dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    with written_whole(Path(save_path)) as staging:  # (a full disk leaves nothing half-written)
        save(staging, source, model, tokenizer, config, donate_model=False)
    return Path(save_path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:  # (as a program: MLX's kernels in the user's own cache, not a shared /tmp)
        kernel_cache.use_for_cli()
    args = build_parser().parse_args(argv)

    def work() -> None:
        path = fuse(
            model_or_demo(args.model), args.adapter_path, args.save_path, args.dequantize, args.trust_remote_code
        )
        print(f"fused model saved to {path}", file=sys.stderr)

    return exit_status(work)
