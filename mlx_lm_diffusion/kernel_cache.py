"""Where MLX compiles its CPU kernels: a per-user directory that only the user can write.

MLX's CPU backend compiles kernels into $TMPDIR/mlx/<version>/ and loads any library it
finds there: under a shared /tmp, one another user planted. The doors (the server, the
generate and chat CLIs, lora, evaluate) point TMPDIR at a cache of the user's own before
anything compiles: `$XDG_CACHE_HOME/mlx_lm_diffusion/kernels` (~/.cache/...), created 0700,
used only while it is a directory owned by the user that no one else can write, and kept
across starts, so a later start finds its kernels compiled (a fresh server's first request
compiled them all again: 9-28 s on a 2-core machine). Where the per-user directory is not
safe, a new private directory is used instead and removed at the end.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Optional


def user_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx_lm_diffusion" / "kernels"


def unsafe_reason(path: Path) -> Optional[str]:
    """Why `path` may not hold kernels MLX will load (None: it may): it must be a real
    directory (no link), owned by this user, writable by no one else."""
    try:
        info = os.lstat(path)
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return "it is not a directory (or is a link)"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return "another user owns it"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "others can write to it"
    return None


def prepare(named: Optional[str] = None) -> tuple[str, bool, Optional[str]]:
    """(the directory, whether it is a private one to remove at the end, why the per-user
    cache was not used or None). `named`: the operator's directory (--kernel-cache-dir),
    created 0700 if missing; ValueError where it is not safe."""
    if named is not None:
        path = Path(named).expanduser()
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--kernel-cache-dir {named}: {e.strerror or e}") from None
        problem = unsafe_reason(path)
        if problem:
            raise ValueError(f"--kernel-cache-dir {named}: {problem} (MLX loads the kernels it finds there)")
        return str(path), False, None
    path = user_cache_dir()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = unsafe_reason(path)
    except OSError as e:
        problem = e.strerror or str(e)
    if problem is None:
        return str(path), False, None
    return tempfile.mkdtemp(prefix="mlx_lm_diffusion-"), True, f"{path}: {problem}"


def use(directory: str) -> None:
    """TMPDIR (MLX's kernel directory, and Python's temporary files) points at `directory`."""
    os.environ["TMPDIR"] = directory
    tempfile.tempdir = None  # (read TMPDIR again)


def use_for_cli() -> None:
    """A CLI's start: the per-user cache (or a private directory, left to the system's
    cleaning of temporary files) before MLX compiles anything."""
    directory, _, _ = prepare()
    use(directory)
