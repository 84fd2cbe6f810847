"""I-DLM's LoRA flavour: a stock Qwen3 plus a LoRA adapter that acts on the mask rows only.

thuEcstasy/I-DLM's SGLang fork serves an I-DLM as the unchanged base model with a LoRA adapter
("conditional LoRA", inference/sglang/sglang/srt/lora/backend/chunked_backend.py and the
`_setup_conditional_lora` of its decoding loop): the prompt's prefill and a round's verify rows
(the pending token and the drafts) run the base model alone, and the mask rows run base + LoRA
(its mask per token: 0 for verify tokens, 1 for MASK tokens). The verify rows are then exactly
the base model's causal computation, so greedy decoding is the base model's greedy decoding
token for token ("lossless"), and the adapter only makes the drafts better.

The adapter is a PEFT LoRA directory (adapter_config.json with `peft_type` "LORA", `r`,
`lora_alpha`, `target_modules`; adapter_model.safetensors with
`base_model.model.model.layers.N.<self_attn|mlp>.<name>.lora_A.weight` (r, in) and `lora_B.weight`
(out, r)); its delta is scale * B(A x) with scale = lora_alpha / r (lora_alpha / sqrt(r) with
`use_rslora`). A row is a mask row where its input token is the mask token.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def is_peft_lora(path: Any) -> bool:
    """Whether `path` is a PEFT LoRA adapter directory (not mlx-lm's adapters.safetensors)."""
    folder = Path(str(path)).expanduser()
    if not (folder / PEFT_WEIGHTS).is_file() or not (folder / PEFT_CONFIG).is_file():
        return False
    try:
        return json.loads((folder / PEFT_CONFIG).read_text()).get("peft_type") == "LORA"
    except (OSError, ValueError, AttributeError):
        return False


class RowGate:
    """The rows a forward's LoRA deltas apply to, set by the model around each forward:
    (B, L, 1) 1.0 on mask rows, 0.0 elsewhere; None outside a forward (no delta)."""

    def __init__(self):
        self.gate: Optional[mx.array] = None


class MaskRowLoRA(nn.Module):
    """A linear layer plus its LoRA delta on the gated rows."""

    def __init__(self, base: nn.Module, lora_a: mx.array, lora_b: mx.array, scale: float, rows: RowGate):
        super().__init__()
        self.base = base
        self.lora_a, self.lora_b, self.scale = lora_a, lora_b, scale
        self._rows = rows  # (not a parameter)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        gate = self._rows.gate
        if gate is None:
            return y
        delta = (x @ self.lora_a.T.astype(x.dtype)) @ self.lora_b.T.astype(x.dtype)
        return y + (self.scale * delta * gate).astype(y.dtype)


def attach(model: nn.Module, path: Any) -> RowGate:
    """Wrap the target linear layers of `model` (a LayerStack Qwen3 under `model.model`) with
    the adapter at `path`; returns the gate the model sets around each forward."""
    folder = Path(str(path)).expanduser()
    config = json.loads((folder / PEFT_CONFIG).read_text())
    if config.get("use_dora"):
        raise ValueError("a DoRA adapter is not I-DLM's LoRA flavour (plain LoRA only)")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = mx.load(str(folder / PEFT_WEIGHTS))
    rows = RowGate()
    pairs: dict = {}
    for key, value in weights.items():
        if not key.startswith(PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(
                f"{folder / PEFT_WEIGHTS}: unexpected weight {key!r} (a PEFT LoRA of a Qwen3 holds "
                f"{PREFIX}model.layers.N.<module>.lora_A/B.weight)"
            )
        module, _, which = key[len(PREFIX) :].rpartition(".lora_")
        pairs.setdefault(module, {})[which.split(".")[0]] = value
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{folder / PEFT_WEIGHTS}: {module} lacks its lora_A or lora_B")
        parent_path, _, name = module.rpartition(".")
        parent = _find(model, parent_path)
        base = getattr(parent, name, None) if parent is not None else None
        if not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
            raise ValueError(f"the adapter targets {module}, which is not a linear layer of this model")
        a, b = pair["A"], pair["B"]
        out_dim, in_dim = _dims(base)
        if a.shape != (rank, in_dim) or b.shape != (out_dim, rank):
            raise ValueError(
                f"the adapter's {module} has shapes {tuple(a.shape)} / {tuple(b.shape)}; the model's "
                f"layer needs ({rank}, {in_dim}) / ({out_dim}, {rank})"
            )
        setattr(parent, name, MaskRowLoRA(base, a, b, scale, rows))
    if not pairs:
        raise ValueError(f"{folder / PEFT_WEIGHTS} holds no LoRA weights")
    return rows


def _find(model: nn.Module, dotted: str) -> Any:
    node: Any = model
    for part in dotted.split("."):
        node = node[int(part)] if isinstance(node, list) and part.isdigit() else getattr(node, part, None)
        if node is None:
            return None
    return node


def _dims(layer: nn.Module) -> tuple:
    if isinstance(layer, nn.QuantizedLinear):
        return layer.weight.shape[0], layer.weight.shape[1] * 32 // layer.bits
    return tuple(layer.weight.shape)
