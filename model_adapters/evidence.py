"""Which family a checkpoint is, by more than its config.json's model_type.

Checkpoints of another model reuse a family's model_type: I-DLM (Introspective-Diffusion,
thuEcstasy/I-DLM) ships its Qwen3 checkpoints as `model_type "sdar"`, architectures
["SDARForCausalLM"], mask 151669, `block_size` 1-3 (thuEcstasy/I-DLM
training/model/Qwen3-8B-b3-allmasked/config.json). It is not SDAR: its attention is strictly
causal and its logits are shifted (position i predicts i + 1), where SDAR's are block-causal and
unshifted, so loaded as SDAR it decoded garbage without an error. What tells them apart is
I-DLM's `use_regular_causal` switch, which SDAR's configuration does not have: in config.json
(a config saved by transformers writes every field of the class) or in the checkpoint's own
configuration_sdar.py (I-DLM's SDARConfig declares it, default True: thuEcstasy/I-DLM
training/model/Qwen3-8B-b1-allmasked/configuration_sdar.py).

LFM2.5-Diffusion saved under LFM2's model type (its own says "lfm2_diffusion") is told by its
architecture (Lfm2ForBlockDiffusion) or its noise-conditioning fields.

A checkpoint that carries the evidence of two families is refused with a message naming
`family=` (mlx_lm_diffusion.load's keyword), which decides; `family=` also loads any checkpoint as
the family named, whatever its evidence.

Trida2.0 and FLARE (model_adapters.families.qwen3_5_diffusion) are mlx-lm's own Qwen3.5 (`model_type
"qwen3_5_text"` in Trida2.0-4B's raw layout, "qwen3_5" in FLARE's) with a mask token and a
self-speculative decoder: what tells them from an ordinary Qwen3.5 is the `block_diffusion.json`
sidecar {bd_size, mask_id} (trillion-labs/trida-stack inference/mlx/trida_mlx/model.py
`mask_id_of`) or FLARE's architecture name. Without either a Qwen3.5 checkpoint stays mlx-lm's.

`family_overrides(model_path, config)` gives the config fields that load such a checkpoint as
what it is (`{"model_type": "idlm"}`: model_adapters.families.idlm); every load (mlx_lm_diffusion.load, and
mlx-lm's loader after install()) passes them as mlx-lm's `model_config`, before any weight is
read. A checkpoint of another of mlx-lm's own model types is never looked at here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

IDLM_SWITCH = "use_regular_causal"
CODE_READ_LIMIT = 1 << 20  # (a configuration file is a few KB; nothing larger is read)
QWEN3_5_TYPES = ("qwen3_5", "qwen3_5_text")
BLOCK_DIFFUSION_SIDECAR = "block_diffusion.json"
FLARE_ARCHITECTURE = "Qwen3_5DLLMForConditionalGeneration"
QWEN3_5_MASK = 248077  # Trida's and FLARE's mask id where a checkpoint names none (../shared/DESIGN.md)


LFM2_DIFFUSION_ARCHITECTURE = "Lfm2ForBlockDiffusion"
SIGMA_FIELDS = ("sigma_cond_dim", "adaln_conditioning")  # (LFM2.5-Diffusion's config: the noise conditioning)


def family_overrides(model_path: Any, config: dict, family: Any = None) -> dict:
    """The config.json fields that make the checkpoint at `model_path` load as the family it
    is, when its model_type names another ({} otherwise). Evidence of two families at once is
    refused (ValueError) unless `family` (a model type of model_adapters.FAMILIES) decides."""
    path = Path(str(model_path))
    claims = {
        name: overrides
        for name, overrides in (
            ("idlm", _idlm(path, config)),
            ("qwen3_5_diffusion", _block_diffusion(path, config)),
            ("lfm2_diffusion", _lfm2_diffusion(config)),
        )
        if overrides
    }
    if family is not None:
        return claims.get(family, {"model_type": family} if family != config.get("model_type") else {})
    if len(claims) > 1:
        raise ValueError(
            f"the checkpoint at {model_path} carries the evidence of {' and '.join(sorted(claims))}; "
            f"load it with family= one of them (mlx_lm_diffusion.load(path, family=...))"
        )
    return next(iter(claims.values()), {})


def _idlm(path: Path, config: dict) -> dict:
    """I-DLM: model_type "sdar" with I-DLM's switch (config.json, or its configuration_sdar.py)."""
    if config.get("model_type") != "sdar":
        return {}
    if IDLM_SWITCH in config or _declares(path / "configuration_sdar.py", IDLM_SWITCH):
        return {"model_type": "idlm", IDLM_SWITCH: bool(config.get(IDLM_SWITCH, True))}
    return {}


def _lfm2_diffusion(config: dict) -> dict:
    """LFM2.5-Diffusion saved under LFM2's model type: its architecture or its noise conditioning."""
    if config.get("model_type") == "lfm2_diffusion":
        return {}
    architecture = LFM2_DIFFUSION_ARCHITECTURE in (config.get("architectures") or ())
    if architecture or (config.get("model_type") == "lfm2" and all(k in config for k in SIGMA_FIELDS)):
        return {"model_type": "lfm2_diffusion"}
    return {}


def _block_diffusion(path: Path, config: dict) -> dict:
    """A Qwen3.5 checkpoint with the block-diffusion sidecar (or FLARE's architecture): its
    mask id and block size from the sidecar (a FLARE config without one: its text config's)."""
    sidecar = path / BLOCK_DIFFUSION_SIDECAR
    flare = FLARE_ARCHITECTURE in (config.get("architectures") or ())
    if not (flare or config.get("model_type") in QWEN3_5_TYPES and sidecar.is_file()):
        return {}
    facts: dict = {}
    if sidecar.is_file():
        try:
            if sidecar.stat().st_size > CODE_READ_LIMIT:
                raise ValueError("it is larger than 1 MB")
            facts = json.loads(sidecar.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"the checkpoint's {BLOCK_DIFFUSION_SIDECAR} cannot be read: {e}") from None
        if not isinstance(facts, dict):
            raise ValueError(f"the checkpoint's {BLOCK_DIFFUSION_SIDECAR} must hold a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    mask_id = facts.get("mask_id", text.get("mask_token_id", config.get("mask_token_id", QWEN3_5_MASK)))
    if not isinstance(mask_id, int) or isinstance(mask_id, bool):
        raise ValueError(
            f"a Qwen3.5 block-diffusion checkpoint needs an integer mask_id in its "
            f"{BLOCK_DIFFUSION_SIDECAR}, got {mask_id!r}"
        )
    overrides = {"model_type": "qwen3_5_diffusion", "mask_token_id": mask_id}
    if "bd_size" in facts:
        overrides["bd_size"] = facts["bd_size"]
    return overrides


def _declares(file: Path, name: str) -> bool:
    """Whether the checkpoint's own code file mentions `name` (read as text, never run)."""
    try:
        if not file.is_file() or file.stat().st_size > CODE_READ_LIMIT:
            return False
        return name in file.read_text(errors="replace")
    except OSError:
        return False


__all__ = ["family_overrides", "IDLM_SWITCH", "BLOCK_DIFFUSION_SIDECAR"]
