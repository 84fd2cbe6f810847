"""Running short of memory: what the server can tell before a decode fails, and what a
failure says.

Under an address-space limit (RLIMIT_AS: `prlimit --as`, `ulimit -v`) most allocations that
fail cannot be answered where they fail. Measured with the demo model (mlx 0.32.4, OpenBLAS
preloaded, torch installed, Linux): MLX's CPU backend writes through the null pointer its
allocator got (a segfault); OpenBLAS retries the 128 MiB buffer that each new decoding
thread needs, forever (at 1.6 GB the server hung on its first completion and no SIGTERM
could end it); a connection whose thread could not start was dropped unanswered. So:

* `cap_malloc_arenas`: under such a limit glibc's per-thread malloc arenas (64 MiB of
  address space each, up to 8 per core) are capped at 2. The server at 1.6 GB had ~800 MiB
  of its address space in them; capped, it serves there.
* `shortage`: the address space left under the limit (/proc/self/statm) is read before each
  generation request and by /health: under RESERVE_BYTES the request gets a 503 and /health
  a 503 saying why, instead of a decode that would crash or hang, until it is back (the
  limit raised, memory given back). The start-up needs START_RESERVE_BYTES besides the
  weights before it loads them (MLX's loader hung at 1.0 GB: its reading threads could not
  start), and again before `first_matmul` pays OpenBLAS's one-time buffer (~136 MiB), so that
  no request pays it; short of either it fails with one line.
* `is_out_of_memory`: the failures Python does see (MemoryError, a thread that cannot
  start, a library that cannot be mapped, MLX's and the system's allocation messages).

Nothing heavy is imported here: `python -m mlx_lm_diffusion.server` uses it before mlx-lm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from pathlib import Path
from typing import Optional

# a decode's threads (8 MiB of stack each) and a small request's arrays
RESERVE_BYTES = 64 << 20
# the load's threads, and OpenBLAS's first call (its buffer: 128 MiB, and its threads)
START_RESERVE_BYTES = 256 << 20
ARENAS_UNDER_LIMIT = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter

# what MLX's, Python's and the system's allocation failures say (besides MemoryError)
OUT_OF_MEMORY_WORDS = (
    "out of memory",
    "unable to allocate",
    "failed to allocate",
    "[malloc]",
    "can't start new thread",
    "cannot allocate memory",
    "failed to map segment",
)


def address_space_limit() -> Optional[int]:
    """The soft RLIMIT_AS in bytes, None when there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def address_space_left() -> Optional[int]:
    """Bytes of address space this process may still map under its RLIMIT_AS; None without
    a limit, or where /proc cannot say (not Linux)."""
    limit = address_space_limit()
    if limit is None:
        return None
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return limit - pages * os.sysconf("SC_PAGE_SIZE")


def shortage(reserve: int = RESERVE_BYTES, to: str = "decode") -> Optional[str]:
    """Why the server must not go on `to` ... now (less than `reserve` bytes of address space
    left under the limit), or None."""
    left = address_space_left()
    if left is None or left >= reserve:
        return None
    return (
        f"out of memory: {max(left, 0) >> 20} MiB of address space left under this server's limit "
        f"(RLIMIT_AS {address_space_limit() >> 20} MiB), {reserve >> 20} MiB needed to {to}"
    )


def weights_bytes(model: object) -> int:
    """The bytes of a local checkpoint's weight files (0 for anything else)."""
    try:
        return sum(f.stat().st_size for f in Path(str(model)).expanduser().glob("*.safetensors") if f.is_file())
    except OSError:
        return 0


def first_matmul() -> None:
    """One small float32 matmul on this thread: OpenBLAS (where it is MLX's BLAS) sets up its
    buffer and threads at its first call, once per process, which no request should pay."""
    import mlx.core as mx

    a = mx.ones((64, 64), dtype=mx.float32)
    mx.eval(a @ a)


def cap_malloc_arenas() -> bool:
    """Under an address-space limit, cap glibc's malloc arenas at ARENAS_UNDER_LIMIT (call
    before threads start). Returns whether it did; without a limit, or without glibc,
    nothing changes."""
    if address_space_limit() is None:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_ARENA_MAX, ARENAS_UNDER_LIMIT))
    except (OSError, AttributeError):
        return False


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation that failed (memory, a thread, a mapping)."""
    if isinstance(error, MemoryError):
        return True
    text = str(error).lower()
    return any(words in text for words in OUT_OF_MEMORY_WORDS)


__all__ = [
    "RESERVE_BYTES",
    "START_RESERVE_BYTES",
    "address_space_left",
    "address_space_limit",
    "cap_malloc_arenas",
    "first_matmul",
    "is_out_of_memory",
    "shortage",
    "weights_bytes",
]
