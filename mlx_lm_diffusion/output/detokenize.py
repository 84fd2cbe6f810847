"""The answer's streaming detokenizer: mlx-lm's, keeping the text the model wrote.

mlx-lm's streaming detokenizers drop the leading space of the first text they release
(`BPEStreamingDetokenizer._maybe_trim_space` while no text is out; the SPM one's
`trim_space`): an answer the model wrote as " Paris" came back as "Paris", while the
token's own text (OpenAI's log-probability entry, `tokenizer.decode`) keeps the space, so
the entries could not add up to the answer (issue 54.2). A diffusion answer is a canvas
of the model's tokens, not a continuation of the prompt's text: it is released as written.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer


def _as_written(text: str) -> str:
    return text


def answer_detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer of `tokenizer` (mlx-lm's TokenizerWrapper) that keeps
    the answer's leading space."""
    detokenizer = tokenizer.detokenizer  # (a reset copy per caller)
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        detokenizer.trim_space = False
    elif isinstance(detokenizer, BPEStreamingDetokenizer):
        detokenizer._maybe_trim_space = _as_written  # (its only trimming; per instance)
    return detokenizer


__all__ = ["answer_detokenizer"]
