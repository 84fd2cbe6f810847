"""Which likelihood bound a family's decoding corresponds to, and over which blocks.

A masked-diffusion model gives no exact likelihood, only a bound whose shape follows the
attention it was trained with. Each adapter declares it (`Adapter.likelihood_layout`,
model_adapters.base), so a family registered later says which bound its attention implies:

- `canvas` (LLaDA, Dream: the attention sees the whole canvas; the base adapter's):
  one block, the whole continuation, noised at once: LLaDA's bound.
- `aligned` (SDAR, LLaDA2: block-causal attention on absolute positions):
  every attention block that holds continuation positions is noised in turn while the
  clean tokens before it stay in place: the block-diffusion bound (BD3-LM).
- `prefix` (Nemotron-Labs Diffusion, I-DLM, Trida2.0 / FLARE: a block attends
  bidirectionally to itself over a causally encoded prefix): blocks of the family's block length from the end of the
  context, each noised over the clean prefix, as its decode lays them out.

Refused: a uniform-noise canvas (DiffusionGemma: no mask token, so no masked bound) and
the autoregressive adapter (its exact log-likelihood is mlx_lm.evaluate's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

# The three bounds, as named above.
KINDS = ("canvas", "aligned", "prefix")


@dataclass(frozen=True)
class BoundLayout:
    """The blocks a family's bound noises. `block`: the block size (None: one block over
    the continuation); `needs_context`: the first position cannot be scored without a
    token before it (Dream reads position i from row i - 1; Nemotron's prefix is encoded
    causally and must hold a token)."""

    kind: str
    block: Optional[int] = None
    needs_context: bool = False

    def blocks(self, context_len: int, total_len: int) -> list[tuple[int, int]]:
        """The noised blocks [start, end) of a sequence whose positions [context_len,
        total_len) are the continuation; each block is scored over the clean tokens before it."""
        if total_len <= context_len:
            return []
        if self.kind == "canvas" or self.block is None:
            return [(context_len, total_len)]
        if self.kind == "aligned":  # attention blocks on absolute positions; the first may hold the context's tail
            first = context_len // self.block * self.block
            starts = range(first, total_len, self.block)
            return [(max(s, context_len), min(s + self.block, total_len)) for s in starts]
        return [(s, min(s + self.block, total_len)) for s in range(context_len, total_len, self.block)]


def bound_layout(adapter: Any) -> BoundLayout:
    """The layout of `adapter`'s family; ValueError for a family with no masked bound."""
    family = getattr(adapter, "family", type(adapter).__name__)
    if adapter.mask_id is None or getattr(adapter, "decoder", "masked_block") == "uniform_canvas":
        raise ValueError(
            f"{family}: no likelihood bound for a uniform-noise canvas (its tokens are re-drawn from noise, "
            "not unmasked, so the masked-diffusion ELBO does not apply); evaluate it with generation tasks "
            "(output_type generate_until) only"
        )
    if getattr(adapter, "predicts_next_only", False):
        raise ValueError(
            f"{family}: an autoregressive model has an exact log-likelihood, not a diffusion bound; "
            "score it with mlx_lm.evaluate"
        )
    kind = getattr(adapter, "likelihood_layout", None)
    if kind not in KINDS:
        raise ValueError(f"{family}: its adapter declares no likelihood bound (likelihood_layout {kind!r})")
    if kind == "aligned":
        return BoundLayout("aligned", int(getattr(adapter, "attention_block", None) or adapter.block_length))
    if kind == "canvas":
        return BoundLayout("canvas", None, needs_context=bool(getattr(adapter, "shift", 0)))
    return BoundLayout("prefix", int(adapter.block_length), needs_context=True)
