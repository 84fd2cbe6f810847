"""A chat REPL for diffusion models: mlx_lm.chat's flags, commands and screen, plus
the diffusion defaults and a live canvas.

    mlx_lm_diffusion.chat [--model PATH] [--max-tokens N] [--block-length 32] [--show-canvas]

Without --model it chats with the embedded demo model (as mlx_lm_diffusion.generate does).

Like mlx_lm.chat, each turn sends only the new user message through the chat
template; the conversation so far lives in the prompt cache (a `compat.TokenCache`
holding every earlier prompt and reply token), so the model reads the whole
conversation. `r` clears it, `q` (or end of input, or Ctrl-C at the prompt) quits,
`h` shows the commands; Ctrl-C during a reply ends that reply. With a checkpoint that
takes images (DiffusionGemma with its processor), `/image PATH` attaches an image to
the next message (images.ConversationImages keeps the conversation's images).

A model without a chat template (a base model, the embedded demo before it had one)
gets each message as its raw prompt, on its own (there are no turns to tell apart);
a one-line notice says so at start. mlx_lm.chat's flags that cannot apply to a
diffusion model (--max-kv-size, --prefill-step-size, --pipeline) are refused at
start with one line, exit 2, as is a --model that cannot be loaded.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

import mlx.core as mx
import mlx_lm.chat as mlx_chat
from mlx_lm.cli_ui import ChatUI, print_chat_help, print_header_panel
from mlx_lm.sample_utils import make_sampler

from mlx_lm_diffusion import kernel_cache
from mlx_lm_diffusion.api import compat
from mlx_lm_diffusion.cli.canvas_view import CanvasView
from mlx_lm_diffusion.cli.generate import load_for_cli
from mlx_lm_diffusion.cli.plain_output import plain_unless_terminal
from mlx_lm_diffusion.decoding import default_max_tokens
from mlx_lm_diffusion.demo import MODEL_HELP, model_or_demo
from mlx_lm_diffusion.flags import one_line_errors, refuse_flags, refused_flag
from mlx_lm_diffusion.media import images
from model_adapters import adapter_for, is_diffusion_model

PROG = "mlx_lm_diffusion.chat"

# mlx_lm.chat's flags that cannot apply to a diffusion model -> why.
REFUSED = {
    "max_kv_size": compat.NO_KV_WINDOW,
    "prefill_step_size": "there is no prefill to split: every forward reads the prompt and the canvas together",
    "pipeline": "distributed (pipelined or tensor-parallel) decoding is not built for diffusion models; run on one device",
}

NO_TEMPLATE_NOTICE = (
    "note: this model has no chat template; each message is sent as its raw prompt, on its own (no conversation)"
)


def setup_arg_parser() -> argparse.ArgumentParser:
    """mlx_lm.chat's parser (same flags) plus the diffusion defaults and --show-canvas."""
    parser = one_line_errors(mlx_chat.setup_arg_parser())
    parser.prog = PROG
    parser.description = "Chat with a diffusion language model"
    parser.set_defaults(model=None)  # mlx_lm.chat's default is an autoregressive model: ours, the demo
    parser.set_defaults(max_tokens=None)  # the model's own (generation_config.json), as the generate CLI
    for action in parser._actions:
        if action.dest == "model":
            action.help = MODEL_HELP
        if action.dest == "max_tokens":
            action.help = "Maximum tokens per reply (default: the model's generation_config.json, else 256)"
    refuse_flags(parser, REFUSED)
    compat.add_decode_arguments(parser)
    parser.add_argument(
        "--show-canvas",
        action="store_true",
        help="Show the canvas being unmasked (on stderr); each reply is printed once final",
    )
    return parser


def _sampler(args: argparse.Namespace, tokenizer: Any) -> Callable[[mx.array], mx.array]:
    return make_sampler(
        args.temp,
        args.top_p,
        xtc_threshold=args.xtc_threshold,
        xtc_probability=args.xtc_probability,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )


def _turn_prompt(
    tokenizer: Any, args: argparse.Namespace, query: str, pictures: Optional[images.ConversationImages] = None
):
    """The turn's prompt ids, and the conversation's vision inputs (None without images)."""
    messages = []
    if args.system_prompt is not None and tokenizer.has_chat_template:
        messages.append({"role": "system", "content": args.system_prompt})
    messages.append({"role": "user", "content": query})
    if pictures is not None:
        ids, vision = pictures.turn(tokenizer, messages)
        if ids is not None:
            return ids, vision
    if not tokenizer.has_chat_template:
        return list(tokenizer.encode(query)), None
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True), None


def keeps_turns(tokenizer: Any) -> bool:
    """Whether the chat template renders a conversation's earlier turns. Without one,
    or with one that renders the last message only (the demo model's: it answers one
    sum at a time), a conversation has no turns to keep: each message stands alone."""
    if not getattr(tokenizer, "has_chat_template", False):
        return False
    first = "first-turn-4d1f"
    conversation = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": "reply-9c2e"},
        {"role": "user", "content": "second-turn-7b3a"},
    ]
    try:
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 (a template with rules of its own: keep the turns, as mlx_lm.chat does)
        return True
    return not isinstance(rendered, str) or first in rendered


def chat_loop(model: Any, tokenizer: Any, args: argparse.Namespace, ui: Any, draft_callback=None) -> None:
    """mlx_lm.chat's loop: one turn per query, the conversation kept in the prompt cache.
    A turn the model cannot take (the conversation fills its context) is reported,
    not fatal; Ctrl-C during a turn ends the turn, at the prompt it quits. `tokenizer`
    may be a processor (images: `/image PATH`)."""
    options = compat.decode_defaults(args)
    pictures = images.ConversationImages(tokenizer if images.is_processor(tokenizer) else None)
    tokenizer = images.text_tokenizer(tokenizer)
    templated = keeps_turns(tokenizer)
    prompt_cache = compat.make_prompt_cache(model)
    while True:
        try:
            query = ui.prompt()
        except (EOFError, KeyboardInterrupt):
            ui.say_bye()
            return
        if query == "q":
            ui.say_bye()
            return
        if query == "r":
            prompt_cache = compat.make_prompt_cache(model)
            pictures.reset()
            ui.say_reset()
            continue
        if query == "h":
            ui.say_help()
            continue
        if query.startswith(images.IMAGE_COMMAND + " ") or query == images.IMAGE_COMMAND:
            try:
                print(pictures.attach(query[len(images.IMAGE_COMMAND) :]), flush=True)
            except ValueError as e:
                print(f"[error: {e}]", flush=True)
            continue
        if not templated:  # no turns to tell apart (or none kept): each message on its own
            prompt_cache = compat.make_prompt_cache(model)
            pictures.pixels = []
        last_response, held = None, []
        try:
            prompt, vision = _turn_prompt(tokenizer, args, query, pictures)
            if vision is not None:
                options["vision"] = vision
            else:
                options.pop("vision", None)
            for response in compat.stream_generate(
                model,
                tokenizer,
                prompt,
                max_tokens=default_max_tokens(model) if args.max_tokens is None else args.max_tokens,
                sampler=_sampler(args, tokenizer),
                prompt_cache=prompt_cache,
                draft_callback=draft_callback,
                **options,
            ):
                if draft_callback is None:
                    ui.stream_token(response.text)
                else:  # the canvas is on screen: the reply waits until it is final
                    held.append(response.text)
                last_response = response
        except ValueError as e:
            held.append(f"[error: {e}; type 'r' to start a new conversation]")
        except KeyboardInterrupt:
            held.append(" [interrupted]")
        finally:
            close = getattr(draft_callback, "close", None)
            if close is not None:
                close()
        if held:
            ui.stream_token("".join(held))
        ui.end_turn(last_response)


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class DiffusionChatUI(ChatUI):
    """mlx_lm.chat's screen under this door's name; where output is not a terminal (or
    NO_COLOR is set), a plain '> ' prompt instead of the corridor's cursor moves (a piped
    query echoed after it, so the answer starts a line of its own)."""

    def __init__(self, args, colour: bool = True):
        super().__init__(args)
        self._colour = colour

    def __enter__(self):
        args = self._args
        rows = [("model", str(args.model))]
        if args.adapter_path:
            rows.append(("adapter", str(args.adapter_path)))
        rows.append(("max tokens", f"{args.max_tokens:,}"))
        if args.system_prompt:
            rows.append(
                ("system", args.system_prompt if len(args.system_prompt) <= 60 else args.system_prompt[:57] + "...")
            )
        print_header_panel(self._console, "mlx_lm_diffusion.chat", rows)
        print_chat_help(self._console)
        return self

    def prompt(self) -> str:
        if self._colour:
            return super().prompt()
        query = input("> ")
        if not sys.stdin.isatty():  # (a piped query is not echoed: the transcript shows it)
            print(query)
        return query


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:  # (as a program: MLX's kernels in the user's own cache, not a shared /tmp)
        kernel_cache.use_for_cli()
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    refused = refused_flag(parser, args, REFUSED)
    if refused is not None:
        fail(refused)
    try:
        compat.decode_defaults(args)
    except ValueError as e:
        fail(str(e))
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer warns about model types it does not know
    mx.random.seed(args.seed)
    args.model = model_or_demo(args.model)
    try:
        model, tokenizer = load_for_cli(args)
    except ValueError as e:
        fail(str(e))
    except KeyboardInterrupt:
        return 130
    if not is_diffusion_model(model):
        fail(f"{args.model} is not a diffusion model; use mlx_lm.chat for it")
    if args.max_tokens is None:  # (shown on the chat's screen)
        args.max_tokens = default_max_tokens(model)
    view, text = None, images.text_tokenizer(tokenizer)  # (a processor's tokenizer, for the text)
    if args.show_canvas:
        view = CanvasView(text, adapter_for(model, text).mask_id)
    with plain_unless_terminal() as colour, DiffusionChatUI(args, colour) as ui:
        if not text.has_chat_template:
            print(NO_TEMPLATE_NOTICE, flush=True)
        try:
            chat_loop(model, tokenizer, args, ui, draft_callback=view)
        except KeyboardInterrupt:  # between the loop's own handlers (e.g. while drawing)
            ui.say_bye()
    return 0


if __name__ == "__main__":
    sys.exit(main())
