"""The embedded demo model: a small LLaDA-architecture model that adds 3-digit numbers.

It was trained in this repository (`python -m mlx_lm_diffusion.demo.train`, see
model/recipe.json for the exact command, seed and metrics) on problems such as
"357+468=" -> "825" (two operands of three digits), and ships inside the package so the
CLI, the tests and the benchmarks run offline:

    model, tokenizer = mlx_lm_diffusion.load(DEMO_MODEL_PATH)
    mlx_lm_diffusion.generate(model, tokenizer, "357+468=", max_tokens=DEMO_MAX_TOKENS)

Its default decoding is the LLaDA family default (low_confidence, one token per step)
over a canvas of DEMO_MAX_TOKENS positions: the answer, then EOS padding, as trained.
"""

from __future__ import annotations

from pathlib import Path

from .problems import GEN_LENGTH, answer_text, held_out_problems, is_held_out, prompt_text

DEMO_MODEL_PATH = Path(__file__).resolve().parent / "model"
DEMO_MAX_TOKENS = GEN_LENGTH  # generated positions per prompt: answer + EOS padding


def load_demo():
    """(model, tokenizer) of the embedded demo checkpoint."""
    from .. import load

    return load(str(DEMO_MODEL_PATH))


__all__ = [
    "DEMO_MODEL_PATH",
    "DEMO_MAX_TOKENS",
    "load_demo",
    "held_out_problems",
    "is_held_out",
    "prompt_text",
    "answer_text",
]
