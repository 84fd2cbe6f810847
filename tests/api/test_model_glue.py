"""The model glue every family shares (model_adapters.base.DiffusionModel) and mlx-lm's
surface: stock `make_prompt_cache` gives diffusion models a TokenCache through
`model.make_cache()`, install() leaves make_prompt_cache alone, register() refuses to
shadow a model module that mlx-lm ships."""

import importlib
import sys

import mlx_lm
import pytest
from mlx.utils import tree_flatten

import mlx_lm_diffusion as mld
import model_adapters
from mlx_lm_diffusion.testing.block_checkpoints import write_llada2, write_sdar
from mlx_lm_diffusion.testing.checkpoints import write_dream, write_llada
from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_diffusion_gemma, write_nemotron
from model_adapters.base import DiffusionLM
from model_adapters.runtime.prompt_cache import TokenCache

cache_module = importlib.import_module("mlx_lm.models.cache")
install_module = importlib.import_module("mlx_lm_diffusion.api.install")

WRITERS = {
    "llada": write_llada,
    "dream": write_dream,
    "sdar": write_sdar,
    "llada2": write_llada2,
    "nemotron": write_nemotron,
    "diffusion_gemma": write_diffusion_gemma,
}
# the modules that look make_prompt_cache up (server, chat, generate) and its home
CALLERS = ("mlx_lm.generate", "mlx_lm.models.cache", "mlx_lm.server", "mlx_lm.chat")


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_stock_make_prompt_cache_gives_a_token_cache(family, tmp_path):
    """Without install(): mlx-lm's own make_prompt_cache, as the server, chat and
    generate call it, defers to the model's make_cache()."""
    assert not install_module.installed()
    model, _ = mlx_lm.load(str(WRITERS[family](tmp_path / family)))
    for name in CALLERS:
        make_prompt_cache = importlib.import_module(name).make_prompt_cache
        assert [type(c) for c in make_prompt_cache(model)] == [TokenCache], name
    assert [type(c) for c in cache_module.make_prompt_cache(model, 64)] == [TokenCache]
    if family != "diffusion_gemma":  # its adapter calls encode/decode, not backbone
        assert isinstance(model, DiffusionLM)
    weights = dict(tree_flatten(model.parameters()))
    assert model.sanitize(weights).keys() == weights.keys()  # converted names pass through


def test_install_leaves_make_prompt_cache_alone():
    assert all(attr != "make_prompt_cache" for _, attr, _ in install_module.TARGETS)
    before = [importlib.import_module(m).make_prompt_cache for m in CALLERS]
    mld.install()
    try:
        during = [importlib.import_module(m).make_prompt_cache for m in CALLERS]
    finally:
        mld.uninstall()
    assert during == before


def test_register_is_idempotent():
    model_adapters.register()
    model_adapters.register()
    for model_type in model_adapters.FAMILIES:
        assert sys.modules[f"mlx_lm.models.{model_type}"] is model_adapters.family_module(model_type)


@pytest.mark.parametrize("imported", [True, False])
def test_register_refuses_to_shadow_a_module_mlx_lm_ships(monkeypatch, imported):
    """A family whose model_type mlx-lm ships as well (simulated: "llama") is refused, whether
    mlx-lm's module was imported already or not, and nothing is registered over it."""
    if not imported:
        monkeypatch.delitem(sys.modules, "mlx_lm.models.llama", raising=False)
    theirs = sys.modules.get("mlx_lm.models.llama")
    monkeypatch.setitem(model_adapters.FAMILIES, "llama", "llada")
    with pytest.raises(ValueError, match=r"ships its own mlx_lm\.models\.llama"):
        model_adapters.register()
    assert sys.modules.get("mlx_lm.models.llama") is theirs


def test_register_twice_keeps_a_family_from_elsewhere(monkeypatch):
    """A family registered under a full module name (register_family) is recognised as
    ours on the next register(), not refused as mlx-lm's."""
    import mlx_lm.models

    monkeypatch.setitem(model_adapters.FAMILIES, "glue_toy", "model_adapters.families.llada")
    monkeypatch.delitem(sys.modules, "mlx_lm.models.glue_toy", raising=False)
    try:
        model_adapters.register()
        model_adapters.register()
        assert sys.modules["mlx_lm.models.glue_toy"] is importlib.import_module("model_adapters.families.llada")
    finally:
        sys.modules.pop("mlx_lm.models.glue_toy", None)
        if hasattr(mlx_lm.models, "glue_toy"):
            delattr(mlx_lm.models, "glue_toy")
