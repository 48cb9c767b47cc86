"""Compile StableHLO through the PJRT client, with the in-memory and disk caches in front, and
launch the executables (`make_launcher`).

The per-call fast paths are private jaxlib API, each behind one small function with a public
fallback: `_private_launcher` (execute_sharded + prebuilt C++ result handlers; fallback: the
public `LoadedExecutable.execute`) and `_private_traceback_pause` (no Python-stack recording for
the hand-off's own arrays; fallback: no pause). `FX2XLA_PUBLIC_EXECUTE=1` forces both public.
"""
from __future__ import annotations

import functools
import os
import threading
import time

from .cache import ExecutableCache, executable_cache, fingerprint
from .client import Device
from .disk_cache import DiskCache, default_cache_dir
from .handoff import _use_public, export_array


# XLA:CPU debug options fx2xla sets per compile (users never need XLA_FLAGS for them): applied
# as `CompileOptions.env_option_overrides`, so the serialized options, and with them the disk-
# cache key, include them, as does the in-memory key. Empty: nothing measured here beat XLA's
# defaults end to end (jaxlib 0.10.2, 2 cores; GPT-2 4 layers x 256, batch 4 x 128, interleaved
# medians of the executables). XLA already sends dots to YNNPACK kernels (`ynn_fusion`); turning
# that off, oneDNN or XNNPACK dot fusions, more YNN fusion kinds, single-threaded Eigen, the
# FAST_RUNTIME preset, the concurrency scheduler, backend opt level 3, exec-time effort 1.0,
# non-strict dot math and fast math were all within +-6% (noise) on inference and training.
# The one clear executable-level win, xla_cpu_use_fusion_emitters=False (training forward 0.75x,
# AdamW step 0.66x, backward 0.97x, inference neutral, results equal), compiled training graphs
# 1.6-2x slower and moved a whole training step by only 1% (0.99x): not adopted.
# FX2XLA_XLA_CPU_DEFAULTS=1 compiles with XLA's defaults whatever this holds.
CPU_OPTION_OVERRIDES: tuple = ()


def cpu_option_overrides() -> list:
    """The overrides in force for CPU compiles (empty with FX2XLA_XLA_CPU_DEFAULTS=1)."""
    if os.environ.get("FX2XLA_XLA_CPU_DEFAULTS", "") not in ("", "0"):
        return []
    return list(CPU_OPTION_OVERRIDES)


def _compile_options(platform: str = "cpu", overrides: bool = True):
    import jax.extend.backend

    options = jax.extend.backend.get_compile_options(num_replicas=1, num_partitions=1)
    if overrides and platform == "cpu":
        options.env_option_overrides = cpu_option_overrides()
    return options


def _unknown_option(e: Exception) -> bool:
    return "No such compile option" in str(e)  # an override this jaxlib no longer has


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
    from .client import used_devices

    used_devices.add(device)
    cache = executable_cache if cache is None else cache
    fp = fingerprint(module_text)
    options = _compile_options(device.platform)
    key = (fp, device.platform, device.index, device.kind, tuple(options.env_option_overrides))
    exe = cache.get(key)
    if exe is not None:
        return exe
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
    try:
        exe = device.client.compile_and_load(module_text, [device.jax_device], options)
    except Exception as e:
        if not (_unknown_option(e) and options.env_option_overrides):
            raise
        options = _compile_options(device.platform, overrides=False)  # XLA's defaults, then
        if disk_key is not None:
            disk_key = (fp, options.SerializeAsString().hex(), device.kind, *_environment_key(device.platform))
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


def _public_launcher(exe, export):
    execute = exe.execute
    if not callable(export):  # one export per result
        exports = export

        def launch_public(bufs: list) -> list:
            return [e(o) for e, o in zip(exports, execute(bufs))]

        return launch_public

    def launch_public(bufs: list) -> list:
        return [export(o) for o in execute(bufs)]

    return launch_public


def _private_launcher(exe, export):
    """`execute_sharded` with jaxlib's C++ result handlers, each wrapped with `export`, built
    once from the first call's outputs (avals and shardings never change for an executable).
    Skips the public `execute`'s Python disassembly of the results, which builds a sharding
    object per output per call (~9 µs a call on a tiny graph). None if jaxlib lacks them."""
    try:
        from jax._src.lib import _jax

        make_handler = _jax.array_result_handler
        execute_sharded = exe.execute_sharded
    except (ImportError, AttributeError):
        return None
    execute = exe.execute
    handlers = None

    def launch_private(bufs: list) -> list:
        nonlocal handlers
        if handlers is not None:
            return execute_sharded(bufs).consume_with_handlers(handlers)
        outs = execute(bufs)  # the first call: public, and it tells the outputs' avals
        exports = [export] * len(outs) if callable(export) else export
        try:
            handlers = [make_handler(o.aval, o.sharding, committed=True, _skip_checks=True).wrap(e)
                        for o, e in zip(outs, exports)]
        except Exception:  # an output jaxlib's handler refuses: plain callables, still batched
            handlers = [lambda shards, e=e: e(shards[0]) for e in exports]
        return [e(o) for e, o in zip(exports, outs)]

    return launch_private


def _private_traceback_pause():
    """jaxlib records the Python stack on every array it creates; for the hand-off's arrays
    (never seen by users) that is ~2 µs a call, ~10 µs under Dynamo's deeper stack. Returns
    (pause, resume) over jaxlib's switch, or None if absent. `pause()` is True when the call
    runs paused; only then does the caller `resume()`.

    The switch is process-global, and jaxlib reads it more than once inside one execute (it
    sets up a traceback "user context" when recording is on, and demands one when it is on):
    flipped by one thread while another executes, that thread fails with "a null user
    context". So it is flipped under a count: off when the first paused call starts, back on
    when the last one in flight ends, so every concurrent call of ours runs with it off from
    start to end. jax code of the user's own running in another thread at that moment could
    still see it flip; FX2XLA_PUBLIC_EXECUTE=1 (no pause, ~2-10 µs a call) rules that out."""
    try:
        from jax._src.lib import _jax

        enabled, set_enabled = _jax.tracebacks_enabled, _jax.set_tracebacks_enabled
    except (ImportError, AttributeError):
        return None
    lock = threading.Lock()
    in_flight = [0]  # paused calls running now

    def pause_private() -> bool:
        with lock:
            if not in_flight[0]:
                if not enabled():  # the user turned recording off: leave the switch alone
                    return False
                set_enabled(False)
            in_flight[0] += 1
        return True

    def resume_private() -> None:
        with lock:
            in_flight[0] -= 1
            if not in_flight[0]:
                set_enabled(True)

    return pause_private, resume_private


def _public_traceback_pause():
    def pause_public() -> bool:
        return False

    def resume_public() -> None:
        pass

    return pause_public, resume_public


def make_traceback_pause(public: bool | None = None):
    """(pause, resume): `if pause(): ...; resume()` around a call's imports and launch."""
    private = None if _use_public(public, "FX2XLA_PUBLIC_EXECUTE") else _private_traceback_pause()
    return private or _public_traceback_pause()


def make_launcher(exe, export=None, public: bool | None = None):
    """`launch(bufs) -> list of torch.Tensor`: execute a single-device executable on PJRT
    buffers and hand every output back with `export` (default: `handoff.export_array`), or
    with `export[i]` for output i when it is a list (outputs that go to different devices)."""
    export = export_array if export is None else export
    private = None if _use_public(public, "FX2XLA_PUBLIC_EXECUTE") else _private_launcher(exe, export)
    return private or _public_launcher(exe, export)
