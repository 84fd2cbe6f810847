"""The generate CLI: mlx_lm.generate's flags, meaning the same, plus diffusion options.

    python -m mlx_lm_diffusion.generate --model PATH --prompt "..." [--show-canvas]

The parser is mlx_lm.generate's own (`setup_arg_parser`), so every one of its flags is
here; the ones that cannot apply to a diffusion model (speculative decoding, the
key/value cache, prefill chunking) are refused at start with one line saying why
(exit 2), never accepted and ignored. `--image PATH ...` (mlx_lm.generate's and
mlx_vlm.generate's flag) and `--video PATH ...` go to a checkpoint with a vision tower
and its processor (DiffusionGemma), one placeholder each, in order. The diffusion decoding flags come from the
options schema (`compat.add_decode_arguments`).

The Python API lives in `generation`; it is re-exported here so that
`from mlx_lm_diffusion.generate import stream_generate` works as in mlx-lm.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_lm_diffusion import kernel_cache
from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.api.compat import add_decode_arguments, decode_defaults
from mlx_lm_diffusion.api.generation import DiffusionResponse, generate, generate_batch, stream_generate  # noqa: F401
from mlx_lm_diffusion.api.loading import load
from mlx_lm_diffusion.cli.canvas_view import CanvasView
from mlx_lm_diffusion.demo import MODEL_HELP, model_or_demo
from mlx_lm_diffusion.flags import exit_status, flag_of, one_line, one_line_errors, refuse_flags, refused_flag  # noqa: F401
from mlx_lm_diffusion.media.images import require_vision, text_tokenizer
from mlx_lm_diffusion.output import unmask_order
from mlx_lm_diffusion.output.frames import FrameRecorder
from mlx_lm_diffusion.parallel import distributed
from model_adapters import adapter_for

# `import mlx_lm.generate` names mlx_lm's generate function, not its module
mlx_generate = importlib.import_module("mlx_lm.generate")

PROG = "mlx_lm_diffusion.generate"

_NO_DRAFT = (
    "speculative decoding drafts tokens for an autoregressive model; a diffusion model unmasks its canvas in parallel"
)

# mlx_lm.generate's flags that cannot apply to a diffusion model -> why.
REFUSED = {
    "draft_model": _NO_DRAFT,
    "num_draft_tokens": _NO_DRAFT,
    "max_kv_size": compat.NO_KV_WINDOW,
    "kv_bits": compat.NO_KV_QUANTIZATION,
    "kv_group_size": compat.NO_KV_QUANTIZATION,
    "quantized_kv_start": compat.NO_KV_QUANTIZATION,
    "prompt_cache_file": (
        "mlx_lm.cache_prompt's files hold an autoregressive model's key/value cache, which a "
        "diffusion decode cannot start from"
    ),
    "prefill_step_size": "there is no prefill to split: every forward reads the prompt and the canvas together",
}


def verbose_flag(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's `--verbose VALUE` ('False'/'F' turns it off), also as a bare `--verbose`."""
    for action in parser._actions:
        if action.dest == "verbose":
            action.nargs = "?"
            action.const = True
            action.metavar = "{True,False}"


def setup_arg_parser() -> argparse.ArgumentParser:
    p = mlx_generate.setup_arg_parser()
    p.prog = PROG
    p.description = "Generate text with a diffusion language model (mlx_lm.generate's flags plus diffusion options)."
    for action in p._actions:
        if action.dest == "model":
            action.help = MODEL_HELP
        if action.dest == "max_tokens":
            action.help = (
                "Maximum number of tokens to generate (default: the model's "
                "generation_config.json max_new_tokens, else 256); more than the model's "
                "context holds is capped to it"
            )
    p.set_defaults(max_tokens=None)  # None: the checkpoint's max_new_tokens, else 256
    refuse_flags(p, REFUSED)
    verbose_flag(p)
    p.add_argument(
        "--video",
        type=str,
        default=(),
        nargs="+",
        help="Video files for the video placeholders of the prompt, in order (DiffusionGemma)",
    )
    p.add_argument(
        "--show-canvas",
        action="store_true",
        help="Show the canvas being unmasked (on stderr); the answer is printed once final",
    )
    p.add_argument(
        "--trace-png",
        default=None,
        metavar="FILE",
        help="Save the unmask-order picture (position x forward, coloured by the confidence "
        "at commit) to FILE (.png, .svg or .pdf; needs matplotlib: the plot extra)",
    )
    p.add_argument(
        "--trace-anim",
        default=None,
        metavar="FILE",
        help="Save the decode as an animation, the canvas after every forward, to FILE (.gif or .webp; "
        ".mp4 with ffmpeg installed; needs Pillow: the plot extra)",
    )
    p.add_argument(
        "--suffix",
        default=None,
        help="Infill: the text after the generated span (prompt, at most --max-tokens "
        "generated tokens, then this); the families that cannot attend to it refuse it",
    )
    return one_line_errors(add_decode_arguments(p))  # --block-length, --steps, --strategy, --threshold, ...


def _template_kwargs(args: argparse.Namespace) -> dict:
    if args.chat_template_config is None:
        return {}
    try:
        config = json.loads(args.chat_template_config)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--chat-template-config is not JSON ({e.msg}); give e.g. '{{\"enable_thinking\": false}}'"
        ) from None
    if not isinstance(config, dict):
        raise ValueError("--chat-template-config must be a JSON object of keyword arguments")
    return config


def _media_parts(args: argparse.Namespace) -> list:
    """The user message's image and video parts (--image, --video), before its text."""
    return [{"type": "image", "image": path} for path in args.image or ()] + [
        {"type": "video", "video": path} for path in getattr(args, "video", None) or ()
    ]


def _build_prompt(tokenizer: TokenizerWrapper, args: argparse.Namespace):
    """The prompt's token ids; with --image/--video, the chat messages (or the text)
    that the processor turns into ids and pixel values."""
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    media = _media_parts(args)
    if media and use_chat_template:
        messages = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
        return messages + [{"role": "user", "content": media + [{"type": "text", "text": prompt}]}]
    if media:
        return prompt
    if use_chat_template:
        messages = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
        messages.append({"role": "user", "content": prompt})
        prefill = getattr(args, "prefill_response", None)
        if prefill is not None:
            messages.append({"role": "assistant", "content": prefill})
        prompt = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            continue_final_message=prefill is not None,
            add_generation_prompt=prefill is None,
            **_template_kwargs(args),
        )
    elif getattr(args, "prefill_response", None) is not None:
        prompt += args.prefill_response
    return list(tokenizer.encode(prompt, add_special_tokens=not use_chat_template))


def make_cli_sampler(args: argparse.Namespace, tokenizer: TokenizerWrapper):
    """mlx_lm.generate's sampler from the flags (None: greedy, the engine's fast path)."""
    if args.temp <= 0:
        return None
    return make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:  # (as a program: MLX's kernels in the user's own cache, not a shared /tmp)
        kernel_cache.use_for_cli()
    # Under mlx.launch every rank runs this with the same flags (mlx_lm_diffusion.parallel.distributed).
    group = distributed.launched_group()
    with distributed.group_failures_end_the_process(group):
        return _main(argv, group)


def _main(argv: Optional[Sequence[str]], group=None) -> int:
    run = distributed.DistributedRun(group)
    run.silence()
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    refused = refused_flag(parser, args, REFUSED)
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer warns about model types it does not know
    return exit_status(lambda: _decode(args, run, group))


def _decode(args: argparse.Namespace, run: distributed.DistributedRun, group=None) -> None:
    """Load, build the prompt, generate and print (the answer on stdout, the canvas on stderr)."""
    options = decode_defaults(args)
    _template_kwargs(args)  # a bad --chat-template-config fails before loading
    if args.image or args.video:
        require_vision()  # (without the extra: which one to install, before any loading)
    if args.trace_png is not None:
        _check_trace_path(args.trace_png)
    if args.trace_anim is not None:
        _check_anim_path(args.trace_anim)

    args.model = model_or_demo(args.model)
    model, loaded = load_for_cli(args, group)
    tokenizer = text_tokenizer(loaded)  # (a processor's tokenizer, for the text)
    for eos_token in args.extra_eos_token:
        tokenizer.add_eos_token(eos_token)
    ids = distributed.share_object(group, _build_prompt(tokenizer, args))  # (stdin: rank 0's)
    if args.suffix is not None:
        options["suffix"] = args.suffix.replace("\\n", "\n").replace("\\t", "\t")
    if args.image or args.video:
        tokenizer = loaded  # the processor places the images' tokens
        if isinstance(ids, str):  # no chat template: the images go with the text
            options.update(image=list(args.image) or None, video=list(args.video) or None)
    sampler = make_cli_sampler(args, text_tokenizer(tokenizer))
    adapter = adapter_for(model, text_tokenizer(tokenizer))
    mask_id, title = adapter.mask_id, trace_title(args.model, adapter.family, options)
    if not args.show_canvas:
        callback = _traced(args, mask_id, run.progress(), text_tokenizer(tokenizer))
        text = generate(
            model,
            tokenizer,
            ids,
            max_tokens=args.max_tokens,
            verbose=args.verbose,
            sampler=sampler,
            seed=args.seed,
            draft_callback=callback,
            **options,
        )
        run.finished(text)
        if not args.verbose:
            print(text)
        _save_trace(args, callback, text_tokenizer(tokenizer), group, title)
        return
    # The canvas on stderr, the answer on stdout once final: they never share a line.
    view = CanvasView(text_tokenizer(tokenizer), mask_id)
    shown = view if distributed.is_leader(group) else None  # (rank 0 draws the canvas)
    callback = _traced(args, mask_id, run.progress(shown), text_tokenizer(tokenizer))
    text, last = "", None
    try:
        for last in stream_generate(
            model,
            tokenizer,
            ids,
            max_tokens=args.max_tokens,
            sampler=sampler,
            seed=args.seed,
            draft_callback=callback,
            **options,
        ):
            text += last.text
    finally:
        view.close()
    run.finished(text)
    if args.verbose:
        print("=" * 10)
        print(text)
        print_stats(last)
    else:
        print(text)
    _save_trace(args, callback, text_tokenizer(tokenizer), group, title)


def _check_trace_path(path: str) -> None:
    """--trace-png's file: a picture format matplotlib writes, and matplotlib there (before loading)."""
    if not path.lower().endswith((".png", ".svg", ".pdf")):
        raise ValueError(f"--trace-png {path!r}: name a .png, .svg or .pdf file")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--trace-png needs matplotlib: pip install 'mlx-lm-diffusion[plot]' "
            '(from a clone: pip install -e ".[plot]")'
        ) from None


def _check_anim_path(path: str) -> None:
    """--trace-anim's file: a format it writes, and what writes it there (before loading)."""
    from mlx_lm_diffusion.output import animation

    if not path.lower().endswith(animation.FORMATS):
        raise ValueError(f"--trace-anim {path!r}: name a {', '.join(animation.FORMATS)} file")
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ValueError("--trace-anim needs Pillow: pip install 'mlx-lm-diffusion[plot]'") from None
    if path.lower().endswith(".mp4") and shutil.which("ffmpeg") is None:
        raise ValueError("--trace-anim: an .mp4 needs ffmpeg on PATH; name a .gif or .webp file")


def _traced(args: argparse.Namespace, mask_id, then, tokenizer):
    """The draft callback `then`, recorded for --trace-png's picture and --trace-anim's
    animation when asked for."""
    if args.trace_png:
        then = unmask_order.OrderRecorder(mask_id, then)
    if args.trace_anim:
        then = FrameRecorder(tokenizer, mask_id, then)
    return then


def _save_trace(args: argparse.Namespace, callback, tokenizer, group, title: str) -> None:
    """The unmask-order picture of row 0, over the positions the decode committed (a
    decode that ends early leaves its later blocks out), and the animation."""
    if not distributed.is_leader(group):
        return
    if isinstance(callback, FrameRecorder):
        from mlx_lm_diffusion.output.animation import save_animation

        save_animation(callback.frames, args.trace_anim, title=title)
        callback = callback.then
    if isinstance(callback, unmask_order.OrderRecorder):
        order = callback.order(callback.committed_span())
        labels = [tokenizer.decode([t]) for t in callback.tokens[: len(order.forward)]]
        unmask_order.draw(order, args.trace_png, labels=labels, title=title)


def trace_title(model: str, family: str, options: dict) -> str:
    """A picture's title: the model's name, its family and the decoding settings given."""
    shown = {k: v for k, v in options.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
    settings = ", ".join(f"{k}={v}" for k, v in sorted(shown.items()))
    return f"{Path(str(model)).name} ({family})" + (f": {settings}" if settings else "")


def print_stats(response) -> None:
    """generate(verbose=True)'s closing lines."""
    print("=" * 10)
    if response is None:
        return
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
    print(
        f"Generation: {response.generation_tokens} tokens, "
        f"{response.generation_tps:.3f} tokens-per-sec, {response.forwards} forwards"
    )
    print(f"Peak memory: {response.peak_memory:.3f} GB")


def load_for_cli(args: argparse.Namespace, group=None):
    """`load` with the CLI's --adapter-path, --trust-remote-code, --quantize-activations
    (and this rank's shard under mlx.launch); a model that cannot be loaded is a
    ValueError saying so."""
    model_config = {"quantize_activations": True} if getattr(args, "quantize_activations", False) else None
    try:
        return load(
            args.model,
            adapter_path=getattr(args, "adapter_path", None),
            trust_remote_code=getattr(args, "trust_remote_code", False),
            model_config=model_config,
            group=group,
        )
    except (ValueError, OSError) as e:
        reason = one_line(e)
        raise ValueError(reason if str(args.model) in reason else f"cannot load --model {args.model}: {reason}") from e


if __name__ == "__main__":
    sys.exit(main())
