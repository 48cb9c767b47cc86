"""Zero-copy tensor hand-off between torch and PJRT buffers through DLPack.

The fast paths are private jaxlib calls; each sits behind one small function here
(`_private_importer`, `_private_exporter`, and their CUDA twins), with jax's public DLPack API
as the fallback. `FX2XLA_PUBLIC_DLPACK=1` forces the public paths.

At exit, the memory of every live tensor is pinned so that no XLA thread releases torch memory
while the interpreter finalizes (`pin_torch_memory_at_exit`: see there why).

On CUDA the hand-off is stream-ordered and never blocks the host, as DLPack's stream protocol
prescribes (jax's own `from_dlpack` / `torch.from_dlpack` do the same):
- in: jax's stream for external buffers waits on torch's current stream (one event per call,
  device-side, after the torch kernels that make the call's inputs), and the buffers jax builds
  are defined on that stream, so XLA reads an input only after the torch kernels that wrote it;
- out: jax makes torch's current stream wait on the result's definition event, so torch's next
  kernels read an output only after XLA wrote it. Without a stream, jax would block the host
  until the result is ready: a host sync per executable per call.
"""
from __future__ import annotations

import atexit
import functools
import os
import threading
import time

import torch
import torch.utils.dlpack

_DLPACK_CPU = 1  # kDLCPU
_to_capsule = torch.utils.dlpack.to_dlpack  # public, and ~4 µs cheaper than Tensor.__dlpack__
_from_capsule = torch.utils.dlpack.from_dlpack


# Why the exit pins torch memory: PJRT releases an execution's inputs on the thread that ran it,
# after its results are ready, so the last holder of a tensor handed in is often one of XLA's
# threads, and releasing a torch tensor takes the GIL there (torch 2.1x keeps a tensor's Python
# object alive while C++ holds it, and lets it go under the GIL). A thread that asks for the GIL
# once the interpreter is finalizing is ended by CPython with pthread_exit, whose unwinding through
# XLA's noexcept frames calls std::terminate: "terminate called without an active exception",
# SIGABRT at exit. So before the interpreter finalizes, every live tensor gets one more C++
# reference that is never dropped: XLA's release is then never the last, and takes no GIL.
#
# And an execution may still be running when the script ends (its results never read). Were the
# interpreter to finalize and the process to exit under it, XLA's threads would run on into
# destroyed state: SIGSEGV at exit. So the hook then waits, up to FX2XLA_EXIT_WAIT_S seconds
# (default 60), until no thread but this one uses the CPU: the executions have ended. CPU time
# alone can be fooled where other processes hold the cores: an XLA thread still running an
# execution but kept off the CPU for a whole window uses none (seen once in CI, with two test
# workers on two cores: SIGSEGV at exit). On Linux the wait therefore also asks the kernel: a
# thread waiting for a core is runnable (state R in /proc), and an execution's threads are
# asleep only once it has ended.
_handed = False  # set when an importer is made: processes that never handed a tensor skip the exit work
_GIL_HANDOVER_S = 0.02  # lets an XLA thread already releasing a tensor (waiting for the GIL) finish
_QUIET_WINDOW_S = 0.02  # other threads quiet when they used under a tenth of a core for this long


def _exit_wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get("FX2XLA_EXIT_WAIT_S", "60")))
    except ValueError:
        return 60.0


def runnable_threads() -> int | None:
    """How many threads of this process other than the calling one are running or waiting for a
    core right now (state R in /proc/self/task), or None where that cannot be read (not Linux)."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        end = stat.rfind(b")")  # the state follows the command name, which may hold spaces
        count += stat[end + 2:end + 3] == b"R"
    return count


def wait_for_other_threads(limit_s: float) -> bool:
    """Waits until the threads of this process other than the calling one have used less than a
    tenth of a core over a short window (an XLA execution still running keeps them busy; torch's
    OpenMP workers stop spinning within milliseconds) and, where /proc tells, none of them is
    running or waiting for a core; or until `limit_s` passed. True if they did."""
    deadline = time.monotonic() + limit_s
    others = time.process_time() - time.thread_time()
    while True:
        time.sleep(_QUIET_WINDOW_S)
        now = time.process_time() - time.thread_time()
        if now - others < _QUIET_WINDOW_S / 10 and not runnable_threads():
            return True
        if time.monotonic() >= deadline:
            return False
        others = now


def pin_torch_memory_at_exit() -> None:
    """The exit hook (registered with atexit): gives every live tensor a C++ reference that is
    never dropped, and waits for executions still running, once this process handed a tensor to
    PJRT; nothing before (see above why)."""
    if not _handed:
        return
    import ctypes
    import gc

    pins = []
    # Plain tensors and parameters only: what the importers hand in (subclasses such as fake
    # tensors have no memory to pin). type(), not isinstance: isinstance reads __class__, which
    # some deprecated objects warn on.
    kinds = (torch.Tensor, torch.nn.Parameter)
    for obj in gc.get_objects():
        if type(obj) in kinds and obj.layout == torch.strided and obj.device.type != "meta":
            try:
                pins.append(_to_capsule(obj))  # a C++ reference held by an unconsumed capsule
            except (RuntimeError, BufferError, TypeError):  # a kind DLPack cannot carry: never handed in
                pass
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pins))  # kept past the interpreter's end, on purpose
    time.sleep(_GIL_HANDOVER_S)
    wait_for_other_threads(_exit_wait_s())


import jax  # noqa: E402  (before the exit hook: atexit runs the last registered first)

atexit.register(pin_torch_memory_at_exit)


def _private_importer():
    """jaxlib's direct DLPack import (~5 µs; keeps int64 with x64 off), or None if absent."""
    try:
        from jax._src.lib import _jax

        fn = _jax.dlpack_managed_tensor_to_buffer
    except (ImportError, AttributeError):
        return None

    def import_private(t: torch.Tensor, device):
        return fn(_to_capsule(t), device, None, None, None)

    return import_private


def _public_importer():
    import jax
    import jax.dlpack

    def import_public(t: torch.Tensor, device):
        # x64 scoped to this call so int64 stays int64 without touching the global flag.
        with jax.enable_x64(True):
            return jax.device_put(jax.dlpack.from_dlpack(t), device)

    return import_public


def _private_exporter():
    """jaxlib's direct buffer -> DLPack capsule (skips ~5 µs of Python in `Array.__dlpack__`)."""
    try:
        from jax._src.lib import _jax

        fn = _jax.buffer_to_dlpack_managed_tensor
    except (ImportError, AttributeError):
        return None

    # torch's C entry point skips from_dlpack's Python checks (~0.7 µs); public one if absent.
    from_capsule = getattr(torch._C, "_from_dlpack", _from_capsule)

    def export_private(a) -> torch.Tensor:
        return from_capsule(fn(a, None))

    return export_private


def _public_exporter():
    def export_public(a) -> torch.Tensor:
        return _from_capsule(a.__dlpack__())

    return export_public


def _torch_stream_private(index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(index)


def _torch_stream_public(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


def make_torch_stream(public: bool | None = None):
    """`stream(index) -> int`: the handle of torch's current CUDA stream on device `index`
    (torch's private raw getter, ~0.2 µs; public fallback `torch.cuda.current_stream`)."""
    if not use_public(public) and hasattr(torch._C, "_cuda_getCurrentRawStream"):
        return _torch_stream_private
    return _torch_stream_public


def _dlpack_stream(handle: int) -> int:
    # DLPack spells CUDA's legacy default stream 1 (0 means "no stream" to some consumers).
    return handle or 1


_ALIGNMENT = 16  # XLA GPU kernels assume entry parameters aligned to 16 bytes (kEntryParameterAlignBytes)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it where its memory is not aligned as XLA's GPU kernels assume (a view
    with a storage offset, e.g. `ids[:, -1:]`). jaxlib copies misaligned buffers on the CPU only."""
    return t.clone() if t.data_ptr() % _ALIGNMENT else t


_ready_streams: dict = {}


def _ready_stream(jax_device) -> int | None:
    """jax's stream on `jax_device` that an imported buffer is defined on (once per device).
    PJRT takes only its own streams here (a foreign stream handle crashes the import)."""
    key = id(jax_device)
    if key not in _ready_streams:
        try:
            _ready_streams[key] = jax_device.get_stream_for_external_ready_events()
        except Exception as e:  # noqa: BLE001  a platform without external streams
            if "UNIMPLEMENTED" not in str(e):
                raise
            _ready_streams[key] = None
    return _ready_streams[key]


def _private_cuda_importer():
    """jaxlib's direct DLPack import, with no per-tensor stream work: each buffer is defined on
    jax's external-ready stream, which the caller made wait on torch's current stream once per
    call, after queuing every torch kernel that produces the call's inputs (`make_stream_order`).
    `to_dlpack` (unlike `Tensor.__dlpack__`) exports tensors that require grad: parameters
    reach the hand-off as they are."""
    try:
        from jax._src.lib import _jax

        fn = _jax.dlpack_managed_tensor_to_buffer
    except (ImportError, AttributeError):
        return None

    def import_cuda_private(t: torch.Tensor, device):
        return fn(_to_capsule(t), device, _ready_stream(device), None, None)

    return import_cuda_private


def _public_cuda_importer():
    import jax
    import jax.dlpack

    def import_cuda_public(t: torch.Tensor, device):
        # detach: Tensor.__dlpack__ refuses tensors that require grad (parameters). The device
        # scope: __dlpack__ orders torch's current stream of the current device, which must be
        # t's (cuda:1 while cuda:0 is current); a no-op for a CPU tensor (index -1).
        with jax.enable_x64(True), torch.cuda.device(t.get_device()):
            a = jax.dlpack.from_dlpack(aligned(t.detach()))  # orders torch's stream itself, per tensor
        return a if a.devices() == {device} else jax.device_put(a, device)

    return import_cuda_public


_external_streams: dict = {}  # id(jax device) -> torch's handle on jax's external-ready stream


class _ThreadEvents(threading.local):
    """Per thread (torch's current stream is per thread: a shared event re-recorded by another
    thread on its stream would let this thread's wait pass early): id(jax device) -> Event."""

    def __init__(self):
        self.events = {}


_order_events = _ThreadEvents()


def _order_after_torch(jax_device, index: int) -> None:
    """Make jax's external-ready stream on `jax_device` wait (device-side) for everything queued
    so far on torch's current stream of device `index`: one CUDA event, made once per device
    and thread and recorded again per call (`wait_stream` would make a new one per call). A
    wait takes the event as last recorded when it is queued, so re-recording is safe."""
    key = id(jax_device)
    ext = _external_streams.get(key)
    if ext is None:
        ext = _external_streams[key] = torch.cuda.ExternalStream(_ready_stream(jax_device),
                                                                device=torch.device("cuda", index))
    events = _order_events.events
    event = events.get(key)
    if event is None:
        event = events[key] = torch.cuda.Event()
    event.record(torch.cuda.current_stream(index))
    ext.wait_event(event)


def reset_stream_order() -> None:
    """Forgets the CUDA stream state kept per device for the hand-off (jax's external-ready
    stream handles, torch's ExternalStream on each, every thread's events), made again at next
    use: for devices that are gone (the tables are keyed by id) or were faked."""
    global _order_events
    _ready_streams.clear()
    _external_streams.clear()
    _order_events = _ThreadEvents()


def make_stream_order(public: bool | None = None, platform: str = "cpu"):
    """`order(jax_device, index)`, to call once per call between queuing the torch work that
    makes its inputs and importing them, where the importer needs it (the private CUDA one);
    None otherwise (the CPU; the public importer orders each tensor itself)."""
    if not _gpu(platform) or use_public(public) or _private_cuda_importer() is None:
        return None
    return _order_after_torch


def _jax_dlpack_export():
    """jaxlib's direct export of a buffer to a DLPack capsule (`fn(array, stream=...)`: the
    stream waits for the buffer), or None if this jaxlib lacks it."""
    try:
        from jax._src.lib import _jax

        return _jax.buffer_to_dlpack_managed_tensor
    except (ImportError, AttributeError):
        return None


def _private_cuda_exporter(index: int):
    fn = _jax_dlpack_export()
    if fn is None:
        return None
    from_capsule = getattr(torch._C, "_from_dlpack", _from_capsule)
    stream = make_torch_stream()

    def export_cuda_private(a) -> torch.Tensor:
        # torch's current stream waits (device-side) for the result: no host sync.
        return from_capsule(fn(a, stream=_dlpack_stream(stream(index))))

    return export_cuda_private


def _public_cuda_exporter(index: int):
    def export_cuda_public(a) -> torch.Tensor:
        return torch.from_dlpack(a)  # passes torch's current stream to jax's __dlpack__

    return export_cuda_public


def _private_cuda_stream_wait(index: int):
    fn = _jax_dlpack_export()
    if fn is None:
        return None
    stream = make_torch_stream()

    def wait_cuda_private(a) -> None:
        # The export queues the wait as it is made; the capsule, never consumed, is dropped
        # at once, and with it the external reference (which would bar donating `a`).
        fn(a, stream=_dlpack_stream(stream(index)))

    return wait_cuda_private


def _public_cuda_stream_wait(index: int):
    def wait_cuda_public(a) -> None:
        torch.from_dlpack(a)  # the export orders torch's current stream; the tensor is dropped

    return wait_cuda_public


def make_stream_wait(public: bool | None = None, index: int = 0):
    """`wait(a)`: torch's current stream on CUDA device `index` waits (device-side, no host
    sync) until jax Array `a` is computed, and so for the whole execution that made it: for
    results torch reads through views it already holds (runtime/inplace.py), not exports."""
    private = None if use_public(public) else _private_cuda_stream_wait(index)
    return private or _public_cuda_stream_wait(index)


def use_public(public: bool | None, switch: str = "FX2XLA_PUBLIC_DLPACK") -> bool:
    if public is None:
        return os.environ.get(switch, "") not in ("", "0")
    return public


def _gpu(platform: str) -> bool:
    return platform in ("cuda", "rocm")


def make_importer(public: bool | None = None, platform: str = "cpu"):
    """`import_tensor(t, jax_device) -> jax.Array`, sharing memory with `t` where possible
    (a copy when `t` is not 64-byte aligned). `t` must be dense and row-major, and live on
    `jax_device` (a CPU tensor given to a GPU device would hand XLA a host pointer as a device
    buffer): callers make it so with a plan decided once per graph, not per call. `platform`:
    that of the devices it will import to ("cuda"/"rocm": stream-ordered)."""
    global _handed
    _handed = True
    if _gpu(platform):
        private = None if use_public(public) else _private_cuda_importer()
        return private or _public_cuda_importer()
    private = None if use_public(public) else _private_importer()
    return private or _public_importer()


def make_exporter(public: bool | None = None, platform: str = "cpu", index: int = 0):
    """`export_array(a) -> torch.Tensor` sharing the PJRT buffer's memory. CPU: it waits for a
    result that is still being computed. CUDA (device `index`): torch's current stream waits
    for it instead, and the host goes on."""
    if _gpu(platform):
        private = None if use_public(public) else _private_cuda_exporter(index)
        return private or _public_cuda_exporter(index)
    private = None if use_public(public) else _private_exporter()
    return private or _public_exporter()


_cpu_importer = None


def import_tensor(t: torch.Tensor, jax_device):
    """`make_importer()`'s importer for the CPU, made at first use."""
    global _cpu_importer
    if _cpu_importer is None:
        _cpu_importer = make_importer()
    return _cpu_importer(t, jax_device)


export_array = make_exporter()


def gather_array(array, device) -> torch.Tensor:
    """The whole value of a global jax Array whose shards live in several processes (each holds
    its own devices'), as a torch tensor on `device`: a collective every process must take part
    in, in the same order."""
    return numpy_to_torch(gather_whole(array)).to(device)


# ml_dtypes' types that torch.from_numpy refuses, by name: torch's dtype of the same bits.
_VIEWED_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def numpy_to_torch(a) -> torch.Tensor:
    """A copy of numpy array `a` as a CPU torch tensor, bf16 and float8 included (torch.from_numpy
    refuses ml_dtypes' types: their bits go over as unsigned integers of the same width)."""
    import numpy as np

    a = np.asarray(a)
    viewed = _VIEWED_DTYPES.get(a.dtype.name)
    if viewed is not None:
        return torch.from_numpy(a.view(np.dtype(f"uint{8 * a.dtype.itemsize}")).copy()).view(viewed)
    return torch.from_numpy(np.array(a, copy=True))


def gather_whole(array):
    """A global jax Array's whole value as a numpy array, by an all-gather over its devices that
    has finished on every local device when this returns.

    jax's `multihost_utils.process_allgather` reads the first local device's copy and leaves the
    others' gathers running: a process could then reach its exit and tear down the coordination
    service its peers' gloo still connects through, leaving a peer hung at exit in a gather
    nobody joins. It stays the fallback for shardings without a mesh (fx2xla's are NamedShardings)."""
    import jax
    import numpy as np

    sharding = array.sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(array, tiled=True)
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(),
                                            memory_kind=sharding.memory_kind)
    out = _replicator(replicated)(array)
    out.block_until_ready()  # every local device's copy, so no gather outlives this call
    return np.asarray(out.addressable_data(0))


@functools.lru_cache(maxsize=64)
def _replicator(replicated):
    """One jitted identity per target sharding: a gather of every call's sharded output reuses
    it rather than wrapping a new function each time."""
    import jax

    return jax.jit(_identity, out_shardings=replicated)


def _identity(x):
    return x
