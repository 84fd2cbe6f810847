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

`family_overrides(model_path, config)` gives the config fields that load such a checkpoint as
what it is (`{"model_type": "idlm"}`: model_adapters.idlm); every load (mlx_lm_diffusion.load, and
mlx-lm's loader after install()) passes them as mlx-lm's `model_config`, before any weight is
read. A checkpoint of one of mlx-lm's own model types is never looked at here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

IDLM_SWITCH = "use_regular_causal"
CODE_READ_LIMIT = 1 << 20  # (a configuration file is a few KB; nothing larger is read)


def family_overrides(model_path: Any, config: dict) -> dict:
    """The config.json fields that make the checkpoint at `model_path` load as the family it
    is, when its model_type names another ({} otherwise)."""
    if config.get("model_type") != "sdar":
        return {}
    if IDLM_SWITCH in config or _declares(Path(str(model_path)) / "configuration_sdar.py", IDLM_SWITCH):
        return {"model_type": "idlm", IDLM_SWITCH: bool(config.get(IDLM_SWITCH, True))}
    return {}


def _declares(file: Path, name: str) -> bool:
    """Whether the checkpoint's own code file mentions `name` (read as text, never run)."""
    try:
        if not file.is_file() or file.stat().st_size > CODE_READ_LIMIT:
            return False
        return name in file.read_text(errors="replace")
    except OSError:
        return False


__all__ = ["family_overrides", "IDLM_SWITCH"]
