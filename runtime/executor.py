"""Compile StableHLO through the PJRT client, with the in-memory and disk caches in front, and
launch the executables (`make_launcher`).

The per-call fast paths are private jaxlib API, each behind one small function with a public
fallback: `_private_launcher` (execute_sharded + prebuilt C++ result handlers; fallback: the
public `LoadedExecutable.execute`) and `_private_traceback_pause` (no Python-stack recording for
the hand-off's own arrays; fallback: no pause). `FX2XLA_PUBLIC_EXECUTE=1` forces both public.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import time

from . import client
from .cache import ExecutableCache, executable_cache, fingerprint
from .client import Device
from .disk_cache import DiskCache, default_cache_dir
from .handoff import export_array, gather_array, use_public


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


# XLA's GPU autotuner (Triton GEMM fusion tilings, cuBLAS/cuDNN algorithms) takes most of a
# first GPU compile (an fp32 LLaMA on an H100: 67 s, 7.6 s with Triton GEMMs off) and keeps its
# results in process memory only. Pointed at a folder, it writes one small file per tuned
# fusion (keyed by the fusion's HLO and the GPU model) and reads them back in later processes,
# so a graph or shape compiled afresh that reuses a layer's GEMMs skips their tuning. The
# folder sits in the disk cache beside the executables (FX2XLA_CACHE_DIR="" turns both off).
# jax sets the same option when its own persistent cache is on. XLA's default mode (UPDATE:
# read and write) is kept: it writes each result to a temporary file and renames it into
# place, so processes sharing the folder do not see each other's partial files.
AUTOTUNE_OPTION = "xla_gpu_per_fusion_autotune_cache_dir"
AUTOTUNE_FOLDER = "xla-autotune"  # in the disk cache's folder
_GPU_PLATFORMS = ("cuda", "rocm", "gpu")


def gpu_autotune_cache_dir(options=None) -> str | None:
    """The folder XLA's GPU autotuner should keep its results in: `<disk cache>/xla-autotune`,
    absolute and created here (the option's documentation asks for an existing folder). None
    when the disk cache is off, the folder cannot be made or written, this jaxlib has no such
    option, or `options` already name a folder (XLA_FLAGS or jax's persistent cache set it:
    theirs is kept)."""
    folder = default_cache_dir()
    if not folder:
        return None
    if options is not None:
        debug = options.executable_build_options.debug_options
        current = getattr(debug, AUTOTUNE_OPTION, None)
        if current is None or current:  # unknown to this jaxlib, or chosen elsewhere
            return None
    path = os.path.join(os.path.abspath(folder), AUTOTUNE_FOLDER)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None


def compile_options(platform: str = "cpu", overrides: bool = True):
    import jax.extend.backend

    options = jax.extend.backend.get_compile_options(num_replicas=1, num_partitions=1)
    if overrides and platform == "cpu":
        options.env_option_overrides = cpu_option_overrides()
    elif overrides and platform in _GPU_PLATFORMS:
        # An override, like the CPU ones: both cache keys see it (the in-memory key holds the
        # overrides, the disk key the serialized options), and the path is fixed for a given
        # cache folder, so the keys stay stable across processes. An XLA that does not know
        # the name fails with "No such compile option" and compile_module retries with
        # `overrides=False` (no autotune cache, nothing else lost).
        folder = gpu_autotune_cache_dir(options)
        gpu = [] if folder is None else [(AUTOTUNE_OPTION, folder)]
        level = gpu_autotune_level()
        if level is not None:
            gpu.append((AUTOTUNE_LEVEL_OPTION, level))
        if gpu:
            options.env_option_overrides = gpu
    return options


# How hard XLA's GPU autotuner searches (0: off, 4: XLA's default, everything). On the H100 an
# fp32 LLaMA's first call took 67 s at the default and 10 s at 0, but ran 6x slower at 0; the
# level that keeps the kernels within a few percent is not measured yet, so XLA's default stays
# unless FX2XLA_GPU_AUTOTUNE_LEVEL names one.
AUTOTUNE_LEVEL_OPTION = "xla_gpu_autotune_level"


def gpu_autotune_level() -> int | None:
    """FX2XLA_GPU_AUTOTUNE_LEVEL as an int 0-4, or None (unset: XLA's default)."""
    raw = os.environ.get("FX2XLA_GPU_AUTOTUNE_LEVEL", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or not 0 <= int(raw) <= 4:
        raise ValueError(f"fx2xla: FX2XLA_GPU_AUTOTUNE_LEVEL={raw!r}: expected 0 (no autotuning) to 4 (XLA's default)")
    return int(raw)


def _spmd_options(options, device_ids: tuple[int, ...]):
    """`options` for one SPMD program over `device_ids` (in the mesh's order): XLA partitions
    the module by its Shardy shardings. Raw CompileOptions have both switches off, and a module
    whose shardings the partitioner never reads would run replicated on every device."""
    import jax.extend.backend
    import numpy as np

    spmd = jax.extend.backend.get_compile_options(
        num_replicas=1, num_partitions=len(device_ids), device_assignment=np.array([device_ids]))
    spmd.env_option_overrides = list(options.env_option_overrides)
    build = spmd.executable_build_options
    build.use_spmd_partitioning = True
    build.use_shardy_partitioner = True
    return spmd


def _unknown_option(e: Exception) -> bool:
    return "No such compile option" in str(e)  # an override this jaxlib no longer has


@functools.cache
def _disk_cache_for(folder: str | None) -> DiskCache | None:
    return DiskCache(folder) if folder else None


def disk_cache() -> DiskCache | None:
    """The disk cache for the current `FX2XLA_CACHE_DIR` (None when turned off)."""
    return _disk_cache_for(default_cache_dir())


@functools.cache
def environment_key(platform: str) -> tuple:
    """What a disk-cache entry depends on besides the module and its compile options: jaxlib's
    version, the platform and its runtime's version, and XLA_FLAGS (read once per process, as
    XLA reads them)."""
    import jaxlib

    return (jaxlib.version.__version__, platform, client.get_backend(platform).platform_version,
            os.environ.get("XLA_FLAGS", ""))


def _recording():
    return make_recording()()


def compile_module(module_text: str, device: Device, cache: ExecutableCache | None = None,
                   use_disk: bool = True, mesh_devices: tuple | None = None):
    """A loaded PJRT executable for `module_text` (StableHLO) on `device`: from memory if this
    process compiled it before, else from the disk cache, else compiled (and stored in both).
    `mesh_devices`: the jax devices of an SPMD module's mesh, in mesh order (`device` is the
    first); the executable is partitioned over them."""
    client.used_devices.add(device)
    cache = executable_cache if cache is None else cache
    fp = fingerprint(module_text)
    options = compile_options(device.platform)
    targets = list(mesh_devices) if mesh_devices else [device.jax_device]
    ids = tuple(d.id for d in targets)
    if mesh_devices:
        options = _spmd_options(options, ids)
    key = (fp, device.platform, ids, device.kind, tuple(options.env_option_overrides))
    exe = cache.get(key)
    if exe is not None:
        return exe
    disk = disk_cache() if use_disk else None
    disk_key = None
    if disk is not None:
        disk_key = (fp, options.SerializeAsString().hex(), device.kind, *environment_key(device.platform))
        blob = disk.get(disk_key)
        if blob is not None:
            t0 = time.perf_counter()
            try:
                with _recording():
                    exe = device.client.deserialize_executable(blob, targets, options)
            except Exception as e:  # an entry this jaxlib cannot load: recompile and replace it
                disk.drop(disk.path(disk_key), f"deserialize failed: {e}")
                exe = None
            disk.stats.load_seconds += time.perf_counter() - t0
            if exe is not None:
                cache.put(key, exe)
                return exe
    t0 = time.perf_counter()
    try:
        with _recording():
            exe = device.client.compile_and_load(module_text, targets, options)
    except Exception as e:
        if not (_unknown_option(e) and options.env_option_overrides):
            raise
        options = compile_options(device.platform, overrides=False)  # XLA's defaults, then
        if mesh_devices:
            options = _spmd_options(options, ids)
        if disk_key is not None:
            disk_key = (fp, options.SerializeAsString().hex(), device.kind, *environment_key(device.platform))
        with _recording():
            exe = device.client.compile_and_load(module_text, targets, options)
    cache.stats.compiles += 1
    cache.stats.compile_seconds += time.perf_counter() - t0
    cache.put(key, exe)
    if disk is not None:
        disk.put(disk_key, device.client.serialize_executable(exe))
    return exe


def optimized_hlo_text(exe) -> str:
    """The HLO XLA produced after its optimisation passes, for dumps."""
    return "\n\n".join(m.to_string() for m in exe.hlo_modules())


def peak_bytes(stats) -> int:
    """Peak bytes per device by XLA's memory analysis (`exe.get_compiled_memory_stats()`): the
    arguments, the outputs not written in place of an argument, and the temporaries, live at
    once."""
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
            + stats.temp_size_in_bytes)


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


def _result_handler(make_handler, out):
    """jaxlib's C++ result handler for results like `out`, skipping its Python-side shard checks
    where this jaxlib offers that (`_skip_checks`: 0.10 does; the CUDA build of 0.11.2 has no
    such argument, and refusing it sent every result down the plain-callable path)."""
    try:
        return make_handler(out.aval, out.sharding, committed=True, _skip_checks=True)
    except TypeError:
        return make_handler(out.aval, out.sharding, committed=True)


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
            handlers = [_result_handler(make_handler, o).wrap(e) for o, e in zip(outs, exports)]
        except Exception:  # an output jaxlib's handler refuses: plain callables, still batched
            handlers = [lambda shards, e=e: e(shards[0]) for e in exports]
        return [e(o) for e, o in zip(exports, outs)]

    return launch_private


# pause()'s answer for a call that runs recorded while a block needs recording on: truthy, so
# the caller resumes it too (resume(kind)), which ends its membership of the recorded group.
RECORDED = "recorded"


@functools.cache
def _private_traceback_pause():
    """jaxlib records the Python stack on every array it creates; for the hand-off's arrays
    (never seen by users) that is ~2 µs a call, ~10 µs under Dynamo's deeper stack. Returns
    (pause, resume, recording) over jaxlib's switch, or None if absent: one state per process.
    `pause()` is True when the call runs paused (RECORDED when it runs recorded, see below);
    then the caller `resume(kind)`s it.

    The switch is process-global, and jaxlib reads it more than once inside one execute (it
    sets up a traceback "user context" when recording is on, and demands one when it is on):
    flipped by one thread while another executes, that thread fails with "a null user
    context". So it is flipped under a count: off when the first paused call starts, back on
    when the last one in flight ends, so every concurrent call of ours runs with it off from
    start to end.

    Work that makes jax objects which outlive it (compiling an executable, a sharded call that
    keeps its results' shards) needs recording on throughout: `with recording():` waits until
    no paused call is in flight. While it lasts, a new call waits for those too and runs
    recorded (pause() returns RECORDED); the switch goes off again only once every recorded
    call and block has ended, so no call of either kind runs under a flip. jax code of the user's own running in another thread could still see the
    switch flip; FX2XLA_PUBLIC_EXECUTE=1 (no pause, ~2-10 µs a call) rules that out."""
    try:
        from jax._src.lib import _jax

        enabled, set_enabled = _jax.tracebacks_enabled, _jax.set_tracebacks_enabled
    except (ImportError, AttributeError):
        return None
    lock = threading.Lock()
    count = [0, 0]  # paused calls in flight; recording blocks and recorded calls in flight
    drained = threading.Event()  # set when the last paused call ends while a block waits

    def wait_drained() -> None:
        # Paused calls in flight end in microseconds to seconds; bounded, never a hang.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with lock:
                if not count[0]:
                    return
                drained.clear()
            drained.wait(0.05)

    def pause_private():
        with lock:
            if not count[1]:
                if not count[0]:
                    if not enabled():  # the user turned recording off: leave the switch alone
                        return False
                    set_enabled(False)
                count[0] += 1
                return True
            count[1] += 1  # a block needs recording on: this call runs recorded, in its group
        wait_drained()
        return RECORDED

    def resume_private(kind=True) -> None:
        with lock:
            if kind is RECORDED:
                count[1] -= 1
                return
            count[0] -= 1
            if not count[0]:
                set_enabled(True)
                if count[1]:
                    drained.set()

    @contextlib.contextmanager
    def recording_private():
        with lock:
            count[1] += 1
        try:
            wait_drained()
            yield
        finally:
            with lock:
                count[1] -= 1

    return pause_private, resume_private, recording_private


def _public_traceback_pause():
    def pause_public() -> bool:
        return False

    def resume_public(kind=True) -> None:
        pass

    return pause_public, resume_public, contextlib.nullcontext


def make_traceback_pause(public: bool | None = None):
    """(pause, resume): `kind = pause()` ... `if kind: resume(kind)` around a call's imports
    and launch."""
    return _traceback_switch(public)[:2]


def make_recording(public: bool | None = None):
    """`with recording(): ...` around work whose jax objects outlive it (see
    _private_traceback_pause): a context manager factory."""
    return _traceback_switch(public)[2]


def _traceback_switch(public):
    private = None if use_public(public, "FX2XLA_PUBLIC_EXECUTE") else _private_traceback_pause()
    return private or _public_traceback_pause()


class _Waiter:
    """One daemon thread that waits for the result handed to it (`watch`) to be ready, then
    calls `ended()`: it ends a serving main thread's wait (make_served_launcher) without that
    thread polling. Started at the first served call."""

    def __init__(self, ended):
        import queue

        self._ended = ended
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def watch(self, array) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="fx2xla-serve-waiter", daemon=True)
                    self._thread.start()
        self._queue.put(array)

    def _run(self) -> None:
        while True:
            array = self._queue.get()
            try:
                array.block_until_ready()
            except Exception:  # noqa: BLE001  the execution's error is raised at the call, by its export
                pass
            finally:
                del array
                self._ended()


def make_served_launcher(exe, export, hooks):
    """`launch(bufs) -> list of torch.Tensor` for a call from the main thread of a CPU
    executable whose custom calls post torch work to the kernel library's server
    (fx2xla/torch_kernels.py, "Serving"): `hooks` is its (begin, serve_until_ended, ended,
    end). It launches, serves what the execution posts until the waiter thread sees its results
    ready, then hands every output back as make_launcher's does. One event makes every result
    of a CPU execution ready, so the first result stands for all."""
    begin, serve_until_ended, ended, end = hooks
    waiter = _served_waiter(ended)
    execute = exe.execute
    exports = None

    def launch_served(bufs: list) -> list:
        nonlocal exports
        begin()
        try:
            outs = execute(bufs)
            if outs:
                waiter.watch(outs[0])
                serve_until_ended()
        finally:
            end()  # work still posted is run before it returns
        if exports is None:
            exports = [export] * len(outs) if callable(export) else export
        return [e(o) for e, o in zip(exports, outs)]

    return launch_served


_waiter: list = []  # the process's one waiter: only the main thread serves
_waiter_lock = threading.Lock()


def _served_waiter(ended) -> _Waiter:
    """The process's waiter for the kernel library's server (whose `ended` this is)."""
    with _waiter_lock:
        if not _waiter:
            _waiter.append(_Waiter(ended))
        return _waiter[0]


def make_launcher(exe, export=None, public: bool | None = None):
    """`launch(bufs) -> list of torch.Tensor`: execute a single-device executable on PJRT
    buffers and hand every output back with `export` (default: `handoff.export_array`), or
    with `export[i]` for output i when it is a list (outputs that go to different devices)."""
    export = export_array if export is None else export
    private = None if use_public(public, "FX2XLA_PUBLIC_EXECUTE") else _private_launcher(exe, export)
    return private or _public_launcher(exe, export)


def make_sharded_launcher(exe, shardings, shapes, export, keep=(), lazy=None):
    """`launch(bufs) -> [torch tensors]` for an SPMD executable: `bufs` are global jax Arrays
    laid out as the executable's input shardings; each result (`shardings[i]`, a jax Sharding
    over the executable's devices, of global shape `shapes[i]`) comes back whole: a replicated
    one is its first device's copy (zero-copy), a sharded one is assembled in torch from its
    shards (each exported zero-copy, then written into place once). `export`: one function
    for every result, or one per result. `keep`: result indices also returned, after all the
    results, as global jax Arrays (their shards stay on the devices). `lazy`: result index ->
    `wrap(array, assemble)`: that result is returned as what `wrap` makes of its global jax
    Array and of a function assembling it whole (the frontend's ShardedTensor)."""
    import jax
    import torch

    devices = exe.local_devices()  # the order of every result's shards (this process's)
    plans = []
    for sharding, shape in zip(shardings, shapes):
        if sharding.is_fully_replicated:
            plans.append(None)
            continue
        index = sharding.devices_indices_map(tuple(shape))
        seen, pieces = set(), []
        for k, d in enumerate(devices):
            key = tuple((s.start, s.stop, s.step) for s in index[d])
            if key not in seen:  # a shard replicated over another axis is written once
                seen.add(key)
                pieces.append((k, index[d]))
        plans.append((tuple(shape), tuple(pieces), sharding))
    execute = exe.execute_sharded
    exports = export if isinstance(export, (list, tuple)) else [export] * len(plans)
    keep = [(r, shardings[r], tuple(shapes[r])) for r in keep]
    lazy = lazy or {}

    spans = bool(shardings) and len(devices) < len(shardings[0].device_set)  # several processes

    def assemble(shards, plan, export_one):
        shape, pieces, sharding = plan
        if spans:  # the other processes hold the other shards
            home = export_one(shards[0]).device
            return gather_array(jax.make_array_from_single_device_arrays(shape, sharding, shards), home)
        first = export_one(shards[pieces[0][0]])
        whole = torch.empty(shape, dtype=first.dtype, device=first.device)
        whole[pieces[0][1]] = first
        for k, idx in pieces[1:]:
            whole[idx] = export_one(shards[k])
        return whole

    def sharded(r, shards):
        array = jax.make_array_from_single_device_arrays(tuple(shapes[r]), shardings[r], shards)
        return lazy[r](array, lambda: assemble(shards, plans[r], exports[r]))

    def launch_sharded(bufs: list) -> list:
        per_result = execute(bufs).disassemble_into_single_device_arrays()
        outs = []
        for r, (shards, plan, export_one) in enumerate(zip(per_result, plans, exports)):
            if plan is None:
                outs.append(export_one(shards[0]))
            elif r in lazy:
                outs.append(sharded(r, shards))
            else:
                outs.append(assemble(shards, plan, export_one))
        for r, sharding, shape in keep:
            outs.append(jax.make_array_from_single_device_arrays(shape, sharding, per_result[r]))
        return outs

    return launch_sharded
