"""Compile StableHLO through the PJRT client, with the executable cache in front."""
from __future__ import annotations

import time

from .cache import ExecutableCache, executable_cache, fingerprint
from .client import Device


def _compile_options():
    import jax.extend.backend

    return jax.extend.backend.get_compile_options(num_replicas=1, num_partitions=1)


def compile_module(module_text: str, device: Device, cache: ExecutableCache | None = None):
    """A loaded PJRT executable for `module_text` (StableHLO) on `device`, from the cache if
    the same module was compiled for the same device before."""
    cache = executable_cache if cache is None else cache
    key = (fingerprint(module_text), device.platform, device.index, device.kind)
    exe = cache.get(key)
    if exe is not None:
        return exe
    t0 = time.perf_counter()
    exe = device.client.compile_and_load(module_text, [device.jax_device], _compile_options())
    cache.stats.compiles += 1
    cache.stats.compile_seconds += time.perf_counter() - t0
    cache.put(key, exe)
    return exe


def optimized_hlo_text(exe) -> str:
    """The HLO XLA produced after its optimisation passes, for dumps."""
    return "\n\n".join(m.to_string() for m in exe.hlo_modules())
