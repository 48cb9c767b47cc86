"""glibc's malloc thresholds for a process that runs CPU executables.

XLA:CPU allocates every execution's results and its temporary buffer afresh with
`posix_memalign`, and frees them when the results die: megabytes per call. glibc's malloc
returns the free memory at the top of its heap to the system once it exceeds the trim
threshold, which it sets to twice the largest chunk it has seen freed from an mmap (starting
at 128 KiB), and serves requests from the mmap threshold up with a fresh mmap. Both send the
next call's buffers to fresh pages, which fault on first touch: a Linear with a 4 MiB result
took 26-380 minor faults per call, LLaMA 4L inference at 4 x 128 up to 290 where Inductor's
took 0-64 (docs/benchmarks.md, "Page faults of XLA's buffers").

So, the first time a CPU executable is loaded (`tune`), fx2xla sets the mmap threshold to
32 MiB (the highest glibc's own adjustment reaches on a 64-bit system) and the trim threshold to
1 GiB. A process then keeps up to 1 GiB of freed memory at the top of a heap for its next
allocations instead of returning it; `release()` returns it on demand (`malloc_trim`).

Buffers allocated on XLA's own threads come from glibc's per-thread arenas, whose heaps are
unmapped once wholly free whatever the thresholds; `MALLOC_ARENA_MAX=1` (the user's choice: one
arena serializes every thread's allocations) removes those faults too (docs/usage.md).

Left alone where the user chose: `FX2XLA_MALLOC_TUNING=0`, any `MALLOC_*_` threshold variable
or `glibc.malloc.*` tunable in the environment, a malloc other than glibc's interposed
(jemalloc, tcmalloc), or no glibc at all.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading

MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# The environment variables through which glibc takes malloc settings at start-up.
USER_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")

_lock = threading.Lock()
_status: str | None = None  # decided once per process by tune()


def tuning_off() -> bool:
    """FX2XLA_MALLOC_TUNING=0 (or off/false/no): glibc's thresholds are never changed."""
    return os.environ.get("FX2XLA_MALLOC_TUNING", "").strip().lower() in ("0", "off", "false", "no")


def user_settings() -> str | None:
    """The malloc setting the user gave the process at start-up, if any."""
    for name in USER_VARIABLES:
        if name in os.environ:
            return name
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


@functools.lru_cache(maxsize=None)
def glibc():
    """glibc's C library, or None (musl, macOS, no libc.so.6)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
        return libc
    except (OSError, AttributeError):
        return None


def _interposed(libc) -> bool:
    """Whether the process's malloc is not glibc's (a preloaded jemalloc or tcmalloc)."""
    used = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    return used != ctypes.cast(libc.malloc, ctypes.c_void_p).value


def tune() -> str:
    """Sets glibc's thresholds once per process, unless left to the user (module docstring).
    Returns what was decided (`status()`)."""
    global _status
    if _status is not None:
        return _status
    with _lock:
        if _status is None:
            _status = _decide()
    return _status


def _decide() -> str:
    if tuning_off():
        return "off: FX2XLA_MALLOC_TUNING=0"
    given = user_settings()
    if given:
        return f"left to the user: {given} is set"
    libc = glibc()
    if libc is None:
        return "left alone: not glibc"
    if _interposed(libc):
        return "left alone: malloc is not glibc's"
    if not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "left alone: mallopt refused"
    return f"set: mmap threshold {MMAP_THRESHOLD >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB"


def status() -> str:
    """What `tune` decided, or "not yet" before the first CPU executable."""
    return _status or "not yet: no CPU executable loaded"


def release() -> bool:
    """Returns the free memory glibc keeps at the top of its heaps to the system
    (`malloc_trim(0)`); False where glibc's malloc is not the one in use."""
    libc = glibc()
    if libc is None or _interposed(libc):
        return False
    libc.malloc_trim(0)
    return True
