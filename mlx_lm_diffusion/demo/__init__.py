"""The embedded demo model: a small LLaDA-architecture model that adds two numbers.

It was trained in this repository (`python -m mlx_lm_diffusion.demo.train`, see
model/recipe.json for the exact command, seed and metrics) on problems such as
"357+468=" -> "825" (operands of 1 to 4 digits, 0-9999), and ships inside the package so
the CLI, the tests and the benchmarks run offline:

    model, tokenizer = mlx_lm_diffusion.load(DEMO_MODEL_PATH)
    mlx_lm_diffusion.generate(model, tokenizer, "357+468=")   # "825", then EOS

It behaves like an instruct dLLM: every training answer was followed by EOS and EOS
padding over canvases of varied lengths, so any max_tokens from 5 (the answer's slots:
blanks, whose text is empty, then the digits; model/RECIPE.md) up to the context gives
the same answer and stops at EOS; its tokenizer has a chat template (the last user
message as is) and its generation_config.json the decoding defaults that `load` reads.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from mlx_lm_diffusion.api.loading import load
from mlx_lm_diffusion.demo.problems import GEN_LENGTH, answer_text, held_out_problems, is_held_out, prompt_text

DEMO_MODEL_PATH = Path(__file__).resolve().parent / "model"
DEMO_MAX_TOKENS = GEN_LENGTH  # a small canvas that holds any answer (5 slots), its EOS and padding


# The CLIs' --model help (generate, chat): what model_or_demo does without it.
MODEL_HELP = (
    "The path to the local model directory or Hugging Face repo. "
    "Without it, the embedded demo model (it adds two numbers) is used."
)


def model_or_demo(model: Optional[str]) -> str:
    """A CLI's --model, or, when none was given, the embedded demo's path (said on stderr,
    so that a newcomer's first command runs offline and says what it ran)."""
    if model is not None:
        return model
    print("no --model given: using the embedded demo model (adds two numbers, e.g. '357+468=')", file=sys.stderr)
    return str(DEMO_MODEL_PATH)


def load_demo():
    """(model, tokenizer) of the embedded demo checkpoint."""
    return load(str(DEMO_MODEL_PATH))


__all__ = [
    "DEMO_MODEL_PATH",
    "DEMO_MAX_TOKENS",
    "load_demo",
    "model_or_demo",
    "MODEL_HELP",
    "held_out_problems",
    "is_held_out",
    "prompt_text",
    "answer_text",
]
