"""Compile StableHLO through the PJRT client, with the in-memory and disk caches in front."""
from __future__ import annotations

import functools
import time

from .cache import ExecutableCache, executable_cache, fingerprint
from .client import Device
from .disk_cache import DiskCache, default_cache_dir


def _compile_options():
    import jax.extend.backend

    return jax.extend.backend.get_compile_options(num_replicas=1, num_partitions=1)


@functools.cache
def _disk_cache_for(folder: str | None) -> DiskCache | None:
    return DiskCache(folder) if folder else None


def disk_cache() -> DiskCache | None:
    """The disk cache for the current `FX2XLA_CACHE_DIR` (None when turned off)."""
    return _disk_cache_for(default_cache_dir())


@functools.cache
def _environment_key(platform: str) -> tuple:
    import os

    import jaxlib

    from .client import get_backend

    # XLA_FLAGS change what XLA compiles; they are read once per process, like this key.
    return (jaxlib.version.__version__, platform, get_backend(platform).platform_version,
            os.environ.get("XLA_FLAGS", ""))


def compile_module(module_text: str, device: Device, cache: ExecutableCache | None = None,
                   use_disk: bool = True):
    """A loaded PJRT executable for `module_text` (StableHLO) on `device`: from memory if this
    process compiled it before, else from the disk cache, else compiled (and stored in both)."""
    cache = executable_cache if cache is None else cache
    fp = fingerprint(module_text)
    key = (fp, device.platform, device.index, device.kind)
    exe = cache.get(key)
    if exe is not None:
        return exe
    options = _compile_options()
    disk = disk_cache() if use_disk else None
    disk_key = None
    if disk is not None:
        disk_key = (fp, options.SerializeAsString().hex(), device.kind, *_environment_key(device.platform))
        blob = disk.get(disk_key)
        if blob is not None:
            t0 = time.perf_counter()
            try:
                exe = device.client.deserialize_executable(blob, [device.jax_device], options)
            except Exception as e:  # an entry this jaxlib cannot load: recompile and replace it
                disk.drop(disk.path(disk_key), f"deserialize failed: {e}")
                exe = None
            disk.stats.load_seconds += time.perf_counter() - t0
            if exe is not None:
                cache.put(key, exe)
                return exe
    t0 = time.perf_counter()
    exe = device.client.compile_and_load(module_text, [device.jax_device], options)
    cache.stats.compiles += 1
    cache.stats.compile_seconds += time.perf_counter() - t0
    cache.put(key, exe)
    if disk is not None:
        disk.put(disk_key, device.client.serialize_executable(exe))
    return exe


def optimized_hlo_text(exe) -> str:
    """The HLO XLA produced after its optimisation passes, for dumps."""
    return "\n\n".join(m.to_string() for m in exe.hlo_modules())
