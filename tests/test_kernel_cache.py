"""MLX's kernel directory (issue 55.6a/b): the user's own cache, 0700, kept across starts;
one that others could write is refused (named) or replaced by a private one (default)."""

from __future__ import annotations

import os
import stat

import pytest
from cli_run import run

from mlx_lm_diffusion import kernel_cache


def test_the_per_user_cache_is_made_0700_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path, private, why = kernel_cache.prepare()
    assert (path, private, why) == (str(tmp_path / "cache" / "mlx_lm_diffusion" / "kernels"), False, None)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert kernel_cache.prepare() == (path, False, None)  # (the same one, at the next start)


def test_a_cache_others_can_write_is_not_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    shared = tmp_path / "cache" / "mlx_lm_diffusion" / "kernels"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    path, private, why = kernel_cache.prepare()
    assert private and path != str(shared) and "others can write" in why
    os.rmdir(path)
    with pytest.raises(ValueError, match="others can write"):
        kernel_cache.prepare(str(shared))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "cache")
    with pytest.raises(ValueError, match="link"):
        kernel_cache.prepare(str(link))


def test_the_doors_use_it(tmp_path, monkeypatch):
    """The server refuses a --kernel-cache-dir others can write (one line, exit 2); the
    generate CLI, as a program, makes and uses the user's cache."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    done = run("mlx_lm_diffusion.server", "--kernel-cache-dir", str(shared), "--port", "0")
    assert done.returncode == 2 and "others can write" in done.stderr.strip().splitlines()[-1]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    done = run("mlx_lm_diffusion.generate", "--prompt", "357+468=", "--verbose", "False")
    assert done.returncode == 0 and done.stdout.strip() == "825", done.stderr
    made = tmp_path / "home-cache" / "mlx_lm_diffusion" / "kernels"
    assert made.is_dir() and stat.S_IMODE(os.stat(made).st_mode) == 0o700
