"""The architecture as a contract: import-linter's layers, independence, forbidden and
acyclic contracts (.importlinter) hold, and fail on an upward import or a circle; ruff is
clean; no module is past ~600 lines; each package says in one line what it holds."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mlx_lm_diffusion", "model_adapters")
BIN = Path(sys.executable).parent
MAX_MODULE_LINES = 650  # "~600": the largest, DiffusionGemma's family module, is 623


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(BIN / "lint-imports"), "--config", str(root / ".importlinter"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_import_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "BROKEN" not in r.stdout and r.stdout.count("KEPT") == 8, r.stdout


@pytest.fixture
def tree_copy(tmp_path):
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__", "model"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    return tmp_path


def _add_import(path: Path, line: str) -> None:
    text = path.read_text()
    head, sep, rest = text.partition("from __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest)


def test_an_upward_import_breaks_the_house(tree_copy):
    _add_import(tree_copy / "mlx_lm_diffusion/decoding/engine.py", "from mlx_lm_diffusion.serving import errors")
    r = lint_imports(tree_copy)
    assert r.returncode == 1, r.stdout
    assert "mlx_lm_diffusion.decoding.engine -> mlx_lm_diffusion.serving.errors" in r.stdout, r.stdout
    assert "Decoding never imports serving, the CLIs, the API or the demo BROKEN" in " ".join(r.stdout.split())


def test_a_circle_breaks_the_contracts(tree_copy):
    """commit_rules <- options: an import back from commit_rules closes a circle."""
    _add_import(
        tree_copy / "mlx_lm_diffusion/decoding/commit_rules.py", "from mlx_lm_diffusion.decoding import options"
    )
    r = lint_imports(tree_copy)
    assert r.returncode == 1, r.stdout
    assert "No import circles between sibling modules or packages, at any depth BROKEN" in " ".join(r.stdout.split())


def test_a_door_reaching_past_the_faces_breaks_them(tree_copy):
    """Issue 52.5: the packages above decoding use its public face (decoding/__init__.py),
    mlx_lm_diffusion uses model_adapters' face, never the runtime's modules."""
    _add_import(tree_copy / "mlx_lm_diffusion/api/prompts.py", "from mlx_lm_diffusion.decoding.engine import Engine")
    _add_import(tree_copy / "mlx_lm_diffusion/output/infill.py", "from model_adapters.runtime.prefix_kv import usable")
    r = lint_imports(tree_copy)
    out = " ".join(r.stdout.split())
    assert r.returncode == 1, r.stdout
    assert "The packages above decoding import its public face, never its modules BROKEN" in out, r.stdout
    assert "The adapters' runtime is private to them (mlx_lm_diffusion uses model_adapters' face) BROKEN" in out


def test_the_decoding_face_names_what_it_imports():
    """Every name of the face resolves (a typo in its table fails here, not at a door)."""
    import mlx_lm_diffusion.decoding as decoding

    assert all(getattr(decoding, name) is not None for name in decoding.__all__)


def test_a_family_importing_another_breaks_independence(tree_copy):
    _add_import(tree_copy / "model_adapters/families/dream.py", "from model_adapters.families import llada")
    r = lint_imports(tree_copy)
    assert r.returncode == 1 and "The families never import each other BROKEN" in " ".join(r.stdout.split()), r.stdout


def test_a_new_family_is_one_module_and_one_line(tree_copy):
    """docs/architecture.md's recipe, followed literally: the toy family's module in
    model_adapters/families/ (tests/helpers/toy_family.py, without its run-time registration) and one
    line in FAMILIES. The contracts hold with no edit of .importlinter, and the family loads."""
    module = (ROOT / "tests/helpers/toy_family.py").read_text()
    module = module.replace("from model_adapters import register_family\n", "")
    module = module.replace("register_family(MODEL_TYPE, __name__)\n", "")
    (tree_copy / "model_adapters/families/toy.py").write_text(module)
    registry = tree_copy / "model_adapters/__init__.py"
    text = registry.read_text()
    line = '    "lfm2_diffusion": f"{__name__}.families.lfm2_diffusion",\n'
    assert line in text
    registry.write_text(text.replace(line, line + '    "toy_diffusion": f"{__name__}.families.toy",\n'))
    r = lint_imports(tree_copy)
    assert r.returncode == 0 and r.stdout.count("KEPT") == 8, r.stdout + r.stderr
    probe = (
        "import model_adapters; m = model_adapters.family_module('toy_diffusion'); "
        "print(m.__name__, m.Adapter.__name__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tree_copy,
        env={**os.environ, "PYTHONPATH": str(tree_copy)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.stdout.split() == ["model_adapters.families.toy", "Adapter"], out.stdout + out.stderr
    _add_import(tree_copy / "model_adapters/families/toy.py", "from model_adapters.families import sdar")
    r = lint_imports(tree_copy)  # (and the wildcard contract covers it: it may not import another family)
    assert r.returncode == 1 and "The families never import each other BROKEN" in " ".join(r.stdout.split()), r.stdout


def test_ruff_is_clean():
    r = subprocess.run(
        [str(BIN / "ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_applied():
    """The code is in ruff's format (applied once, kept by CI: .ci/run checks it too)."""
    r = subprocess.run(
        [str(BIN / "ruff"), "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path


def test_no_module_is_past_about_600_lines():
    long = {
        str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


def test_each_package_opens_with_what_it_holds():
    for init in (p for p in _modules() if p.name == "__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and doc.strip(), f"{init.relative_to(ROOT)} has no docstring"
