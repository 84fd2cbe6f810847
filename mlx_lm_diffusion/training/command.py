"""The lora CLI: mlx_lm.lora's flags, config file, data formats and trainer, with the
family's own objective.

    python -m mlx_lm_diffusion.lora --model PATH --train --data DIR [--iters N]
        [--fine-tune-type lora|dora|full] [--mask-prompt] [--objective diffusion|ar] ...

Every flag of mlx_lm.lora is its own parser's, meaning the same (plus `--objective`),
`-c/--config` YAML and the defaults are mlx_lm.lora's. mlx_lm.lora's own functions do
the work: `load_dataset` (text, completions and chat JSONL; --mask-prompt), LoRA / DoRA
/ full layers, --resume-adapter-file, the optimizers and schedules, the trainer's
progress lines (train and validation loss, tokens/s, peak memory) and the adapter files
(adapters.safetensors + adapter_config.json, so `mlx_lm_diffusion.load(...,
adapter_path=)`, the generate and chat CLIs' --adapter-path and the server read them).
What changes: the loss (training.objectives: the family's objective), the validation
and --test loss (training.validation: the ELBO estimate with fixed seeds) and the
validation batches' order (training.batches). mlx_lm.lora calls the trainer's `train`
and `evaluate` by the names it imported; they are swapped for the run (`_with_objective`)
rather than copying its 100 lines of setup.

Without --model the embedded demo is trained. Refused with exit 2 and one line: bad
flags, a missing model, a plain autoregressive model (mlx_lm.lora trains it), a
DiffusionGemma (uniform noise: no published training objective to reproduce).
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from mlx_lm_diffusion import kernel_cache
from mlx_lm_diffusion.api.loading import load, read_config
from mlx_lm_diffusion.cli.plain_output import plain_unless_terminal
from mlx_lm_diffusion.demo import model_or_demo
from mlx_lm_diffusion.flags import exit_status, one_line_errors
from mlx_lm_diffusion.training.batches import iterate_batches
from mlx_lm_diffusion.training.data_files import read_data
from mlx_lm_diffusion.training.objectives import OBJECTIVES, Objective, objective_for
from mlx_lm_diffusion.training.validation import ElboValidation
from model_adapters import FAMILIES, adapter_for

PROG = "mlx_lm_diffusion.lora"
# Model types this command refuses, with the reason.
UNTRAINABLE = {
    "diffusion_gemma": "DiffusionGemma is not supported: its uniform-noise training objective has no published "
    "reference to reproduce",
}


def build_parser() -> argparse.ArgumentParser:
    from mlx_lm.lora import build_parser as mlx_lm_parser

    parser = mlx_lm_parser()
    parser.prog = PROG
    parser.description = (
        "LoRA, DoRA or full fine-tuning of a diffusion language model with its family's own "
        "training objective (mlx_lm.lora's flags, config file and data formats)."
    )
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default=None,
        help="diffusion: the family's masked-diffusion objective (default); ar: next-token "
        "cross-entropy, for Nemotron-Labs Diffusion's autoregressive mode",
    )
    return one_line_errors(parser)


def resolve_args(args: argparse.Namespace) -> types.SimpleNamespace:
    """mlx_lm.lora's settings: the flags, then the --config file's values, then its defaults."""
    import yaml
    from mlx_lm.lora import CONFIG_DEFAULTS, yaml_loader

    values = vars(args)
    if args.config:
        with open(args.config) as file:
            try:
                config = yaml.load(file, yaml_loader)
            except yaml.YAMLError as e:  # (a syntax error, or a tag such as !!python/... that it never runs)
                where = getattr(e, "problem_mark", None)
                at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
                raise ValueError(
                    f"--config {args.config} is not valid YAML{at}: {getattr(e, 'problem', None) or e}"
                ) from None
        if not isinstance(config, dict):
            raise ValueError(f"--config {args.config} must hold a YAML mapping of options")
        for key, value in config.items():
            if values.get(key) is None:
                values[key] = value
    defaults = {**CONFIG_DEFAULTS, "model": None, "objective": "diffusion"}
    for key, value in defaults.items():
        if values.get(key) is None:
            values[key] = value
    values["model"] = model_or_demo(values["model"])
    return types.SimpleNamespace(**values)


def check_data(args: types.SimpleNamespace) -> None:
    """--data that can only be a local directory must exist (ValueError): mlx-lm would look
    a missing one up on the Hugging Face Hub instead, which answers about something else."""
    data = str(args.data)
    hf_dataset = getattr(args, "hf_dataset", None)
    if hf_dataset is not None and not isinstance(hf_dataset, (dict, list)):
        raise ValueError(
            f"hf_dataset must be a mapping (path, train_split, valid_split, ...) or a list of them, "
            f"as mlx_lm.lora's config takes it, not {hf_dataset!r}"
        )
    if hf_dataset or Path(data).exists():
        return
    if data.startswith((".", "/", "~")) or data.count("/") != 1:
        raise ValueError(
            f"no data at {data}: give a directory with train.jsonl and valid.jsonl "
            "(a Hugging Face dataset is named 'namespace/name')"
        )


def check_trainable(model: str) -> None:
    """Refuse, before loading, a model this command does not train (ValueError)."""
    path = Path(model)
    if not (path / "config.json").exists():
        return  # (a Hub name, or no model: load says what is wrong)
    model_type = str(read_config(path).get("model_type"))
    if model_type in UNTRAINABLE:
        raise ValueError(UNTRAINABLE[model_type])
    if model_type not in FAMILIES:
        raise ValueError(f"{model} is not a diffusion model (model_type {model_type!r}): fine-tune it with mlx_lm.lora")


def read_local_data(args: types.SimpleNamespace, tokenizer: Any) -> None:
    """Check the local data files (data_files.read_data: ValueError naming the file and the
    line); completions and chat data train as supervised fine-tuning whatever --mask-prompt
    says (mlx_lm.lora's default, the prompt masked like the answer and no EOS padding, leaves
    a diffusion model writing on past its answer); a warning counts the characters the
    vocabulary cannot spell."""
    if getattr(args, "hf_dataset", False):
        return
    splits = tuple(s for s, on in (("train", args.train), ("valid", args.train), ("test", args.test)) if on)
    data = read_data(args.data, tokenizer, splits)
    if data.unknown_characters:
        print(
            f"warning: {data.unknown_characters} characters of {args.data} are outside the model's vocabulary "
            "and train as its unknown token",
            file=sys.stderr,
        )
    if data.supervised and not args.mask_prompt:
        args.mask_prompt = True
        print(
            f"{data.format} data: trained as supervised fine-tuning (the prompt never masked, the answers "
            "padded with EOS), as --mask-prompt does",
            file=sys.stderr,
        )


def objective_of(model: Any, tokenizer: Any, args: Any) -> Objective:
    """The loss for mlx-lm's trainer: the family's objective; in evaluation, the ELBO."""
    adapter = adapter_for(model, tokenizer)
    if args.mask_prompt:  # supervised fine-tuning: LLaDA's SFT normalization and EOS padding
        objective = objective_for(adapter, args.objective, "answer", pad_id=_eos_id(adapter, tokenizer))
    else:
        objective = objective_for(adapter, args.objective, "tokens")
    if not objective.autoregressive:
        objective.validation = ElboValidation(adapter, objective.first, seed=args.seed)
    return objective


def _eos_id(adapter: Any, tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return eos
    if adapter.eos_ids:
        return min(adapter.eos_ids)
    raise ValueError(
        "the checkpoint names no EOS token (config.json's eos_token_id or the tokenizer's): "
        "supervised fine-tuning pads answers with it"
    )


@contextmanager
def _with_objective(objective: Objective) -> Iterator[None]:
    """mlx_lm.lora's run with this objective: its `train` and `evaluate` (the trainer's,
    imported by name into mlx_lm.lora) given the loss and the batches."""
    import mlx_lm.lora as lora
    from mlx_lm.tuner import trainer

    saved = lora.train, lora.evaluate
    lora.train = partial(trainer.train, loss=objective, iterate_batches=iterate_batches)
    lora.evaluate = partial(trainer.evaluate, loss=objective, iterate_batches=iterate_batches)
    try:
        yield
    finally:
        lora.train, lora.evaluate = saved


def run(args: types.SimpleNamespace) -> None:
    """mlx_lm.lora.run with the family's objective."""
    import numpy as np
    from mlx_lm import lora
    from mlx_lm.tuner.datasets import load_dataset
    from mlx_lm.tuner.utils import load_adapters

    if not (args.train or args.test):
        raise ValueError("give --train, --test or both")
    check_data(args)
    check_trainable(args.model)
    resume = getattr(args, "resume_adapter_file", None)
    if resume and not Path(resume).is_file():
        raise ValueError(
            f"--resume-adapter-file {resume}: no such file (an adapters.safetensors written by an earlier run)"
        )
    np.random.seed(args.seed)
    callback = reporting_callbacks(
        args.report_to, project_name=args.project_name, log_dir=args.adapter_path, config=vars(args)
    )
    print("Loading pretrained model", file=sys.stderr)
    model, tokenizer = load(args.model, trust_remote_code=args.trust_remote_code)
    read_local_data(args, tokenizer)
    objective = objective_of(model, tokenizer, args)
    print("Loading datasets", file=sys.stderr)
    train_set, valid_set, test_set = load_dataset(args, tokenizer)
    with _with_objective(objective):
        if args.train:
            print("Training", file=sys.stderr)
            lora.train_model(args, model, train_set, valid_set, callback)
        elif args.adapter_path:
            load_adapters(model, args.adapter_path)
        if args.test:
            print("Testing", file=sys.stderr)
            lora.evaluate_model(args, model, test_set)


def reporting_callbacks(report_to: Any, **kwargs) -> Any:
    """mlx-lm's training callbacks for `report_to` (wandb, swanlab); a reporter whose package
    is not installed is one line (mlx-lm raised ImportError from deep inside)."""
    from mlx_lm.tuner.callbacks import get_reporting_callbacks

    try:
        return get_reporting_callbacks(report_to, **kwargs)
    except ImportError as e:
        raise ValueError(f"report_to {report_to!r}: {e}") from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:  # (as a program: MLX's kernels in the user's own cache, not a shared /tmp)
        kernel_cache.use_for_cli()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # (as mlx_lm.lora)
    args = build_parser().parse_args(argv)
    with plain_unless_terminal():  # (mlx-lm's training table is coloured: not into a pipe or a file)
        return exit_status(lambda: run(resolve_args(args)))
