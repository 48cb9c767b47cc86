"""The in-memory executable cache: hits, misses, and LRU eviction that only costs a recompile."""
import os

import jax
import jax.numpy as jnp
import pytest
import torch

from fx2xla.runtime import ExecutableCache, compile_module, default_device
from fx2xla.runtime.cache import DEFAULT_MAX_ENTRIES
from fx2xla.runtime.handoff import export_array, import_tensor


def _module(scale: float) -> str:
    return jax.jit(lambda x: x * scale).lower(jax.ShapeDtypeStruct((3,), jnp.float32)).as_text()


def test_hit_miss_and_eviction():
    cache = ExecutableCache(max_entries=2)
    dev = default_device()
    mods = [_module(s) for s in (2.0, 3.0, 4.0)]
    e0 = compile_module(mods[0], dev, cache, use_disk=False)
    assert compile_module(mods[0], dev, cache, use_disk=False) is e0
    assert (cache.stats.hits, cache.stats.misses, cache.stats.compiles) == (1, 1, 1)
    compile_module(mods[1], dev, cache, use_disk=False)
    compile_module(mods[2], dev, cache, use_disk=False)  # evicts mods[0], the least recently used
    assert cache.stats.evictions == 1 and len(cache) == 2
    again = compile_module(mods[0], dev, cache, use_disk=False)  # a recompile, not a failure
    assert cache.stats.compiles == 4
    x = torch.tensor([1.0, 2.0, 3.0])
    out = export_array(again.execute([import_tensor(x, dev.jax_device)])[0])
    torch.testing.assert_close(out, x * 2)


def test_pjrt_device_selection(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "cpu")
    d = default_device()
    assert d.platform == "cpu" and d.index == 0 and d.kind


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_evicted_executables_release_their_memory_mappings():
    """The default cache keeps DEFAULT_MAX_ENTRIES executables, and an evicted executable that
    nothing else holds gives back its JIT code's memory mappings: compiling 2x that many distinct
    modules leaves the cache full and the process's mappings about where they were when it first
    filled (each executable holds several; Linux allows 65,530 per process, which 512 entries of
    transformers models once exhausted)."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps on this OS")
    cache = ExecutableCache()
    assert cache.max_entries == DEFAULT_MAX_ENTRIES <= 64
    dev = default_device()
    before = _mappings()
    for i in range(cache.max_entries):
        compile_module(_module(1.0 + i), dev, cache, use_disk=False)
    full = _mappings()
    assert full - before >= cache.max_entries   # each executable holds at least one mapping
    for i in range(cache.max_entries, 2 * cache.max_entries):
        compile_module(_module(1.0 + i), dev, cache, use_disk=False)
    assert len(cache) == cache.max_entries and cache.stats.evictions == cache.max_entries
    assert _mappings() - full < (full - before) // 4, (before, full, _mappings())
