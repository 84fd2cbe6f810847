"""The evaluate CLI: mlx_lm.evaluate's flags, meaning the same, plus diffusion's.

    python -m mlx_lm_diffusion.evaluate --model PATH --tasks TASK [TASK ...]
        [--include-path DIR] [--mc-samples N] [--threshold 0.9 ...]
        [--sweep threshold=0.7,0.9 cache=none,dual]

Every flag of mlx_lm.evaluate is here (its parser imports lm-eval at import time, so it
is rebuilt, not borrowed), plus: `--include-path DIR` (a directory of local YAML tasks,
lm-eval's TaskManager include_path), `--mc-samples` (Monte Carlo samples of the
likelihood bound per request, evaluation.likelihood), the decoding options of the
options schema as flags (as `generate` takes them), and `--sweep` (the cartesian
product of settings, evaluation.sweep, each evaluated in the same run on the same
loaded model). Without --model the embedded demo is evaluated.

Output, in --output-dir: lm-eval's results JSON per setting (with each task's speed), a
markdown table (one row per setting and task: its first metric, tokens per forward,
tok/s, forwards; printed too) and, with matplotlib, a PNG of the metric against tokens
per forward and against tok/s. Bad flags, unknown tasks and a family without a
likelihood bound exit 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from mlx_lm_diffusion import kernel_cache
from mlx_lm_diffusion.api.compat import add_decode_arguments, decode_defaults
from mlx_lm_diffusion.api.loading import load
from mlx_lm_diffusion.decoding import DecodeOptions, resolve
from mlx_lm_diffusion.demo import MODEL_HELP, model_or_demo
from mlx_lm_diffusion.evaluation import report, sweep
from mlx_lm_diffusion.evaluation.generation import generate_until
from mlx_lm_diffusion.flags import exit_status, one_line_errors
from model_adapters import adapter_for

PROG = "mlx_lm_diffusion.evaluate"
INSTALL_HINT = 'lm-evaluation-harness is not installed: pip install -e ".[eval]" (the eval extra)'
TABLE_FILE, PLOT_FILE = "evaluation.md", "evaluation.png"


def json_object(text: str) -> dict:
    """--chat-template-args: a JSON object, or argparse's one-line error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}); give e.g. '{{\"enable_thinking\": false}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of keyword arguments")
    return value


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Evaluate a diffusion language model with "
        "lm-evaluation-harness: accuracy against speed (mlx_lm.evaluate's flags plus "
        "diffusion options).",
    )
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names (space or comma separated)")
    p.add_argument("--output-dir", default=".", help="Output directory for result files.")
    p.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="Maximum number of sequences processed at once, both when scoring (Monte Carlo samples "
        "per forward) and when generating (rows decoded together).",
    )
    p.add_argument("--num-shots", type=int, default=None, help="Number of shots")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="Maximum number of tokens to generate. When set, this value takes precedence over task specific defaults.",
    )
    p.add_argument("--limit", type=int, default=None, help="Limit the number of examples per task.")
    p.add_argument("--seed", type=int, default=123, help="Random seed (lm-eval's, and the likelihood's masks).")
    p.add_argument(
        "--fewshot-as-multiturn",
        action="store_true",
        default=False,
        help="Whether to provide the fewshot examples as a multiturn conversation or a single user turn.",
    )
    p.add_argument(
        "--apply-chat-template",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Specifies whether to apply a chat template to the prompt. If the model has a chat "
        "template, this defaults to `True`, otherwise `False`.",
    )
    p.add_argument(
        "--chat-template-args",
        type=json_object,
        default={},
        help="A JSON formatted string of arguments for the tokenizer's apply_chat_template, "
        "e.g. '{\"enable_thinking\":false}'",
    )
    p.add_argument(
        "--confirm-run-unsafe-code",
        action="store_true",
        default=False,
        help="Confirm that you want to run tasks that execute untrusted code (lm-eval's flag; here also "
        "local task YAML with `!function` or an `include:` from outside its directory)",
    )
    p.add_argument("--trust-remote-code", action="store_true", help="Enable trusting remote code for tokenizer")
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p")
    p.add_argument("--top-k", type=int, default=0, help="Sampling top-k")
    p.add_argument(
        "--include-path",
        default=None,
        metavar="DIR",
        help="A directory of local lm-eval YAML tasks (lm-eval's --include_path)",
    )
    p.add_argument(
        "--mc-samples",
        type=int,
        default=128,
        help="Monte Carlo samples of the likelihood bound per loglikelihood request (LLaDA's mc_num)",
    )
    p.add_argument(
        "--sweep",
        nargs="+",
        default=None,
        metavar="NAME=V1,V2",
        help="Evaluate every combination of these decoding settings, e.g. threshold=0.7,0.8,0.9 "
        "cache=none,dual ('none': the default)",
    )
    return one_line_errors(add_decode_arguments(p))  # --threshold, --cache, --block-length, --steps, ...


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:  # (as a program: MLX's kernels in the user's own cache, not a shared /tmp)
        kernel_cache.use_for_cli()
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    try:
        import lm_eval  # noqa: F401 (the eval extra)
    except ImportError:
        print(f"error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer warns about model types it does not know
    return exit_status(lambda: evaluate(args))


def _checked_flags(args: argparse.Namespace) -> tuple:
    """(decoding options, sweep settings, task names) from the flags; ValueError first."""
    options = decode_defaults(args)
    axes = sweep.parse_axes(args.sweep)
    for name, _ in axes:
        if name in options or (name == "max_tokens" and args.max_tokens is not None):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is given as a flag and as a --sweep axis; give it in one place")
    for flag, value in (("--batch-size", args.batch_size), ("--mc-samples", args.mc_samples)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    tasks = [t for item in args.tasks for t in item.split(",") if t]
    return options, sweep.settings(axes), tasks


def evaluate(args: argparse.Namespace) -> list:
    """Run every setting; returns the table's rows."""
    import lm_eval
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from mlx_lm_diffusion.evaluation.harness import DiffusionLM
    from mlx_lm_diffusion.evaluation.tasks import check_task_code, task_manager

    options, settings, tasks = _checked_flags(args)
    check_task_code(args.include_path, tasks, args.confirm_run_unsafe_code)
    manager = task_manager(tasks, args.include_path)  # (unknown tasks fail before the model loads)
    args.model = model_or_demo(args.model)
    loaded = load(args.model, trust_remote_code=args.trust_remote_code)
    runs = [(setting, _options(options, setting)) for setting in settings]
    for _, run_options in runs:  # (a setting the family cannot decode fails before any evaluation)
        resolve(DecodeOptions(**run_options), adapter_for(*loaded), 1)
    # (temperature 0: no sampler, the engine's own argmax, as generate does)
    sampler = make_sampler(temp=args.temp, top_p=args.top_p, top_k=args.top_k) if args.temp > 0 else None
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for setting, run_options in runs:
        warm_up(loaded, {**run_options, "sampler": sampler})
        mx.random.seed(args.seed)
        lm = DiffusionLM(
            loaded=loaded,
            max_tokens=setting.get("max_tokens", args.max_tokens),
            batch_size=args.batch_size,
            use_chat_template=args.apply_chat_template,
            chat_template_args=args.chat_template_args,
            sampler=sampler,
            mc_samples=args.mc_samples,
            seed=args.seed,
            options=run_options,
        )
        with task_data_errors(tasks):
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=tasks,
                task_manager=manager,
                num_fewshot=args.num_shots,
                limit=args.limit,
                fewshot_as_multiturn=args.fewshot_as_multiturn,
                apply_chat_template=lm.use_chat_template,
                random_seed=args.seed,
                numpy_random_seed=args.seed,
                torch_random_seed=args.seed,
                fewshot_random_seed=args.seed,
                confirm_run_unsafe_code=args.confirm_run_unsafe_code,
                log_samples=False,
            )
        speed = lm.speed.record()
        path = output_dir / f"{_file_stem(args, tasks)}_{sweep.slug(setting)}.json"
        path.write_text(json.dumps(_record(args, setting, results, speed), indent=2, default=_plain) + "\n")
        print(f"wrote {path}", file=sys.stderr)
        rows += report.rows_of(sweep.label(setting), results["results"], speed, tuple(setting.items()))
    _write_report(rows, output_dir)
    return rows


@contextmanager
def task_data_errors(tasks: Sequence[str]) -> Iterator[None]:
    """A task whose data the datasets library cannot read (a malformed JSON line, a missing
    column) as one ValueError naming the cause, not datasets' traceback (issue 55.8)."""
    try:
        yield
    except Exception as e:
        if not type(e).__module__.startswith("datasets"):
            raise
        cause = e
        while cause.__cause__ is not None:  # (datasets wraps the reader's own error)
            cause = cause.__cause__
        raise ValueError(
            f"the data of task {', '.join(map(str, tasks))} cannot be read: {type(cause).__name__}: {cause}"
        ) from None


def warm_up(loaded: tuple, options: dict) -> None:
    """One short decode with a setting's options before its evaluation, so that MLX's
    one-time work (kernel builds, a cache's compiled window) is not in its tok/s: without
    it the first setting of a sweep looked slower than the same setting run second."""
    model, tokenizer = loaded
    prompt = list(tokenizer.encode("1+1=", add_special_tokens=False)) or [int(tokenizer.eos_token_id)]
    generate_until(model, tokenizer, [prompt], [8], [[]], options, batch_size=1)


def _options(options: dict, setting: dict) -> dict:
    """A setting's decoding options: the flags', the setting's over them (None: unset)."""
    merged = {**options, **{k: v for k, v in setting.items() if k != "max_tokens"}}
    return {k: v for k, v in merged.items() if v is not None}


def _file_stem(args: argparse.Namespace, tasks: Sequence[str]) -> str:
    """mlx_lm.evaluate's file name: eval, the model, lm-eval's version, the shots, the tasks."""
    model = Path(args.model).name if Path(args.model).exists() else str(args.model).replace("/", "_")
    keys = ["eval", model, version("lm_eval")]
    if args.num_shots is not None:
        keys.append(f"{args.num_shots:02d}")
    return "_".join(keys + [Path(t).stem for t in tasks])


def _record(args: argparse.Namespace, setting: dict, results: dict, speed: dict) -> dict:
    kept = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")
    return {
        "model": str(args.model),
        "setting": sweep.label(setting),
        "speed": speed,
        **{k: results[k] for k in kept if k in results},
    }


def _plain(value: Any) -> Any:
    """What json cannot write (lm-eval's configs hold functions and numpy numbers): its text."""
    return value.item() if hasattr(value, "item") else str(value)


def _write_report(rows: list, output_dir: Path) -> None:
    table = report.markdown(rows)
    print(table, end="")
    (output_dir / TABLE_FILE).write_text(table)
    print(f"wrote {output_dir / TABLE_FILE}", file=sys.stderr)
    plotted = report.plot(rows, output_dir / PLOT_FILE)
    if plotted is not None:
        print(f"wrote {plotted}", file=sys.stderr)
