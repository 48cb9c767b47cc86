"""XLA:CPU options fx2xla sets per compile: in the options (never XLA_FLAGS), in both cache
keys, switchable off, and harmless when a jaxlib no longer knows one."""
import jax
import jax.numpy as jnp
import torch

from fx2xla.runtime import ExecutableCache, compile_module, default_device, executor
from fx2xla.runtime.disk_cache import DiskCache
from fx2xla.runtime.executor import make_launcher
from fx2xla.runtime.handoff import import_tensor

KNOWN = (("xla_cpu_enable_fast_min_max", False),)  # an option every recent jaxlib has


def _module(scale: float) -> str:
    return jax.jit(lambda x: jnp.tanh(x) * scale).lower(jax.ShapeDtypeStruct((5,), jnp.float32)).as_text()


def _run(exe, x):
    return make_launcher(exe)([import_tensor(x, default_device().jax_device)])[0]


def test_overrides_are_in_the_compile_options(monkeypatch):
    monkeypatch.setattr(executor, "CPU_OPTION_OVERRIDES", KNOWN)
    monkeypatch.delenv("FX2XLA_XLA_CPU_DEFAULTS", raising=False)
    with_overrides = executor._compile_options("cpu")
    assert [tuple(o) for o in with_overrides.env_option_overrides] == list(KNOWN)
    monkeypatch.setenv("FX2XLA_XLA_CPU_DEFAULTS", "1")
    plain = executor._compile_options("cpu")
    assert list(plain.env_option_overrides) == []
    # The disk-cache key is built from the serialized options: the overrides change it.
    assert with_overrides.SerializeAsString() != plain.SerializeAsString()
    assert list(executor._compile_options("cuda").env_option_overrides) == []


def test_overrides_split_both_caches(monkeypatch, tmp_path):
    monkeypatch.setattr(executor, "CPU_OPTION_OVERRIDES", KNOWN)
    disk = DiskCache(str(tmp_path))
    monkeypatch.setattr(executor, "disk_cache", lambda: disk)
    cache = ExecutableCache()
    dev = default_device()
    text = _module(2.0)
    monkeypatch.delenv("FX2XLA_XLA_CPU_DEFAULTS", raising=False)
    a = compile_module(text, dev, cache)
    monkeypatch.setenv("FX2XLA_XLA_CPU_DEFAULTS", "1")
    b = compile_module(text, dev, cache)
    assert a is not b and cache.stats.compiles == 2 and len(cache) == 2
    assert len(list(tmp_path.rglob("*"))) >= 2  # one disk entry per option set
    x = torch.randn(5)
    torch.testing.assert_close(_run(a, x), _run(b, x))


def test_unknown_override_falls_back_to_xla_defaults(monkeypatch):
    monkeypatch.setattr(executor, "CPU_OPTION_OVERRIDES", (("xla_cpu_option_that_does_not_exist", True),))
    monkeypatch.delenv("FX2XLA_XLA_CPU_DEFAULTS", raising=False)
    exe = compile_module(_module(3.0), default_device(), ExecutableCache(), use_disk=False)
    x = torch.randn(5)
    torch.testing.assert_close(_run(exe, x), torch.tanh(x) * 3)


def test_default_overrides_compile_and_match():
    """Whatever fx2xla ships in CPU_OPTION_OVERRIDES compiles on this jaxlib and gives the
    same numbers as XLA's defaults."""
    o = executor._compile_options("cpu")
    assert [tuple(p) for p in o.env_option_overrides] == list(executor.cpu_option_overrides())
    dev = default_device()
    text = _module(4.0)
    be = dev.client
    tuned = be.compile_and_load(text, [dev.jax_device], o)
    plain = be.compile_and_load(text, [dev.jax_device], executor._compile_options("cpu", overrides=False))
    x = torch.randn(5)
    torch.testing.assert_close(_run(tuned, x), _run(plain, x), rtol=1e-6, atol=1e-6)
