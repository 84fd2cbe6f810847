"""DiffusionGemma's checkpoint names: transformers' and mlx-vlm's layouts read into the
adapter's modules (model_adapters.families.diffusion_gemma.Model.sanitize).

Experts come fused (transformers: gate and up stacked in one tensor), per expert (some
exports) or as mlx-vlm's SwitchLinear names; the encoder's language model is tied to
the decoder's, so its tensors (bar its layer scalars) are dropped, as are the rotary
buffers and the tied head.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx


def sanitize(weights: dict, has_vision: bool, vision: Any) -> dict:
    """The adapter's weights from a checkpoint's (`vision`: the vision tower's config,
    whose clipped linears decide whether clipping bounds are kept)."""
    out = {}
    for key, value in _stack_experts(weights).items():
        if key == "lm_head.weight" or "rotary_emb" in key:
            continue  # tied to the decoder's embeddings
        if key.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.")):
            if has_vision and not _unused_clip_bound(key, vision):
                out[key] = value
            continue
        if key.startswith("model.encoder.language_model.") and not key.endswith(".layer_scalar"):
            continue  # tied to the decoder's
        m = _EXPERTS.match(key)
        if m is None:
            out[key] = value
            continue
        base, name, suffix = m.group(1), m.group(2), m.group(3) or ".weight"
        if name == "down_proj":
            out[f"{base}.switch_glu.down_proj{suffix}"] = value
        else:  # gate and up stacked along the output rows
            gate, up = mx.split(value, 2, axis=-2)
            out[f"{base}.switch_glu.gate_proj{suffix}"] = mx.contiguous(gate)
            out[f"{base}.switch_glu.up_proj{suffix}"] = mx.contiguous(up)
    return out


def _unused_clip_bound(key: str, vision: Any) -> bool:
    """Clipping calibration tensors, which only clipped linears read (mlx-vlm drops them too)."""
    bound = key.rsplit(".", 1)[-1] in ("input_max", "input_min", "output_max", "output_min")
    return bound and not getattr(vision, "use_clipped_linears", False)


# transformers' fused expert tensors (no suffix) and mlx-vlm's SwitchLinear names
_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(\.weight|\.scales|\.biases)?$")
# one tensor per expert, as some exports store them
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scales|biases)$")


def _stack_experts(weights: dict) -> dict:
    """experts.<i>.<proj>.<suffix> tensors stacked into experts.switch_glu.<proj>.<suffix>."""
    groups: dict = {}
    out = {}
    for key, value in weights.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = value
        else:
            base, i, proj, suffix = m.groups()
            groups.setdefault(f"{base}.switch_glu.{proj}.{suffix}", {})[int(i)] = value
    for key, experts in groups.items():
        out[key] = mx.stack([experts[i] for i in range(len(experts))])
    return out
