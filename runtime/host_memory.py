"""glibc's malloc thresholds for a process that runs CPU executables.

XLA:CPU allocates every execution's results and its temporary buffer afresh with
`posix_memalign`, and frees them when the results die: megabytes per call. glibc's malloc
returns the free memory at the top of its heap to the system once it exceeds the trim
threshold, which it sets to twice the largest chunk it has seen freed from an mmap (starting
at 128 KiB), and serves requests from the mmap threshold up with a fresh mmap. Both send the
next call's buffers to fresh pages, which fault on first touch: a Linear with a 4 MiB result
took 26-380 minor faults per call, LLaMA 4L inference at 4 x 128 up to 290 where Inductor's
took 0-64 (docs/benchmarks.md, "Page faults of XLA's buffers").

Buffers allocated on XLA's own threads come from glibc's per-thread arenas. An arena grows in
heaps of at most 64 MiB (HEAP_MAX_SIZE: twice the largest mmap threshold), and once a heap past
its arena's first is wholly free, `free` unmaps it (`heap_trim`, malloc/arena.c) unless the top
pad asks to keep more than the heap before it could take. An MLP training step's two 16 MiB
weight gradients, allocated on XLA's threads, took 4,100-8,700 faults per step that way, and
its backward 1.5-2x its time.

So, the first time a CPU executable is loaded (`tune`), fx2xla sets the mmap threshold to
32 MiB (the highest glibc's own adjustment reaches on a 64-bit system), the trim threshold to
1 GiB and the top pad to 64 MiB (HEAP_MAX_SIZE: with that pad no heap is ever unmapped). A
process then keeps the memory its buffers freed for its next allocations instead of returning
it, up to its peak use; the top pad is address space, not memory: glibc asks for it beyond each
growth of a heap but pages nothing in. Under the kernel's strict overcommit accounting
(`vm.overcommit_memory=2`) that address space would be charged as memory, 64 MiB per arena, so
there the top pad is not set. `release()` returns the main heap's free top and the pages of
free blocks inside every arena on demand (`malloc_trim`, which leaves the free tops of other
threads' arenas: at most their peak use).

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
TOP_PAD = 64 << 20

# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
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


def strict_overcommit(path: str = "/proc/sys/vm/overcommit_memory") -> bool:
    """Whether the kernel charges every writable private mapping against a commit limit
    (`vm.overcommit_memory=2`); False where that cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip() == "2"
    except OSError:
        return False


def settings(strict: bool) -> list[tuple[str, int, int]]:
    """(name, mallopt parameter, value) for what `tune` sets: no top pad under strict overcommit."""
    chosen = [("mmap threshold", _M_MMAP_THRESHOLD, MMAP_THRESHOLD), ("trim threshold", _M_TRIM_THRESHOLD, TRIM_THRESHOLD)]
    if not strict:
        chosen.append(("top pad", _M_TOP_PAD, TOP_PAD))
    return chosen


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
    strict = strict_overcommit()
    chosen = settings(strict)
    if not all(libc.mallopt(param, value) for _, param, value in chosen):
        return "left alone: mallopt refused"
    said = ", ".join(f"{name} {value >> 20} MiB" for name, _, value in chosen)
    return f"set: {said}" + (" (no top pad: strict overcommit)" if strict else "")


def status() -> str:
    """What `tune` decided, or "not yet" before the first CPU executable."""
    return _status or "not yet: no CPU executable loaded"


def release() -> bool:
    """Returns the free memory glibc keeps at the top of the main heap, and the pages of free
    blocks in every arena, to the system (`malloc_trim(0)`); False where glibc's malloc is not
    the one in use."""
    libc = glibc()
    if libc is None or _interposed(libc):
        return False
    libc.malloc_trim(0)
    return True
