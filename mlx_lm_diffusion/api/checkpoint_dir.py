"""A checkpoint directory written whole, or not at all.

mlx-lm's `save` writes the weights, config.json, the tokenizer's files and a model card
one after the other into the target directory. On a full disk `mlx_lm_diffusion.fuse` left
what it had written (a truncated model.safetensors; or the weights beside an empty
tokenizer.json) and ended with MLX's traceback ("[write] Unable to write 11099 bytes to
file"), the tokenizers library's ("No space left on device (os error 28)"), or one line
with nothing to say what was left. `written_whole(target)` gives a fresh directory beside
the target to write into; its files move into place only once everything is written; on
any failure it is removed, and a failure to write is one OSError naming the target (a
command's one line and exit 2: flags.exit_status).
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

# what a write that failed says where it is not an OSError (MLX's RuntimeError, the
# tokenizers library's plain Exception)
WRITE_FAILURE_WORDS = ("unable to write", "no space left", "os error", "disk quota", "read-only file system")
FULL_BELOW = 64 << 10  # bytes free under which a failed write is put down to a full disk


def is_write_failure(error: BaseException) -> bool:
    return isinstance(error, OSError) or any(w in str(error).lower() for w in WRITE_FAILURE_WORDS)


@contextmanager
def written_whole(target: Path) -> Iterator[Path]:
    """A directory to write a checkpoint into; it becomes `target` (or, where `target` is a
    directory already, its files replace theirs one by one) when the block ends without
    an error. Otherwise it is removed, `target` is left as it was, and a failure to write
    becomes `OSError("cannot write <target>: ...")`."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{target} exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _fresh_directory(target)
    try:
        yield staging
        _move_into_place(staging, target)
    except Exception as e:
        full = _full(staging)  # (before the removal frees what was written)
        shutil.rmtree(staging, ignore_errors=True)
        if not is_write_failure(e):
            raise
        raise _CannotWrite(target, e, full) from e
    except BaseException:  # (Ctrl-C)
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _full(directory: Path) -> bool:
    """Whether the file system holding `directory` has (next to) nothing left: MLX's failed
    write does not say why ("[write] Unable to write 11099 bytes to file")."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < FULL_BELOW


class _CannotWrite(OSError):
    def __init__(self, target: Path, error: Exception, full: bool):
        text = str(error).lower()
        code = (
            error.errno
            if isinstance(error, OSError) and error.errno
            else (errno.ENOSPC if full or "no space left" in text or "os error 28" in text else errno.EIO)
        )
        super().__init__(
            code,
            f"cannot write {target}: {os.strerror(code)} ({type(error).__name__}: "
            f"{' '.join(str(error).split())}); nothing was left there",
        )

    def __str__(self) -> str:  # (the message, without "[Errno 28]")
        return self.strerror


def _fresh_directory(target: Path) -> Path:
    for n in range(1000):
        staging = target.parent / f".{target.name}.partial-{os.getpid()}-{n}"
        try:
            staging.mkdir()  # (the umask's permissions, as mlx-lm's mkdir gives the target)
            return staging
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free name for a directory beside {target}")


def _move_into_place(staging: Path, target: Path) -> None:
    if not target.exists():
        os.rename(staging, target)  # (the same file system: one step)
        return
    for entry in staging.iterdir():
        there = target / entry.name
        if entry.is_dir() and there.is_dir():
            _move_into_place(entry, there)
        else:
            os.replace(entry, there)
    staging.rmdir()


__all__ = ["is_write_failure", "written_whole"]
