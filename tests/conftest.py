import os
import sys
from pathlib import Path

import pytest

# the tests' shared helpers (tests/helpers: oracles, server_runs, cli_run, ...) import by name
# from every folder of tests/, which mirror the package's
sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from mlx_lm_diffusion.testing.checkpoints import write_dream, write_llada


def pytest_configure(config):
    """Under xdist (addopts: -n auto), one BLAS thread per worker process: the workers
    already fill the cores, and OpenBLAS's extra threads spin against each other (on 2
    cores serially its threads cost 70 s of system time in the demo and parity tests, one
    thread 3 s). The workers start after this hook and read the variable at their start;
    an operator's own setting is kept."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def llada_path(tmp_path_factory):
    return write_llada(tmp_path_factory.mktemp("llada"))


@pytest.fixture(scope="session")
def slow_llada_path(tmp_path_factory):
    """A LLaDA wider and deeper than `llada_path`, with room for a 1,600-token answer: a
    decode of one forward per token over its whole canvas takes minutes on a CPU, so the
    shutdown tests' long request outlasts any grace period they set by a wide margin."""
    return write_llada(tmp_path_factory.mktemp("llada-slow"), d_model=256, n_layers=4, max_len=2048)


@pytest.fixture(scope="session")
def dream_path(tmp_path_factory):
    return write_dream(tmp_path_factory.mktemp("dream"))


@pytest.fixture(scope="session")
def llada(llada_path):
    import mlx_lm_diffusion

    return mlx_lm_diffusion.load(str(llada_path))


@pytest.fixture(scope="session")
def dream(dream_path):
    import mlx_lm_diffusion

    return mlx_lm_diffusion.load(str(dream_path))


# One module-scoped load per test module that asks for the family (a test module with its
# own checkpoint of the family defines its own fixture of the same name).
def _load(tmp_path_factory, name, write):
    import mlx_lm_diffusion

    return mlx_lm_diffusion.load(str(write(tmp_path_factory.mktemp(name))))


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    from mlx_lm_diffusion.testing.block_checkpoints import write_sdar

    return _load(tmp_path_factory, "sdar", write_sdar)


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    from mlx_lm_diffusion.testing.block_checkpoints import write_llada2

    return _load(tmp_path_factory, "llada2", write_llada2)


@pytest.fixture(scope="module")
def llada2_2(tmp_path_factory):
    from mlx_lm_diffusion.testing.block_checkpoints import write_llada2_2

    return _load(tmp_path_factory, "llada2_2", write_llada2_2)


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_nemotron

    return _load(tmp_path_factory, "nemotron", write_nemotron)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from mlx_lm_diffusion.testing.nemotron_gemma_checkpoints import write_diffusion_gemma

    return _load(tmp_path_factory, "gemma", write_diffusion_gemma)


@pytest.fixture
def installed():
    """install() for one test, then uninstall()."""
    import mlx_lm_diffusion

    mlx_lm_diffusion.install()
    try:
        yield
    finally:
        mlx_lm_diffusion.uninstall()
