import pytest

from checkpoints import write_dream, write_llada


@pytest.fixture(scope="session")
def llada_path(tmp_path_factory):
    return write_llada(tmp_path_factory.mktemp("llada"))


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


@pytest.fixture
def installed():
    """install() for one test, then uninstall()."""
    import mlx_lm_diffusion

    mlx_lm_diffusion.install()
    try:
        yield
    finally:
        mlx_lm_diffusion.uninstall()
