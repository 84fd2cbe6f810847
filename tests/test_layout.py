"""The shape the design promises: the driver, the shared decoder parts and the options
name no family and no family's own option; each family declares those itself."""

import re
from pathlib import Path

import pytest

from model_adapters import FAMILIES, family_module

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_lm_diffusion" / "decoding"
GENERIC = ["engine.py", "options.py", "option_schema.py", "decoders/__init__.py", "decoders/base.py"]
FAMILY_WORDS = ["llada", "dream", "sdar", "trado", "nemotron", "gemma", "ministral", "qwen", "bailing"]


def _family_option_names() -> list:
    return sorted({o.name for t in FAMILIES for o in family_module(t).Adapter.options})


def test_family_options_are_declared_by_their_adapters():
    assert {"causal_context", "edit_ops", "t_min", "t_max"} <= set(_family_option_names())


@pytest.mark.parametrize("path", GENERIC)
def test_generic_modules_name_no_family(path):
    text = (PACKAGE / path).read_text().lower()
    words = FAMILY_WORDS + _family_option_names()
    found = [w for w in words if re.search(rf"\b{re.escape(w)}", text)]
    assert not found, f"{path} names {found}"
