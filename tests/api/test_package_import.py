"""`import mlx_lm_diffusion` is light (PEP 562), so that `python -m mlx_lm_diffusion.server` runs
its own first lines (its start-up's signal handling) before mlx-lm, transformers and torch are
imported (issue 55.8); the package's names resolve on first use, and the families register
with mlx-lm once mlx_lm is imported, however it comes in.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_lm_diffusion.demo import DEMO_MODEL_PATH

ROOT = Path(__file__).parents[2]


def test_importing_the_package_is_light_and_keeps_its_names():
    """`import mlx_lm_diffusion` imports neither mlx_lm nor torch; its names resolve on first
    use; `generate` stays the function; mlx_lm, imported afterwards, finds the families."""
    script = (
        "import sys, mlx_lm_diffusion as m\n"
        "assert not {'mlx_lm', 'transformers', 'torch', 'mlx_lm_diffusion.api'} & set(sys.modules), sorted(sys.modules)\n"
        "import mlx_lm\n"
        "assert sys.modules['mlx_lm.models.llada'].__name__ == 'model_adapters.families.llada'\n"
        "assert sys.modules['mlx_lm.models.Dream'].__name__ == 'model_adapters.families.dream'\n"
        "import mlx_lm_diffusion.generate\n"
        "assert callable(m.generate) and m.generate is m.api.generation.generate\n"
        "assert m.load is m.api.loading.load and m.FAMILIES is sys.modules['model_adapters'].FAMILIES\n"
        "from mlx_lm_diffusion import DecodeOptions, Engine, install, stream_generate  # noqa\n"
        "model, tokenizer = mlx_lm.load(sys.argv[1])\n"
        "assert type(model).__module__ == 'model_adapters.families.llada', type(model)\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(DEMO_MODEL_PATH)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("first", ["model_adapters", "mlx_lm_diffusion.api.loading", "mlx_lm.models.cache"])
def test_the_families_register_whichever_import_brings_mlx_lm_in(first):
    """model_adapters imports mlx_lm itself (half-run when mlx_lm's import ends): the
    families register at the end of its import instead."""
    script = (
        f"import sys, mlx_lm_diffusion, {first}\n"
        "assert sys.modules['mlx_lm.models.sdar'].__name__ == 'model_adapters.families.sdar'\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
