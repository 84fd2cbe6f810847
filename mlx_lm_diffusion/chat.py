"""A chat REPL for diffusion models: mlx_lm.chat's flags and screen, plus the
diffusion defaults and a live canvas.

    mlx_lm_diffusion.chat --model PATH [--max-tokens 256] [--block-length 32] [--show-canvas]

Like mlx_lm.chat, each turn sends only the new user message through the chat
template; the conversation so far lives in the prompt cache (a `compat.TokenCache`
holding every earlier prompt and reply token), so the model reads the whole
conversation. `r` clears it, `q` (or end of input) quits, `h` shows the commands.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx_lm.chat as mlx_chat
from mlx_lm.cli_ui import ChatUI
from mlx_lm.sample_utils import make_sampler

from model_adapters import adapter_for, is_diffusion_model

from . import compat
from .canvas_view import CanvasView

PROG = "mlx_lm_diffusion.chat"


def setup_arg_parser() -> argparse.ArgumentParser:
    """mlx_lm.chat's parser (same flags) plus the diffusion defaults and --show-canvas."""
    parser = mlx_chat.setup_arg_parser()
    parser.prog = PROG
    parser.description = "Chat with a diffusion language model"
    parser.set_defaults(model=None)  # mlx_lm.chat's default is an autoregressive model
    compat.add_decode_arguments(parser)
    parser.add_argument("--show-canvas", action="store_true",
                        help="Show the canvas being unmasked (on stderr)")
    return parser


def _sampler(args: argparse.Namespace, tokenizer: Any) -> Callable[[mx.array], mx.array]:
    return make_sampler(
        args.temp,
        args.top_p,
        xtc_threshold=args.xtc_threshold,
        xtc_probability=args.xtc_probability,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )


def chat_loop(model: Any, tokenizer: Any, args: argparse.Namespace, ui: Any, draft_callback=None) -> None:
    """mlx_lm.chat's loop: one turn per query, the conversation kept in the prompt cache.
    A turn the model cannot take (the conversation fills its context) is reported,
    not fatal."""
    options = compat.decode_defaults(args)
    prompt_cache = compat.make_prompt_cache(model)
    while True:
        try:
            query = ui.prompt()
        except EOFError:
            ui.say_bye()
            return
        if query == "q":
            ui.say_bye()
            return
        if query == "r":
            prompt_cache = compat.make_prompt_cache(model)
            ui.say_reset()
            continue
        if query == "h":
            ui.say_help()
            continue
        messages = []
        if args.system_prompt is not None:
            messages.append({"role": "system", "content": args.system_prompt})
        messages.append({"role": "user", "content": query})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        last_response = None
        try:
            for response in compat.stream_generate(
                model,
                tokenizer,
                prompt,
                max_tokens=args.max_tokens,
                sampler=_sampler(args, tokenizer),
                prompt_cache=prompt_cache,
                draft_callback=draft_callback,
                **options,
            ):
                ui.stream_token(response.text)
                last_response = response
        except ValueError as e:
            ui.stream_token(f"[error: {e}; type 'r' to start a new conversation]")
        ui.end_turn(last_response)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model is required: a local path or a Hugging Face repo of a diffusion model")
    try:
        compat.decode_defaults(args)
    except ValueError as e:
        parser.error(str(e))
    from mlx_lm.utils import load
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer warns about model types it does not know
    mx.random.seed(args.seed)
    model, tokenizer = load(
        args.model,
        adapter_path=args.adapter_path,
        tokenizer_config={"trust_remote_code": args.trust_remote_code},
        trust_remote_code=args.trust_remote_code,
    )
    if not is_diffusion_model(model):
        parser.error(f"{args.model} is not a diffusion model; use mlx_lm.chat for it")
    view = None
    if args.show_canvas:
        view = CanvasView(tokenizer, adapter_for(model, tokenizer).mask_id)
    with ChatUI(args) as ui:
        chat_loop(model, tokenizer, args, ui, draft_callback=view)
    return 0


if __name__ == "__main__":
    sys.exit(main())
