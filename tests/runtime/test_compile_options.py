"""XLA options fx2xla sets per compile (XLA:CPU's, and on GPUs the autotune cache folder): in
the options (never XLA_FLAGS), in both cache keys, switchable off, and harmless when a jaxlib
no longer knows one."""
import dataclasses

import jax
import pytest
import jax.numpy as jnp
import torch

from fx2xla.runtime import Device, ExecutableCache, compile_module, default_device, executor
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
    with_overrides = executor.compile_options("cpu")
    assert [tuple(o) for o in with_overrides.env_option_overrides] == list(KNOWN)
    monkeypatch.setenv("FX2XLA_XLA_CPU_DEFAULTS", "1")
    plain = executor.compile_options("cpu")
    assert list(plain.env_option_overrides) == []
    # The disk-cache key is built from the serialized options: the overrides change it.
    assert with_overrides.SerializeAsString() != plain.SerializeAsString()
    # CPU overrides never reach another platform's compiles.
    assert not {o[0] for o in executor.compile_options("cuda").env_option_overrides} & {k for k, _ in KNOWN}


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
    o = executor.compile_options("cpu")
    assert [tuple(p) for p in o.env_option_overrides] == list(executor.cpu_option_overrides())
    dev = default_device()
    text = _module(4.0)
    be = dev.client
    tuned = be.compile_and_load(text, [dev.jax_device], o)
    plain = be.compile_and_load(text, [dev.jax_device], executor.compile_options("cpu", overrides=False))
    x = torch.randn(5)
    torch.testing.assert_close(_run(tuned, x), _run(plain, x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# GPU compiles keep XLA's autotune results in the disk cache (checked here on the CPU client)
# ---------------------------------------------------------------------------------------------

def _overrides(options) -> list:
    return [tuple(o) for o in options.env_option_overrides]


def test_gpu_options_keep_autotune_results_beside_the_executables(monkeypatch, tmp_path):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("FX2XLA_CACHE_DIR", str(cache_dir))
    folder = str(cache_dir / "xla-autotune")
    for platform in ("cuda", "rocm"):
        assert _overrides(executor.compile_options(platform)) == [(executor.AUTOTUNE_OPTION, folder)]
    assert (cache_dir / "xla-autotune").is_dir()  # made here: XLA asks for an existing folder
    # A fixed path: the serialized options, and with them the disk-cache key, do not change.
    first, again = (executor.compile_options("cuda").SerializeAsString() for _ in range(2))
    assert first == again
    assert _overrides(executor.compile_options("cuda", overrides=False)) == []  # compile_module's retry
    assert all(o[0] != executor.AUTOTUNE_OPTION for o in _overrides(executor.compile_options("cpu")))
    monkeypatch.chdir(tmp_path)  # a relative FX2XLA_CACHE_DIR is made absolute for XLA
    monkeypatch.setenv("FX2XLA_CACHE_DIR", "cache")
    assert _overrides(executor.compile_options("cuda")) == [(executor.AUTOTUNE_OPTION, folder)]


def test_gpu_autotune_level_is_an_option(monkeypatch, tmp_path):
    """FX2XLA_GPU_AUTOTUNE_LEVEL reaches GPU compiles (beside the autotune folder), never CPU
    ones; unset keeps XLA's default; a bad value is a clear error."""
    monkeypatch.setenv("FX2XLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FX2XLA_GPU_AUTOTUNE_LEVEL", "2")
    overrides = dict(_overrides(executor.compile_options("cuda")))
    assert int(overrides[executor.AUTOTUNE_LEVEL_OPTION]) == 2 and executor.AUTOTUNE_OPTION in overrides
    assert all(o[0] != executor.AUTOTUNE_LEVEL_OPTION for o in _overrides(executor.compile_options("cpu")))
    monkeypatch.setenv("FX2XLA_CACHE_DIR", "")
    assert [(k, int(v)) for k, v in _overrides(executor.compile_options("cuda"))] == [(executor.AUTOTUNE_LEVEL_OPTION, 2)]
    monkeypatch.setenv("FX2XLA_GPU_AUTOTUNE_LEVEL", "fast")
    with pytest.raises(ValueError, match="FX2XLA_GPU_AUTOTUNE_LEVEL"):
        executor.compile_options("cuda")
    monkeypatch.delenv("FX2XLA_GPU_AUTOTUNE_LEVEL")
    assert _overrides(executor.compile_options("cuda")) == []


def test_no_autotune_folder_without_the_disk_cache(monkeypatch):
    monkeypatch.setenv("FX2XLA_CACHE_DIR", "")
    assert _overrides(executor.compile_options("cuda")) == []
    assert executor.gpu_autotune_cache_dir() is None


def test_an_autotune_folder_chosen_elsewhere_is_kept(monkeypatch, tmp_path):
    """XLA_FLAGS or jax's persistent cache may name a folder already: fx2xla leaves it."""
    monkeypatch.setenv("FX2XLA_CACHE_DIR", str(tmp_path))
    import jax.extend.backend

    options = jax.extend.backend.get_compile_options(num_replicas=1, num_partitions=1)
    assert executor.gpu_autotune_cache_dir(options) == str(tmp_path / "xla-autotune")
    setattr(options.executable_build_options.debug_options, executor.AUTOTUNE_OPTION, "/elsewhere")
    assert executor.gpu_autotune_cache_dir(options) is None


def test_this_jaxlib_knows_the_autotune_option(monkeypatch, tmp_path):
    """Overrides are checked against XLA's DebugOptions when compiling, on any client: the CPU
    client compiles with the GPU options (the GPU option itself is only read by XLA:GPU)."""
    monkeypatch.setenv("FX2XLA_CACHE_DIR", str(tmp_path))
    options = executor.compile_options("cuda")
    assert _overrides(options) == [(executor.AUTOTUNE_OPTION, str(tmp_path / "xla-autotune"))]
    dev = default_device()
    exe = dev.client.compile_and_load(_module(5.0), [dev.jax_device], options)
    x = torch.randn(5)
    torch.testing.assert_close(_run(exe, x), torch.tanh(x) * 5)


@dataclasses.dataclass(frozen=True)
class _CudaOnTheCpuClient(Device):
    """A "cuda" device (so compile_module builds the GPU options) whose compiles run on the CPU
    client; records the overrides of every compile it is asked for."""

    compiled: list = dataclasses.field(default_factory=list, compare=False)

    @property
    def client(self):
        real, compiled = default_device().client, self.compiled

        class Recording:
            def __getattr__(self, name):
                return getattr(real, name)

            def compile_and_load(self, text, devices, options):
                compiled.append(_overrides(options))
                return real.compile_and_load(text, devices, options)

        return Recording()

    @property
    def jax_device(self):
        return default_device().jax_device


def test_an_xla_without_the_autotune_option_still_compiles(monkeypatch, tmp_path):
    """An XLA that does not know the option refuses the compile ("No such compile option");
    compile_module compiles again with XLA's defaults and caches that executable. (A jaxlib
    whose options lack the field never gets the override: gpu_autotune_cache_dir checks it;
    this is a plugin whose XLA lacks it, so that check is bypassed.)"""
    from fx2xla.runtime import client as runtime_client

    monkeypatch.setenv("FX2XLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(executor, "AUTOTUNE_OPTION", "xla_gpu_option_that_does_not_exist")
    options = executor.compile_options("cuda")
    assert _overrides(options) == []  # unknown to this jaxlib's options: never set
    folder = str(tmp_path / "xla-autotune")
    monkeypatch.setattr(executor, "gpu_autotune_cache_dir", lambda options=None: folder)
    monkeypatch.setattr(executor, "environment_key", lambda platform: ("jaxlib", platform))  # no CUDA here
    monkeypatch.setattr(runtime_client, "used_devices", set())
    disk = DiskCache(str(tmp_path))
    monkeypatch.setattr(executor, "disk_cache", lambda: disk)
    device = _CudaOnTheCpuClient("cuda", 0)
    cache = ExecutableCache()
    exe = compile_module(_module(6.0), device, cache)
    # Refused with the override, then compiled with XLA's defaults.
    assert device.compiled == [[("xla_gpu_option_that_does_not_exist", folder)], []]
    assert cache.stats.compiles == 1 and disk.stats.writes == 1
    x = torch.randn(5)
    torch.testing.assert_close(_run(exe, x), torch.tanh(x) * 6)
    assert compile_module(_module(6.0), device, cache) is exe  # the in-memory key is stable
