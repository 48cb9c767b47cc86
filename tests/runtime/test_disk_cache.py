"""The disk cache: a second process loads instead of compiling; bad entries are dropped and
recompiled; concurrent writers both succeed; foreign entries never load."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fx2xla
from fx2xla.runtime.disk_cache import DiskCache

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, fx2xla
    def f(x, w):
        return torch.tanh(x @ w) * 0.5 + 0.25
    x = torch.arange(12.).reshape(3, 4) / 10
    w = torch.ones(4, 2)
    out = torch.compile(f, backend="fx2xla", fullgraph=True)(x, w)
    torch.testing.assert_close(out, f(x, w))
    print(json.dumps(fx2xla.metrics()))
    """
)


def _run(cache_dir, extra_env=None):
    env = dict(os.environ, FX2XLA_CACHE_DIR=str(cache_dir), **(extra_env or {}))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    import json

    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_second_process_loads_from_disk(tmp_path):
    cold, _ = _run(tmp_path)
    assert cold["compiles"] == 1 and cold["disk_writes"] == 1 and cold["disk_hits"] == 0
    warm, _ = _run(tmp_path)
    assert warm["compiles"] == 0 and warm["disk_hits"] == 1
    assert len(DiskCache(str(tmp_path)).entries()) == 1


def _module(scale: float) -> str:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x: jnp.sin(x) * scale).lower(jax.ShapeDtypeStruct((3,), jnp.float32)).as_text()


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_damaged_entry_is_dropped_and_recompiled(tmp_path, monkeypatch, damage):
    from fx2xla.runtime import ExecutableCache, compile_module, default_device
    from fx2xla.runtime.executor import disk_cache
    from fx2xla.runtime.handoff import export_array, import_tensor

    monkeypatch.setenv("FX2XLA_CACHE_DIR", str(tmp_path))
    dev, text = default_device(), _module(3.0)
    compile_module(text, dev, ExecutableCache())  # a fresh memory cache: like a new process
    (entry,) = DiskCache(str(tmp_path)).entries()
    data = open(entry, "rb").read()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data = data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:]
    else:
        data = b"not an executable"
    open(entry, "wb").write(data)
    mem = ExecutableCache()
    with pytest.warns(UserWarning, match="dropping cache entry"):
        exe = compile_module(text, dev, mem)
    assert mem.stats.compiles == 1 and disk_cache().stats.dropped >= 1
    x = torch.tensor([0.5, 1.0, 2.0])
    torch.testing.assert_close(export_array(exe.execute([import_tensor(x, dev.jax_device)])[0]), torch.sin(x) * 3)
    # ... and the recompiled entry replaced it: the next "process" loads it.
    again = ExecutableCache()
    compile_module(text, dev, again)
    assert again.stats.compiles == 0


def test_concurrent_writers_both_succeed(tmp_path):
    env = dict(os.environ, FX2XLA_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    assert len(DiskCache(str(tmp_path)).entries()) == 1
    m, _ = _run(tmp_path)
    assert m["compiles"] == 0 and m["disk_hits"] == 1


def test_entry_for_another_jaxlib_or_device_never_loads(tmp_path):
    cache = DiskCache(str(tmp_path))
    key = ("fingerprint", "options", "cpu-kind", "0.10.2", "cpu", "pv")
    cache.put(key, b"payload")
    assert cache.get(key) == b"payload"
    other = key[:3] + ("0.9.0",) + key[4:]
    assert cache.get(other) is None  # another jaxlib: another name, never found
    # An entry whose header names other facts than its file name is dropped, not loaded.
    os.replace(cache.path(key), cache.path(other))
    with pytest.warns(UserWarning, match="dropping cache entry"):
        assert cache.get(other) is None
    assert cache.entries() == []


def test_disk_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv("FX2XLA_CACHE_DIR", "")
    torch.compile(lambda x: x * 3.75 - 1, backend="fx2xla")(torch.randn(3))
    assert fx2xla.metrics()["disk_cache_dir"] is None


def test_cache_cli_info_and_clear(tmp_path):
    """`cache info` counts the executables and names the other kept measurements; `cache clear`
    removes all of them (the next process starts cold) and leaves files it does not own."""
    from fx2xla.runtime import dot_layout
    from fx2xla.runtime.executor import AUTOTUNE_FOLDER

    DiskCache(str(tmp_path)).put(("k",), b"x" * 1000)
    (tmp_path / dot_layout.FILE_NAME).write_text("{}")
    (tmp_path / AUTOTUNE_FOLDER).mkdir()
    (tmp_path / AUTOTUNE_FOLDER / "fusion.textproto").write_text("x")
    (tmp_path / "mine.txt").write_text("a user's file")
    env = dict(os.environ, FX2XLA_CACHE_DIR=str(tmp_path))
    info = subprocess.run([sys.executable, "-m", "fx2xla", "cache", "info"], env=env, capture_output=True, text=True, check=True)
    assert "1 executables" in info.stdout
    assert "CPU dot-layout timings" in info.stdout and "GPU autotune results" in info.stdout
    clear = subprocess.run([sys.executable, "-m", "fx2xla", "cache", "clear"], env=env, capture_output=True, text=True, check=True)
    assert "removed 1 executables" in clear.stdout and DiskCache(str(tmp_path)).entries() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
