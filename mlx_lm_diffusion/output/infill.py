"""Infilling: generate the text between a prompt and a suffix; seeded canvases.

A masked diffusion model decodes positions in any order, so text after the span can
condition it. The canvas of an infill is

    prompt | max_tokens free positions | suffix (pinned)

and the output is the filled middle: at most max_tokens tokens, ended early by an EOS
(or padding) the model puts inside the span. The suffix is pinned: no decoder ever
changes it (Canvas.pinned).

Per family, what its attention allows (`Adapter.suffix_refusal`):

- full-canvas bidirectional attention (LLaDA, Dream): every step sees the suffix.
  Dream's logit shift reads position i from row i - 1, so the middle's last position
  comes from the row before it and the suffix's own rows are never read; the engine's
  blocks cover the middle only.
- a uniform-noise canvas (DiffusionGemma): the suffix is pinned inside the canvas,
  right after the middle (the canvas's positions after the suffix are decoded and
  dropped, as positions past max_tokens are); the middle and the suffix must share
  one canvas, since a canvas sees only the canvases before it.
- block-causal attention (SDAR, LLaDA2), a causal prefix (Nemotron-Labs Diffusion),
  autoregressive models: a block never attends to text after it, so a suffix could
  not condition the middle; these refuse with a ValueError rather than ignore it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import numpy as np

from mlx_lm_diffusion.decoding import FREE, decoder_class


def check_suffix(adapter: Any, suffix: Sequence[int]) -> None:
    """Refuse a suffix the family cannot attend to, or ids it cannot take (ValueError)."""
    refusal = getattr(adapter, "suffix_refusal", None)
    if refusal is not None:
        raise ValueError(f"{adapter.family} cannot infill before a suffix: {refusal}")
    if adapter.mask_id is not None and adapter.mask_id in suffix:
        raise ValueError(f"the suffix contains the mask token (id {adapter.mask_id}); remove it")
    bad = [t for t in suffix if not 0 <= t < adapter.vocab_size]
    if bad:
        raise ValueError(f"suffix token ids {bad[:5]} lie outside the vocabulary [0, {adapter.vocab_size})")


def suffix_seed(adapter: Any, options: Any, suffix: Sequence[int], rows: int) -> np.ndarray:
    """The canvas seed (rows, max_tokens + len(suffix)) of an infill: FREE over the
    middle, the suffix pinned after it (Engine.run's `seed`)."""
    check_suffix(adapter, suffix)
    N, S = options.max_tokens, len(suffix)
    if decoder_class(adapter).whole_canvases and N + S > options.block_length:
        raise ValueError(
            f"{adapter.family} decodes canvases of {options.block_length} tokens and a canvas sees only "
            f"the canvases before it: max_tokens ({N}) plus the suffix ({S} tokens) must fit one canvas"
        )
    seed = np.full((rows, N + S), FREE, dtype=np.int64)
    seed[:, N:] = np.asarray(suffix, dtype=np.int64)
    return seed


def token_ids(values: Any, what: str) -> List[int]:
    """`values` as a list of ints (numpy's included), or a ValueError naming `what`: a list of
    strings, floats or booleans is not token ids (int() would read '7' and 7.9 as ids)."""
    try:
        items = list(values)
    except TypeError:
        items = None
    if items is None or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in items):
        raise ValueError(f"{what} must be text or a list of token ids (integers), got {values!r:.60}")
    return [int(t) for t in items]


def encode_suffix(tokenizer: Any, suffix: Any) -> Optional[list]:
    """Token ids of a suffix given as text (encoded without special tokens) or ids;
    None for no suffix (None or empty: the OpenAI API's meaning of an empty suffix)."""
    if suffix is None:
        return None
    if isinstance(suffix, str):
        ids = list(tokenizer.encode(suffix, add_special_tokens=False)) if suffix else []
    else:
        ids = token_ids(suffix, "suffix")
    return ids or None


def check_seed(adapter: Any, seed: np.ndarray, free_id: Optional[int]) -> np.ndarray:
    """A seeded canvas (step-schedule protocol): `free_id` (the mask id) marks the free
    positions, any other id is pinned. Returns it with FREE at the free positions."""
    pinned = seed != free_id
    if pinned.any():
        check_suffix(adapter, [int(t) for t in seed[pinned]])
    return np.where(pinned, seed, FREE)


__all__ = ["check_suffix", "suffix_seed", "encode_suffix", "check_seed"]
