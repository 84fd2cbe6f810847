"""A family is chosen by more than model_type (model_adapters.evidence, issue 53.1).

I-DLM's checkpoints say `model_type "sdar"`; loaded as SDAR they decoded garbage with no
error. Its `use_regular_causal` switch (in config.json, or declared by the checkpoint's own
configuration_sdar.py) tells them apart: such a checkpoint loads as I-DLM (model_adapters.families.idlm,
tests/model_adapters/test_idlm.py) through every load. SDAR's own checkpoints load as before, and install() leaves mlx-lm's
own model types (Qwen3, Qwen3.5, LFM2) to mlx-lm. LFM2.5-Diffusion saved as LFM2 is told by its noise
conditioning; evidence of two families is refused and `family=` decides.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from cli_run import run_main
from mlx.utils import tree_flatten

import mlx_lm_diffusion as mld
from mlx_lm_diffusion.testing.block_checkpoints import write_sdar
from model_adapters import evidence

# I-DLM's SDARConfig declares the switch (thuEcstasy/I-DLM configuration_sdar.py); SDAR's does not
IDLM_CONFIGURATION = "class SDARConfig(PretrainedConfig):\n    def __init__(self, use_regular_causal=True, **kw): ...\n"
SDAR_CONFIGURATION = "class SDARConfig(PretrainedConfig):\n    def __init__(self, block_size=4, **kw): ...\n"


def _edit_config(path: Path, **fields) -> Path:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **fields}))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("evidence")
    sdar = write_sdar(root / "sdar")
    (sdar / "configuration_sdar.py").write_text(SDAR_CONFIGURATION)
    in_config = _edit_config(write_sdar(root / "idlm-config", block_size=3), use_regular_causal=True)
    in_code = write_sdar(root / "idlm-code", block_size=3)
    (in_code / "configuration_sdar.py").write_text(IDLM_CONFIGURATION)
    return {"sdar": sdar, "idlm-config": in_config, "idlm-code": in_code}


@pytest.mark.parametrize("which", ["idlm-config", "idlm-code"])
def test_an_idlm_checkpoint_loads_as_idlm_not_as_sdar(checkpoints, which):
    model, _ = mld.load(str(checkpoints[which]))
    assert type(model).__module__ == "model_adapters.families.idlm" and model.args.use_regular_causal


def test_mlx_lms_own_loader_tells_them_apart_after_install(checkpoints):
    import mlx_lm

    mld.install()
    try:
        model, _ = mlx_lm.load(str(checkpoints["idlm-code"]))
        assert type(model).__module__ == "model_adapters.families.idlm"
        model, _ = mlx_lm.load(str(checkpoints["sdar"]))  # (SDAR's own: as before)
        assert type(model).__module__ == "model_adapters.families.sdar"
    finally:
        mld.uninstall()


def test_a_block_causal_idlm_is_refused_in_one_line(checkpoints, tmp_path):
    path = _edit_config(write_sdar(tmp_path / "idlm-block-causal", block_size=3), use_regular_causal=False)
    r = run_main("mlx_lm_diffusion.generate", "--model", str(path), "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "use_regular_causal false" in r.stderr.strip().splitlines()[-1]


def test_sdar_still_loads_as_sdar(checkpoints):
    model, _ = mld.load(str(checkpoints["sdar"]))
    assert type(model).__module__ == "model_adapters.families.sdar"


def _stock(path: Path, module, config: dict) -> Path:
    """A tiny checkpoint of one of mlx-lm's own model types, written with mlx-lm's own class."""
    path.mkdir(parents=True)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_install_leaves_mlx_lms_own_model_types_to_mlx_lm(tmp_path):
    from mlx_lm.models import lfm2, qwen3, qwen3_5
    from mlx_lm.utils import load_model

    small = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 128,
    }
    stock = {
        qwen3: {
            "model_type": "qwen3",
            **small,
            "intermediate_size": 64,
            "rms_norm_eps": 1e-6,
            "head_dim": 8,
            "tie_word_embeddings": True,
            "rope_theta": 10000.0,
            "mask_token_id": 63,
            "block_size": 4,
        },
        qwen3_5: {
            "model_type": "qwen3_5",
            "text_config": {
                "model_type": "qwen3_5_text",
                **small,
                "intermediate_size": 64,
                "linear_num_value_heads": 2,
                "linear_num_key_heads": 2,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
                "full_attention_interval": 2,
                "tie_word_embeddings": True,
            },
        },
        lfm2: {
            "model_type": "lfm2",
            **small,
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "block_dim": 32,
            "block_ff_dim": 64,
            "block_multiple_of": 8,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": False,
            "layer_types": ["conv", "full_attention"],
        },
    }
    mld.install()
    try:
        for module, config in stock.items():
            path = _stock(tmp_path / config["model_type"], module, config)
            model, _ = load_model(path)
            assert type(model) is module.Model  # (mlx-lm's own class, not a diffusion family's)
            assert not hasattr(model, "generation_defaults")
    finally:
        mld.uninstall()


def test_lfm2_diffusion_saved_as_lfm2_loads_by_its_noise_conditioning(tmp_path):
    """LFM2.5-Diffusion under LFM2's model type: its architecture or its noise-conditioning fields
    make it the diffusion family; mlx-lm's own LFM2 without them stays mlx-lm's."""
    from mlx_lm_diffusion.testing.hybrid_checkpoints import write_lfm2_diffusion

    path = _edit_config(
        write_lfm2_diffusion(tmp_path / "as-lfm2"), model_type="lfm2", architectures=["Lfm2ForCausalLM"]
    )
    assert type(mld.load(str(path))[0]).__module__ == "model_adapters.families.lfm2_diffusion"
    assert evidence.family_overrides(path, {"model_type": "lfm2", "architectures": ["Lfm2ForCausalLM"]}) == {}


def test_evidence_of_two_families_is_refused_and_family_decides(tmp_path):
    """A Qwen3.5 checkpoint with Trida's sidecar whose config also names LFM2.5-Diffusion's
    architecture: refused, naming family=; family= loads it as the family named."""
    from mlx_lm_diffusion.testing.hybrid_checkpoints import write_trida

    path = write_trida(tmp_path / "both")
    _edit_config(path, architectures=["Qwen3_5ForCausalLM", "Lfm2ForBlockDiffusion"])
    with pytest.raises(ValueError, match=r"evidence of lfm2_diffusion and qwen3_5_diffusion; load it with family="):
        mld.load(str(path))
    model, _ = mld.load(str(path), family="qwen3_5_diffusion")
    assert type(model).__module__ == "model_adapters.families.qwen3_5_diffusion"
    with pytest.raises(ValueError, match="family must be one of"):
        mld.load(str(path), family="qwen3_5")


def test_family_loads_a_checkpoint_as_the_family_named(checkpoints):
    """An SDAR checkpoint read as I-DLM (the same Qwen3 weights) when the caller says so."""
    model, _ = mld.load(str(checkpoints["sdar"]), family="idlm")
    assert type(model).__module__ == "model_adapters.families.idlm"
