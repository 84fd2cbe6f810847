"""DiffusionGemma's images: mlx-vlm's Gemma 4 vision tower and projector, the prompt's
image features in place of its image tokens, and the encoder mask over image blocks.

The modules are mlx-vlm's own (`mlx_vlm.models.gemma4`: `VisionModel`, `MultimodalEmbedder`);
this file only wires them into the family's encoder:

* features: the vision tower's pooled soft tokens, projected to the text width, replace
  the embeddings of the prompt's image (and video) placeholder tokens, in order;
* mask: with `use_bidirectional_attention == "vision"` (the released configs), the tokens
  of one contiguous image block attend to each other both ways, on top of the causal
  (and sliding-window) mask, as transformers' `get_block_sequence_ids_for_mask` and
  mlx-vlm's encoder do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn


def vision_config(config: Optional[dict]) -> Any:
    """mlx-vlm's Gemma 4 VisionConfig of a checkpoint's `vision_config`, or None. Without
    mlx-vlm (the `vision` extra) the checkpoint loads text only, as before images."""
    if not config:
        return None
    try:
        from mlx_vlm.models.gemma4.config import VisionConfig
    except ImportError:
        import warnings

        warnings.warn(
            'mlx-vlm is not installed (pip install -e ".[vision]" in a clone): '
            "DiffusionGemma loads without its vision tower, text only",
            stacklevel=2,
        )
        return None

    return VisionConfig.from_dict(dict(config))


def vision_modules(config: Any, text_hidden_size: int) -> tuple[nn.Module, nn.Module]:
    """mlx-vlm's vision tower and the projector into the text model's width."""
    from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
    from mlx_vlm.models.gemma4.vision import VisionModel

    return VisionModel(config), MultimodalEmbedder(config.hidden_size, text_hidden_size, eps=config.rms_norm_eps)


@dataclass
class VisionInputs:
    """What a prompt's images add to its token ids: the processor's pixel values (one
    array, or one per image when sizes differ) and the token types (1 image, 2 video)."""

    pixel_values: Any
    mm_token_type_ids: Optional[mx.array] = None
    count: int = 0  # images and videos, for messages
    # videos: the processor gives frames as patches, with their (x, y) positions
    position_ids: Optional[mx.array] = None


def vision_token_mask(
    inputs: mx.array, token_ids: Sequence[Optional[int]], mm_token_type_ids: Optional[mx.array] = None
) -> mx.array:
    """(B, N) True where a soft token of an image or video frame goes."""
    mask = mx.zeros(inputs.shape, dtype=mx.bool_)
    for t in token_ids:
        if t is not None:
            mask = mask | (inputs == t)
    if mm_token_type_ids is not None and mm_token_type_ids.shape == inputs.shape:
        mask = mask | (mm_token_type_ids == 1) | (mm_token_type_ids == 2)
    return mask


def scatter_features(embeddings: mx.array, mask: mx.array, features: mx.array) -> mx.array:
    """`embeddings` with the rows under `mask` replaced by `features`, in order."""
    from mlx_vlm.models.gemma4.gemma4 import masked_scatter

    wanted = int(mask.sum().item())
    have = features.shape[0] * features.shape[1] if features.ndim == 3 else features.shape[0]
    if wanted != have:
        raise ValueError(
            f"the prompt has {wanted} image tokens but its images give {have} soft tokens; "
            "build the prompt with the checkpoint's processor (one image placeholder per image)"
        )
    wide = mx.broadcast_to(mask[..., None], embeddings.shape)
    return masked_scatter(embeddings, wide, features.astype(embeddings.dtype))


def encoder_masks(vision: mx.array, offset: int, window: int) -> dict:
    """Boolean masks (B, 1, N, offset + N) for the full and the sliding layers: causal,
    within `window` on sliding layers, or-ed with "same image block" (bidirectional)."""
    B, N = vision.shape
    previous = mx.concatenate([mx.zeros_like(vision[:, :1]), vision[:, :-1]], axis=1)
    block = mx.cumsum((vision & ~previous).astype(mx.int32), axis=1)
    block = mx.where(vision, block, 0)  # 0: not an image token
    same = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] > 0)  # (B, N, N)
    if offset:  # keys already cached hold no image block of this pass
        same = mx.concatenate([mx.zeros((B, N, offset), dtype=mx.bool_), same], axis=-1)
    q = mx.arange(offset, offset + N)[:, None]
    k = mx.arange(offset + N)[None]
    causal = q >= k
    sliding = causal & (q - k < window)
    return {
        "full_attention": (causal[None] | same)[:, None],
        "sliding_attention": (sliding[None] | same)[:, None],
    }
