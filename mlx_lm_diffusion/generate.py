"""The generate CLI (mlx_lm.generate's flags plus diffusion options).

    python -m mlx_lm_diffusion.generate --model PATH --prompt "..." [--show-canvas]

The Python API lives in `generation`; it is re-exported here so that
`from mlx_lm_diffusion.generate import stream_generate` works as in mlx-lm.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from model_adapters import adapter_for

from .compat import add_decode_arguments, decode_defaults
from .generation import DiffusionResponse, generate, generate_batch, stream_generate  # noqa: F401



def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_lm_diffusion.generate",
        description="Generate text with a diffusion language model (mlx-lm's flags plus diffusion options).",
    )
    p.add_argument("--model", type=str, help="Local path or Hugging Face repo of the model")
    p.add_argument("--prompt", "-p", type=str, default="hello", help="Prompt text, '-' reads stdin")
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="Maximum tokens to generate")
    p.add_argument("--temp", type=float, default=0.0, help="Sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling top-p")
    p.add_argument("--seed", type=int, default=None, help="PRNG seed")
    p.add_argument("--system-prompt", default=None, help="System prompt for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true", help="Use the raw prompt")
    p.add_argument("--verbose", type=lambda s: s.lower() in ("1", "true", "yes"), default=True,
                   help="Print timing information (True/False)")
    p.add_argument("--show-canvas", action="store_true", help="Show the canvas being unmasked")
    return add_decode_arguments(p)  # --block-length, --steps, --strategy, --threshold, ...


def _build_prompt(tokenizer: TokenizerWrapper, args: argparse.Namespace) -> List[int]:
    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = [] if args.system_prompt is None else [{"role": "system", "content": args.system_prompt}]
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(prompt, add_special_tokens=not use_chat_template))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = setup_arg_parser()
    parser.set_defaults(max_tokens=None)  # None: 256, or the embedded demo model's own length
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # AutoTokenizer warns about model types it does not know
    try:
        from . import load
        from .canvas_view import CanvasView

        if args.model is None:  # the embedded demo model, with its own generation length
            from .demo import DEMO_MAX_TOKENS, DEMO_MODEL_PATH

            args.model = str(DEMO_MODEL_PATH)
            args.max_tokens = DEMO_MAX_TOKENS if args.max_tokens is None else args.max_tokens
            print(f"no --model given: using the embedded demo model (adds two 3-digit "
                  f"numbers, e.g. '357+468='), max_tokens {args.max_tokens}", file=sys.stderr)
        args.max_tokens = 256 if args.max_tokens is None else args.max_tokens
        model, tokenizer = load(args.model)
        ids = _build_prompt(tokenizer, args)
        sampler = make_sampler(args.temp, args.top_p) if args.temp > 0 else None
        view = CanvasView(tokenizer, adapter_for(model, tokenizer).mask_id) if args.show_canvas else None
        text = generate(
            model,
            tokenizer,
            ids,
            max_tokens=args.max_tokens,
            verbose=args.verbose,
            sampler=sampler,
            seed=args.seed,
            draft_callback=view,
            **decode_defaults(args),
        )
        if not args.verbose:
            print(text)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
