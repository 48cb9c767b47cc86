"""torch's own CPU kernels inside XLA:CPU executables, as XLA FFI custom calls.

XLA:CPU's convolutions are several times slower than the oneDNN kernels torch (and Inductor,
which calls them as extern kernels) runs on the same CPU (docs/benchmarks.md). The handlers in
`csrc/torch_kernels.cc` run torch's convolution (forward and backward) on the buffers XLA hands
them, inside the executable: the call stays one asynchronous PJRT execution, XLA still fuses
everything around the convolution, and the kernel is torch's own.

On several samples per thread of XLA's intra-op pool, the handlers cut the batch into one slice
per thread and run each slice single-threaded on XLA's own threads: called from an XLA thread,
torch's kernel would start an OpenMP team of its own there, whose workers keep spinning on the
cores XLA's next fusions need. The results are then within rounding of eager's whole-batch call
(the kernel's blocking depends on the batch), not bit for bit; `batch_slicing(False)` turns it
off, process-wide.

A convolution on a packed weight (`weight_packing`) writes its result into XLA's buffer itself
(zeroed, then added to by torch's in-place op), instead of into a tensor of torch's that the
handler then copies: `in_place_writes(False)` copies instead.

`fx2xla_torch_attention` runs torch's CPU flash-attention kernel (the one eager runs) for
inference attention of 32 query rows or more, where XLA:CPU's per-head batched dots run far
below its GEMM rate; its work is cut by batch, or by kv head, the same way, and each part's
results are the kernel's bit for bit (lowering/nn.py `_torch_attention` says when it applies).
`fx2xla_torch_matmul` runs torch's gemm (MKL's on x86) for the large float32 and float64 matmuls
of training graphs, where XLA:CPU's dots of a training step's shapes took up to 2.2x its time; its
output's columns are cut across XLA's threads (lowering/linalg.py: TORCH_MATMUL_MACS).
`fx2xla_torch_matmul_indexed` does the same for one layer's weight in a folded loop's body,
reading it in place from the stacked weights at the iteration's index, where XLA would copy
the slice out first (lowering/linalg.py: STACKED_MATMUL_MACS). `fx2xla_uninitialized` hands
XLA a buffer it leaves unfilled, for a folded loop's stacked outputs, which the loop writes
slice by slice (lowering/control_flow.py: _scan_into_buffers).

The library also holds four kernels of fx2xla's own. `fx2xla_skinny_matmul`: bf16 matmuls of one
row (decode steps at batch 1), for which XLA:CPU converts every weight to float32 on each call
and then takes a slow path (see `skinny` below). `fx2xla_few_rows_matmul`: float32 matmuls of
2-8 rows against nn.Linear's weight as torch holds it (decode steps at a small batch), which it
reads once, ahead of use, for all rows at a time (lowering/linalg.py: FEW_ROWS gives the
figures). `fx2xla_decode_attention`: float32 attention of a few query rows per kv head (decode
steps), straight from the cache, where XLA:CPU's tiny batched dots cost far more than their work
(lowering/nn.py: DECODE_ATTENTION_ROWS). `fx2xla_elementwise`: float32 elementwise regions that
write several results (an optimizer's update of a parameter and its moments) in one pass, where
XLA:CPU runs one loop per result (lowering/regions.py). The option `torch_kernels` picks which kinds of custom call lowering may use (KINDS).

The library is compiled against the torch and jaxlib in use, by the project's install step
(`make setup` runs `python -m fx2xla kernels build`), into the package's `csrc/build/`
folder, or, where that is not writable, into `$FX2XLA_CACHE_DIR/torch_kernels/`. Its file name
holds a key of the source and both versions, so a changed torch or jaxlib is never run against
a stale build. Without a build (no compiler, or never built) convolutions are XLA's own, and
`status()` says why.

FX2XLA_TORCH_KERNELS=0 turns the custom calls off; lowering reads it per graph, so graphs
compiled before a change keep what they were lowered with. A package's portable module
(fx2xla.export) never holds them, so that it loads where no build exists; beside it, a package
exported where the library runs holds an executable with them, keyed by the library's build
key, which `fx2xla.load` takes where the same build runs (and FX2XLA_TORCH_KERNELS is not 0).
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib
import torch

from .runtime.disk_cache import default_cache_dir

SOURCE = Path(__file__).resolve().parent / "csrc" / "torch_kernels.cc"
# The FFI handlers the library exports, each registered for XLA:CPU under its own name.
TARGETS = ("fx2xla_torch_convolution", "fx2xla_torch_convolution_backward", "fx2xla_torch_attention",
           "fx2xla_skinny_matmul", "fx2xla_few_rows_matmul", "fx2xla_decode_attention", "fx2xla_torch_matmul",
           "fx2xla_elementwise", "fx2xla_torch_matmul_indexed", "fx2xla_uninitialized", "fx2xla_grouped_matmul")
# torch dtypes the handlers take (the FFI element types they map to torch's).
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

# The kinds of custom call lowering may use (option torch_kernels): torch's convolutions, torch's
# flash attention (below), torch's gemm in training graphs (lowering/linalg.py), and the library's
# own skinny bf16 matmul, few-row float32 matmul (below; lowering/linalg.py), float32 decode
# attention (lowering/nn.py) and elementwise regions (lowering/regions.py); `stacked_matmul`:
# torch's gemm on one layer's weight of a folded loop, read in place from the stacked weights,
# in every graph (lowering/control_flow.py, lowering/linalg.py: _stacked_matmul); `scan_outputs`:
# a folded loop's stacked per-iteration outputs written into buffers not zero-filled first
# (lowering/control_flow.py: _scan); `grouped_matmul`: a mixture-of-experts layer's grouped
# product, each expert's rows one gemm of torch's (lowering/grouped.py).
KINDS = ("convolution", "skinny_matmul", "attention", "few_rows_matmul", "decode_attention", "matmul", "elementwise",
         "stacked_matmul", "scan_outputs", "grouped_matmul")
# Kinds only training graphs (forward, backward) lower to, whatever the option says: torch's gemm,
# which in inference graphs was slower than XLA's dots fused with their neighbours
# (lowering/linalg.py: TORCH_MATMUL_MACS).
TRAINING_ONLY = frozenset({"matmul"})
_kinds: contextvars.ContextVar = contextvars.ContextVar("fx2xla_torch_kernels_kinds", default=frozenset(KINDS))
_lock = threading.Lock()
_state: tuple[bool, str] | None = None  # once load() ran: (registered, the library's path or why not)
_lib: ctypes.CDLL | None = None  # the loaded library, once registered


def build_key() -> str:
    """What a build depends on: the source, torch's and jaxlib's versions and torch's C++ ABI."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{torch.__version__}|{jaxlib.version.__version__}|{torch.compiled_with_cxx11_abi()}".encode())
    return h.hexdigest()[:16]


def candidate_paths() -> list[Path]:
    """Where a build for this environment is looked for, in order."""
    name = f"torch_kernels-{build_key()}.so"
    paths = [SOURCE.parent / "build" / name]
    cache = default_cache_dir()  # the executable cache's folder (None: FX2XLA_CACHE_DIR is empty)
    if cache is not None:
        paths.append(Path(cache) / "torch_kernels" / name)
    return paths


def library_path() -> Path | None:
    """The built library for this environment, or None."""
    return next((p for p in candidate_paths() if p.is_file()), None)


def compiler() -> list[str]:
    """The C++ compiler command: $CXX (which may carry flags), else `c++`."""
    return shlex.split(os.environ.get("CXX", "")) or ["c++"]


def _compile_command(out: Path) -> list[str]:
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    includes = [Path(torch.__file__).resolve().parent / "include", Path(jax.ffi.include_dir())]
    abi = int(torch.compiled_with_cxx11_abi())
    return (compiler() + ["-O2", "-std=c++20", "-w", "-fPIC", "-shared", "-fopenmp",
             f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
            + [f"-I{d}" for d in includes]
            + [str(SOURCE), f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}", "-o", str(out)])


def build(force: bool = False) -> Path:
    """Compile the library for this environment (about 10 s) and return its path. Written under
    a temporary name and renamed, so processes building at once never load a partial file."""
    if not force and (found := library_path()) is not None:
        return found
    errors = []
    for target in candidate_paths():
        if _compile_to(target, _compile_command, SOURCE.name, errors):
            return target
    raise RuntimeError("fx2xla.torch_kernels: no writable folder for the library: " + "; ".join(errors))


# Region loops (lowering/regions.py): one small library per distinct loop, compiled for this CPU
# (-march=native, so the key holds the CPU's model and flags) with IEEE float32 arithmetic: no
# contraction of a product and a sum into an fma, no fast-math; -fno-math-errno lets sqrt
# vectorize. Kept beside the kernel library.
_REGION_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp-simd", "-fPIC",
                 "-shared", "-w"]
_region_loops: dict[str, Path] = {}  # source -> its library, in this process
_region_lock = threading.Lock()


def _cpu_signature() -> str:
    """What a library compiled with -march=native depends on: the machine and the CPU's model
    and flags (a cache folder shared between machines must not hand one CPU's code to another)."""
    import platform

    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part"):
                    lines.append(line.strip())
                if len(lines) >= 3:
                    break
    except OSError:
        pass
    return platform.machine() + "|" + "|".join(lines)


def region_loop(source: str) -> Path:
    """The library holding `source` (a region loop: C++ defining `fx2xla_region`), compiled now
    if no earlier process or call did (well under a second); RuntimeError names a failed
    compile."""
    with _region_lock:
        found = _region_loops.get(source)
    if found is not None:
        return found
    h = hashlib.sha256(f"{source}|{compiler()}|{_REGION_FLAGS}|{_cpu_signature()}".encode()).hexdigest()[:20]
    errors = []
    for folder in [p.parent / "regions" for p in candidate_paths()]:
        target = folder / f"region-{h}.so"
        if not target.is_file() and not _compile_to(
                target, lambda tmp: compiler() + _REGION_FLAGS + ["-x", "c++", "-", "-o", str(tmp)],
                "a region loop", errors, source):
            continue
        with _region_lock:
            _region_loops[source] = target
        return target
    raise RuntimeError("fx2xla.torch_kernels: no writable folder for region loops: " + "; ".join(errors))


def _compile_to(target: Path, command, what: str, errors: list, source: str | None = None) -> bool:
    """Run the compiler command `command(tmp)` (C++ `source` on its stdin, if given) into a
    temporary file beside `target`, renamed to it once whole: processes building at once never
    load a partial file. False, the reason added to `errors`, where the folder is not writable;
    RuntimeError names a missing compiler, or a failed compile with its command (and source)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as e:
        errors.append(f"{target.parent}: {e}")
        return False
    cmd = command(Path(tmp))
    try:
        done = subprocess.run(cmd, input=source, capture_output=True, text=True)
    except FileNotFoundError:
        os.unlink(tmp)
        raise RuntimeError(f"fx2xla.torch_kernels: no C++ compiler ({cmd[0]}); set CXX to one") from None
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"fx2xla.torch_kernels: compiling {what} failed:\n{' '.join(map(str, cmd))}\n"
                           f"{done.stderr[-4000:]}" + (f"\n{source}" if source is not None else ""))
    os.replace(tmp, target)
    return True


def disabled() -> bool:
    """FX2XLA_TORCH_KERNELS=0 (or off/false), or inside `off()`: lowering uses XLA's own kernels."""
    return not _kinds.get() or os.environ.get("FX2XLA_TORCH_KERNELS", "").strip().lower() in ("0", "off", "false", "no")


def kinds(value) -> frozenset:
    """The kinds of custom call the option `torch_kernels` allows: True = all of KINDS, False or
    None = none, a name or a list of names = those."""
    if value is True or value is False or value is None:
        return frozenset(KINDS) if value else frozenset()
    names = [value] if isinstance(value, str) else list(value)
    unknown = sorted(set(names) - set(KINDS))
    if unknown:
        raise ValueError(f"fx2xla: option torch_kernels={value!r}: unknown kind(s) {unknown}; "
                         f"expected True, False or some of {list(KINDS)}")
    return frozenset(names)


def for_graph(value, training: bool) -> frozenset:
    """The kinds lowering may use in a graph under the option `torch_kernels` = `value`: its
    `kinds`, less TRAINING_ONLY in an inference graph."""
    allowed = kinds(value)
    return allowed if training else allowed - TRAINING_ONLY


@contextlib.contextmanager
def only(allowed: frozenset):
    """Lower with only these kinds of custom call inside this block (this thread only)."""
    token = _kinds.set(frozenset(allowed))
    try:
        yield
    finally:
        _kinds.reset(token)


def off():
    """Lower with XLA's own kernels inside this block (this thread only): for modules that must
    compile where no build of the library exists, as a package's portable module."""
    return only(frozenset())


def load() -> tuple[bool, str]:
    """Register the handlers with XLA:CPU once per process: (registered, the library's path or
    why not)."""
    global _state
    if _state is not None:
        return _state
    with _lock:
        if _state is None:
            _state = _load()
    return _state


def _load() -> tuple[bool, str]:
    serve = _serve_mode(serving_setting())  # a bad setting raises before anything is registered
    path = library_path()
    if path is None:
        return False, ("not built for this torch and jaxlib: run `python -m fx2xla kernels build` "
                       "(make setup does)")
    global _lib
    try:
        lib = ctypes.CDLL(str(path))
        for name in TARGETS:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
        lib.fx2xla_torch_kernels_set_slicing.argtypes = [ctypes.c_int]
        lib.fx2xla_set_split_spin.argtypes = [ctypes.c_int]
        lib.fx2xla_split_waits.argtypes = [ctypes.POINTER(ctypes.c_int64)] * 3
        lib.fx2xla_split_waits.restype = None
        lib.fx2xla_torch_kernels_sliced_calls.restype = ctypes.c_int64
        lib.fx2xla_split_parts.argtypes = [ctypes.POINTER(ctypes.c_int64)] * 2
        lib.fx2xla_split_parts.restype = None
        lib.fx2xla_run_parked.argtypes = [_PARKED_FN, ctypes.c_void_p]
        lib.fx2xla_helped_parts.restype = ctypes.c_int64
        lib.fx2xla_helper_count.restype = ctypes.c_int64
        lib.fx2xla_help_asks.restype = ctypes.c_int64
        lib.fx2xla_help_begin.argtypes = lib.fx2xla_help_end.argtypes = []
        lib.fx2xla_help_begin.restype = lib.fx2xla_help_end.restype = None
        lib.fx2xla_torch_team_running.argtypes = []
        lib.fx2xla_torch_team_cpu_ns.restype = ctypes.c_int64
        lib.fx2xla_torch_team_cpu_ns.argtypes = []
        lib.fx2xla_parked_calls.restype = ctypes.c_int64
        lib.fx2xla_set_park_signals.argtypes = [ctypes.c_int]
        lib.fx2xla_signal_parked_calls.restype = ctypes.c_int64
        lib.fx2xla_signal_parks_taken.restype = ctypes.c_int64
        lib.fx2xla_park_signal.restype = ctypes.c_int
        lib.fx2xla_skinny_matmul_calls.restype = ctypes.c_int64
        lib.fx2xla_few_rows_matmul_calls.restype = ctypes.c_int64
        lib.fx2xla_decode_attention_calls.restype = ctypes.c_int64
        lib.fx2xla_torch_matmul_calls.restype = ctypes.c_int64
        lib.fx2xla_torch_matmul_indexed_calls.restype = ctypes.c_int64
        lib.fx2xla_grouped_matmul_calls.restype = ctypes.c_int64
        lib.fx2xla_elementwise_calls.restype = ctypes.c_int64
        lib.fx2xla_torch_attention_calls.restype = ctypes.c_int64
        lib.fx2xla_torch_kernels_hold_mkl.restype = ctypes.c_int
        lib.fx2xla_torch_kernels_pin.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.fx2xla_torch_kernels_unpin.argtypes = [ctypes.c_void_p]
        lib.fx2xla_torch_kernels_pinned.restype = ctypes.c_int64
        lib.fx2xla_torch_kernels_set_packing.argtypes = [ctypes.c_int]
        lib.fx2xla_torch_kernels_packs_made.restype = ctypes.c_int64
        lib.fx2xla_torch_kernels_packed_calls.restype = ctypes.c_int64
        lib.fx2xla_torch_kernels_written_in_place.restype = ctypes.c_int64
        lib.fx2xla_torch_kernels_set_in_place.argtypes = [ctypes.c_int]
        lib.fx2xla_serve_begin.argtypes = lib.fx2xla_serve_end.argtypes = []
        lib.fx2xla_serve_begin.restype = lib.fx2xla_serve_end.restype = None
        lib.fx2xla_serve_until_ended.argtypes = lib.fx2xla_serve_ended.argtypes = []
        lib.fx2xla_serve_until_ended.restype = lib.fx2xla_serve_ended.restype = None
        lib.fx2xla_torch_kernels_set_serving.argtypes = [ctypes.c_int]
        lib.fx2xla_served_calls.restype = ctypes.c_int64
    except (OSError, AttributeError) as e:
        return False, f"{path} did not load: {e}"
    _lib = lib
    if os.environ.get("FX2XLA_PARK_SIGNALS", "").strip().lower() in ("0", "off", "false", "no"):
        lib.fx2xla_set_park_signals(0)
    _serving[0] = serve
    lib.fx2xla_torch_kernels_set_serving(int(_serving[0] != SERVE_OFF))
    return True, str(path)


@contextlib.contextmanager
def _scoped(setter, on: bool):
    """`setter(on)` (one of the process-wide set_* below) for the block, then the previous
    setting back."""
    previous = setter(on)
    try:
        yield
    finally:
        setter(previous)


def set_batch_slicing(on: bool) -> bool:
    """Process-wide, for every executable and thread: whether the handlers cut a batch into one
    slice per intra-op thread (the default; see above). Off, each call runs torch's kernel on the
    whole batch, bit for bit as eager on channels-last tensors. Returns the previous setting
    (True where the library is not loaded: there is nothing to switch)."""
    if not load()[0]:
        return True
    return bool(_lib.fx2xla_torch_kernels_set_slicing(int(bool(on))))


# Packed convolution weights (csrc/torch_kernels.cc, "Packed weights"). An inference graph's
# executor pins the device buffer of each convolution weight it imports (InputPlan.pinned): the
# convolution handler then reorders that weight into oneDNN's blocked layout once, not on every
# call and slice. The packed copies live until the buffer is unpinned: when the weight changes and
# is imported again, and when the executor is freed.
class WeightPins:
    """One executor's pinned weights: per resident slot, the pinned buffer's address and its jax
    array, held here so that the address cannot be reused while it is pinned. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._slots: dict[int, tuple[int, object]] = {}

    def pin(self, slot: int, array) -> None:
        """Pin `array` (a jax CPU array whose bytes nothing writes) as slot `slot`'s weight, in
        place of the slot's earlier one."""
        if _lib is None:
            return
        try:
            ptr = array.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001  not a single-device buffer: nothing to pin
            return
        with self._lock:
            old = self._slots.pop(slot, None)
            if old is not None:
                _lib.fx2xla_torch_kernels_unpin(old[0])
            _lib.fx2xla_torch_kernels_pin(ptr, array.nbytes)
            self._slots[slot] = (ptr, array)

    def unpin(self, slot: int) -> None:
        with self._lock:
            old = self._slots.pop(slot, None)
            if old is not None:
                _lib.fx2xla_torch_kernels_unpin(old[0])

    def clear(self) -> None:
        with self._lock:
            for ptr, _ in self._slots.values():
                _lib.fx2xla_torch_kernels_unpin(ptr)
            self._slots.clear()


def set_weight_packing(on: bool) -> bool:
    """Process-wide: whether convolutions run on packed copies of pinned weights (the default).
    Off, every call reorders the weight, as before packing existed; results are the same bit for
    bit. Returns the previous setting (True where the library is not loaded)."""
    if not load()[0]:
        return True
    return bool(_lib.fx2xla_torch_kernels_set_packing(int(bool(on))))


def weight_packing(on: bool):
    """`set_weight_packing(on)` for the block, then the previous setting back (process-wide)."""
    return _scoped(set_weight_packing, on)


def set_in_place_writes(on: bool) -> bool:
    """Process-wide: whether convolutions on packed weights write their result straight into
    XLA's buffer (the default: zeroed, then added to by torch's in-place op) instead of into a
    tensor of torch's that the handler then copies there. Results are the same bit for bit
    (+0.0 where the copy gives -0.0). Returns the previous setting (True where the library is
    not loaded)."""
    if not load()[0]:
        return True
    return bool(_lib.fx2xla_torch_kernels_set_in_place(int(bool(on))))


def in_place_writes(on: bool):
    """`set_in_place_writes(on)` for the block, then the previous setting back (process-wide)."""
    return _scoped(set_in_place_writes, on)


def packing_counts() -> dict:
    """Process-wide counters: buffers pinned now, weights packed, convolution calls (per
    slice) that ran on a packed weight so far, and how many of those torch wrote straight into
    XLA's result buffer, with no copy (all 0 where the library is not loaded)."""
    if not load()[0]:
        return {"pinned": 0, "packs": 0, "packed_calls": 0, "written_in_place": 0}
    return {"pinned": int(_lib.fx2xla_torch_kernels_pinned()),
            "packs": int(_lib.fx2xla_torch_kernels_packs_made()),
            "packed_calls": int(_lib.fx2xla_torch_kernels_packed_calls()),
            "written_in_place": int(_lib.fx2xla_torch_kernels_written_in_place())}


# Parking torch's OpenMP workers (csrc/torch_kernels.cc says why): a long CPU executable launched
# on the main thread while a worker of its team is running (spinning after eager torch work)
# runs with that team's other members asleep until it returns: each in a signal's handler, or
# (set_park_signals(False), or where the signal cannot be used) inside a region of the team.
_PARKED_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
# An executable XLA's cost analysis puts at this many flops or bytes or more is worth the check
# (~5 µs): about 100 µs of work on one core.
PARK_MIN_FLOPS = 5e6
PARK_MIN_BYTES = 1 << 20
_parked_call: list = [None, None, None]  # (fn, args) in, (result or exception) out: main thread only


def _parked_body(_arg) -> int:
    fn, args = _parked_call[0], _parked_call[1]
    try:
        _parked_call[2] = (True, fn(*args))
    except BaseException as e:  # noqa: BLE001  re-raised by run_parked, on the caller's side
        _parked_call[2] = (False, e)
    return 0


_parked_body_c = _PARKED_FN(_parked_body)


def parking_off() -> bool:
    """FX2XLA_PARK_TORCH_THREADS=0 (or off/false): never park torch's workers."""
    return os.environ.get("FX2XLA_PARK_TORCH_THREADS", "").strip().lower() in ("0", "off", "false", "no")


def parking_on() -> bool:
    """Whether long CPU executables loaded now may park torch's workers: the library is loaded
    (FX2XLA_TORCH_KERNELS does not matter) and parking is not off."""
    return not parking_off() and load()[0]


def worth_parking(exe) -> bool:
    """Whether calls of `exe` (a CPU executable) check for torch's running workers: the library
    is loaded, parking is not off, and XLA's cost analysis puts the executable at
    PARK_MIN_FLOPS or PARK_MIN_BYTES or more, or it calls one of the library's handlers (their
    work is not in the cost analysis: an attention of 4 x 4 x 128 x 128 counts as no flops, and
    ran 1.5-3.6x slower beside spinning workers). Decided once per executable."""
    if not parking_on():
        return False
    try:
        cost = exe.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if cost.get("flops", 0.0) >= PARK_MIN_FLOPS or cost.get("bytes accessed", 0.0) >= PARK_MIN_BYTES:
            return True
    except Exception:  # noqa: BLE001  no cost analysis: the handlers decide
        pass
    return calls_handlers(exe)


def calls_handlers(exe, targets=TARGETS) -> bool:
    """Whether the optimized program of `exe` calls any of the library's handlers (of `targets`)."""
    try:
        text = "\n".join(m.to_string() for m in exe.hlo_modules())
    except Exception:  # noqa: BLE001  no HLO to read (a deserialized executable may have none)
        return False
    return any(f'custom_call_target="{t}"' in text for t in targets)


# Serving (csrc/torch_kernels.cc, "Serving"): a main-thread call of an executable that calls
# these handlers runs their work on torch's own team, whole, while its execution lasts.
SERVED_TARGETS = ("fx2xla_torch_matmul", "fx2xla_torch_convolution", "fx2xla_torch_convolution_backward",
                  "fx2xla_torch_matmul_indexed")


SERVE_OFF, SERVE_ON, SERVE_AUTO = 0, 1, 2  # _serving[0]: set_serving's setting as the executor reads it
_SERVE_NAMES = {SERVE_OFF: False, SERVE_ON: True, SERVE_AUTO: "auto"}


def _serve_mode(on) -> int:
    if isinstance(on, str):
        v = on.strip().lower()
        if v == "auto":
            return SERVE_AUTO
        if v in ("1", "on", "true", "yes"):
            return SERVE_ON
        if v in ("", "0", "off", "false", "no"):
            return SERVE_OFF
        raise ValueError(f"fx2xla: serving must be True, False or 'auto', not {on!r}")
    return SERVE_ON if on else SERVE_OFF


def serving_setting() -> bool | str:
    """FX2XLA_SERVE_TORCH_KERNELS, read when the library loads: 1 (or on/true/yes) serves every
    main-thread call of an executable that calls the handlers, `auto` times each such
    executable both ways over its first main-thread calls and keeps the faster, 0 (or unset)
    serves none. set_serving changes it later. See docs/usage.md."""
    raw = os.environ.get("FX2XLA_SERVE_TORCH_KERNELS", "")
    try:
        return _SERVE_NAMES[_serve_mode(raw)]
    except ValueError:
        raise ValueError(f"fx2xla: FX2XLA_SERVE_TORCH_KERNELS must be 0, 1 or auto, not {raw!r}") from None


def worth_serving(exe) -> bool:
    """Whether main-thread calls of `exe` (a single-device CPU executable) may serve its
    handlers' work on torch's team, while serving is on: the library is loaded, the program
    calls the matmul or a convolution handler, and jax's CPU client executes on its own threads
    (with `jax_cpu_enable_async_dispatch` False the launching thread runs the execution to its
    end, and a handler posting work to it from XLA's pool would wait forever). Decided once per
    executable."""
    from .runtime import client

    return load()[0] and client.cpu_dispatch_is_async() and calls_handlers(exe, SERVED_TARGETS)


def serve_hooks():
    """(begin, serve_until_ended, ended, end) of the library's server, for runtime.executor's
    served launcher."""
    return _lib.fx2xla_serve_begin, _lib.fx2xla_serve_until_ended, _lib.fx2xla_serve_ended, _lib.fx2xla_serve_end


_serving = [SERVE_OFF]  # set_serving's setting, read by the executor on each main-thread call


def set_serving(on) -> bool | str:
    """Process-wide: whether main-thread calls serve their handlers' work on torch's team: True
    (every such call), "auto" (each executable's first main-thread calls time it served and
    not, then it keeps the faster; plan_executor.ServeTrial) or False (off unless
    FX2XLA_SERVE_TORCH_KERNELS says otherwise). Off, the handlers run as on any other thread.
    Returns the previous setting (False where the library is not loaded: nothing serves)."""
    mode = _serve_mode(on)
    if not load()[0]:
        return False
    previous = _SERVE_NAMES[_serving[0]]
    _serving[0] = mode
    _lib.fx2xla_torch_kernels_set_serving(int(mode != SERVE_OFF))
    return previous


def serving(on):
    """set_serving(on) for a block."""
    return _scoped(set_serving, on)


def served_calls() -> int:
    """How many handler calls a serving main thread ran in this process (0 where the library is
    not loaded)."""
    return int(_lib.fx2xla_served_calls()) if load()[0] else 0


def helping_on() -> bool:
    """FX2XLA_HELPER_THREADS=1 (or on/true/yes): executables with few-row matmuls ask the
    library's helper threads for help (worth_helping). Off by default: see docs/usage.md."""
    return os.environ.get("FX2XLA_HELPER_THREADS", "").strip().lower() in ("1", "on", "true", "yes")


def worth_helping(exe) -> bool:
    """Whether calls of `exe` (a CPU executable) run with the library's helper threads polling
    for its splits (run_helped): helping is on, the library is loaded, this process may use more
    than one core, and it calls the few-row matmul, whose splits a sleeping thread of XLA's pool
    took too long to join (docs/benchmarks.md, "Helper threads for few-row splits"). Decided
    once per executable."""
    return helping_on() and helper_count() > 0 and calls_handlers(exe, ("fx2xla_few_rows_matmul",))


def torch_team_running() -> bool:
    """Whether this is the main thread and a worker of its torch OpenMP team runs right now."""
    return bool(_lib.fx2xla_torch_team_running()) if load()[0] else False


def torch_team_cpu_seconds() -> float:
    """The CPU time the other members of the main thread's torch OpenMP team have run so far
    (0.0 off the main thread, where torch is not on OpenMP or runs one thread, or where the
    library is not loaded): it stands still while a call is parked."""
    return _lib.fx2xla_torch_team_cpu_ns() / 1e9 if load()[0] else 0.0


def run_parked(fn, *args):
    """`fn(*args)` on this (the main) thread with the other members of its torch OpenMP team
    asleep until it returns; its result, or its exception raised here."""
    if not load()[0] or threading.current_thread() is not threading.main_thread():
        return fn(*args)
    _parked_call[0], _parked_call[1] = fn, args
    try:
        _lib.fx2xla_run_parked(_parked_body_c, None)
        ok, value = _parked_call[2]
    finally:
        _parked_call[:] = [None, None, None]
    if ok:
        return value
    raise value


def run_helped(fn, *args):
    """`fn(*args)` (a launch) with the library's helper threads polling for the parts of the
    split kernels it runs until it returns, instead of sleeping (csrc/torch_kernels.cc, Helping);
    its result, or its exception. From any thread."""
    if not load()[0]:
        return fn(*args)
    _lib.fx2xla_help_begin()
    try:
        return fn(*args)
    finally:
        _lib.fx2xla_help_end()


def helper_count() -> int:
    """How many helper threads a call that asks for help gets (one per usable core past the
    caller's, at most 3; 0 where the library is not loaded)."""
    return int(_lib.fx2xla_helper_count()) if load()[0] else 0


def help_asks() -> int:
    """How many executions are asking the helper threads for help now (0 where the library is
    not loaded)."""
    return int(_lib.fx2xla_help_asks()) if load()[0] else 0


def helped_parts() -> int:
    """How many parts of the library's split kernels its helper threads ran in this process (0
    where the library is not loaded)."""
    return int(_lib.fx2xla_helped_parts()) if load()[0] else 0


def parked_calls() -> int:
    """How many calls in this process ran with torch's OpenMP workers parked (0 where the
    library is not loaded)."""
    return int(_lib.fx2xla_parked_calls()) if load()[0] else 0


def set_park_signals(on: bool) -> bool:
    """Process-wide: whether run_parked parks torch's workers by signal (the default, where every
    worker of the main thread's team takes it: each sleeps in the signal's handler until the
    launch returns) or only inside a parallel region of their team (whose end waits for a
    worker's wake-up and starts its spin again; csrc/torch_kernels.cc, "Parking").
    FX2XLA_PARK_SIGNALS=0 sets it off when the library loads. Returns the previous setting (True
    where the library is not loaded: there is nothing to switch)."""
    if not load()[0]:
        return True
    return bool(_lib.fx2xla_set_park_signals(int(bool(on))))


def park_signals(on: bool):
    """`set_park_signals(on)` for the block, then the previous setting back."""
    return _scoped(set_park_signals, on)


def park_signal() -> int:
    """The real-time signal the library parks torch's workers with: the highest one whose handler
    was the default when the main thread's team was first looked for (0 before that, where none
    was free, or where the library is not loaded). A program that later installs its own handler
    for it makes parking fall back to the region."""
    return int(_lib.fx2xla_park_signal()) if load()[0] else 0


def signal_parked_calls() -> int:
    """How many of parked_calls() parked by signal (0 where the library is not loaded)."""
    return int(_lib.fx2xla_signal_parked_calls()) if load()[0] else 0


def signal_parks_taken() -> int:
    """How many times a worker entered the park signal's handler in this process (0 where the
    library is not loaded)."""
    return int(_lib.fx2xla_signal_parks_taken()) if load()[0] else 0


def sliced_calls() -> int:
    """How many handler calls in this process cut their batch into slices (0 where the library
    is not loaded)."""
    return int(_lib.fx2xla_torch_kernels_sliced_calls()) if load()[0] else 0


def split_parts() -> dict:
    """The parts of every split the handlers made in this process (`parts`: batch slices, column
    blocks), and how many of them a thread other than the handler's caller ran (`elsewhere`):
    where that stays near 0, XLA's pool joined no split and the parts ran one after another.
    Zeros where the library is not loaded."""
    if not load()[0]:
        return {"parts": 0, "elsewhere": 0}
    parts, elsewhere = ctypes.c_int64(), ctypes.c_int64()
    _lib.fx2xla_split_parts(ctypes.byref(parts), ctypes.byref(elsewhere))
    return {"parts": parts.value, "elsewhere": elsewhere.value}


def set_split_spin(on: bool) -> bool:
    """Process-wide: whether a handler that split its work into short parts (100 us or less on
    average) polls for the parts other threads still run, for up to twice a part's time, before
    it sleeps (the default; waking from the sleep cost about 40 us per split on a 2-vCPU VM, more
    than such a part). Results are the same either way. Returns the previous setting (True where
    the library is not loaded)."""
    if not load()[0]:
        return True
    return bool(_lib.fx2xla_set_split_spin(int(bool(on))))


def split_waits() -> dict:
    """Of every split the handlers made in this process: how many callers, out of parts to
    claim, waited for parts other threads still ran (`waits`), how many of those polled for them
    (`polled`: split_spin on, short parts), and how many saw them end while polling (`polled_out`,
    no sleep). Zeros where the library is not loaded."""
    if not load()[0]:
        return {"waits": 0, "polled": 0, "polled_out": 0}
    counts = [ctypes.c_int64() for _ in range(3)]
    _lib.fx2xla_split_waits(*(ctypes.byref(c) for c in counts))
    return dict(zip(("waits", "polled", "polled_out"), (c.value for c in counts)))


def split_spin(on: bool):
    """`set_split_spin(on)` for the block, then the previous setting back (process-wide)."""
    return _scoped(set_split_spin, on)


def batch_slicing(on: bool):
    """`set_batch_slicing(on)` for the block, then the previous setting back (process-wide:
    other threads' calls see it too)."""
    return _scoped(set_batch_slicing, on)


def available(kind: str = "convolution") -> bool:
    """Whether lowering for the CPU may use the library's custom calls of `kind` now (built,
    loaded, not disabled, that kind allowed)."""
    return not disabled() and kind in _kinds.get() and load()[0]


# torch's bf16 and float16 convolutions are oneDNN's, which is fast at them only where the CPU
# has instructions for that dtype (AVX512-BF16 or AMX for bf16; AVX512-FP16 or AMX-FP16 for
# float16). Elsewhere oneDNN computes them on a slow path (on an AVX2 EPYC a bf16 SmallCNN took
# 33 ms, against 6 ms with XLA's convolutions), so there the same kernels compute them widened:
# in float32, their inputs converted exactly and the result rounded once, as XLA's do, at
# oneDNN's float32 speed (an Ice Lake's bf16 ResNet 0.4x the time of either,
# docs/benchmarks.md#reduced-precision-convolutions-on-a-cpu-without-bf16).
# float32 and float64 convolutions are computed in their own dtype everywhere.
_REDUCED_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
_reduced_override: bool | None = None  # set_reduced_convolutions: None = by the CPU


def cpu_has_instructions(dtype: torch.dtype, *, ask_torch: bool = True, cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has instructions for arithmetic in `dtype` (bf16 or float16): torch's own
    checks (private, x86 only; `ask_torch`), or where they are missing, the flags Linux lists in
    `cpuinfo`. False where neither says (other CPUs: convolutions widened to float32, always
    correct)."""
    if ask_torch:
        try:
            if dtype is torch.bfloat16:
                return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())  # AVX512-FP16 or AMX-FP16
        except (AttributeError, RuntimeError):
            pass
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return any(f in flags for f in _REDUCED_FLAGS[dtype])


def set_reduced_convolutions(on: bool | None) -> bool | None:
    """Process-wide, for graphs lowered from now on: whether torch's kernels compute bf16 and
    float16 convolutions in those dtypes (True), widened to float32 (False), or as this CPU's
    instructions say (None, the default; see `convolution_dtype`). Returns the previous
    setting."""
    global _reduced_override
    previous, _reduced_override = _reduced_override, on
    return previous


def reduced_convolutions(on: bool | None):
    """`set_reduced_convolutions(on)` for the block, then the previous setting back
    (process-wide)."""
    return _scoped(set_reduced_convolutions, on)


@functools.cache
def _native_reduced() -> frozenset:
    return frozenset(d for d in _REDUCED_FLAGS if cpu_has_instructions(d))


def convolution_dtypes() -> frozenset:
    """The torch dtypes whose convolutions torch's kernels compute in that dtype inside fx2xla's
    CPU executables (where the library is available): float32 and float64, and bf16 and float16
    where this CPU has instructions for them (or as `set_reduced_convolutions` says). Other bf16
    and float16 convolutions are computed in float32 (`convolution_dtype`)."""
    reduced = (_native_reduced() if _reduced_override is None
               else frozenset(_REDUCED_FLAGS) if _reduced_override else frozenset())
    return frozenset((torch.float32, torch.float64)) | reduced


def convolution_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype torch's kernels compute a `dtype` convolution in: `dtype` itself where it is in
    `convolution_dtypes()`; float32 for other bf16 and float16 convolutions (their inputs
    converted exactly, the result rounded to `dtype` once); None for dtypes the kernels do not
    take (XLA computes those)."""
    if dtype in convolution_dtypes():
        return dtype
    return torch.float32 if dtype in _REDUCED_FLAGS else None


# Skinny bfloat16 matmuls: one row x[1, K] . W. XLA:CPU's bf16 dot of one row converts W to
# float32 in a pass of its own on every call and then takes a slow path: 6.1 ms against an 8 MiB
# (4096 x 1024) weight, against 0.60 ms for two rows (docs/benchmarks.md#skinny-bf16-matmuls).
# `fx2xla_skinny_matmul` instead reads W once, converting in registers, across XLA's intra-op
# threads for a large W: 0.66 ms there, and 0.63-0.68x XLA's time on the small weights of a decode
# step. From two rows on XLA's dot is faster, and float16 and float32 dots have no such path, so
# only one-row bf16 matmuls go to the kernel (lowering/linalg.py gives XLA two rows where the
# kernel may not run).
def skinny(rows: int) -> bool:
    """Whether a bf16 matmul of `rows` rows goes to the skinny kernel (when the library is
    available)."""
    return rows == 1


def attention_calls() -> int:
    """How many attention handler calls ran in this process (0 where the library is not
    loaded)."""
    return int(_lib.fx2xla_torch_attention_calls()) if load()[0] else 0


def holds_mkl_threads() -> bool:
    """Whether the handlers hold MKL's thread count to one on their thread, as they do
    OpenMP's: where torch's library has MKL (its BLAS on x86). After torch.set_num_threads,
    MKL would otherwise run a kernel's gemms on a team of its own started from XLA's thread,
    with other bits than eager's. False where the library is not loaded."""
    return bool(_lib.fx2xla_torch_kernels_hold_mkl()) if load()[0] else False


def skinny_calls() -> int:
    """How many skinny matmul handler calls ran in this process (0 where the library is not
    loaded)."""
    return int(_lib.fx2xla_skinny_matmul_calls()) if load()[0] else 0


def decode_attention_calls() -> int:
    """How many decode attention handler calls ran in this process (0 where the library is not
    loaded)."""
    return int(_lib.fx2xla_decode_attention_calls()) if load()[0] else 0


def matmul_calls() -> int:
    """How many torch matmul handler calls ran in this process (0 where the library is not
    loaded)."""
    return int(_lib.fx2xla_torch_matmul_calls()) if load()[0] else 0


def indexed_matmul_calls() -> int:
    """How many torch matmul handler calls on one layer's weight of a folded loop, read in place
    (`fx2xla_torch_matmul_indexed`), ran in this process (0 where the library is not loaded)."""
    return int(_lib.fx2xla_torch_matmul_indexed_calls()) if load()[0] else 0


def grouped_matmul_calls() -> int:
    """How many grouped matmul handler calls (a mixture-of-experts layer's products and their
    gradients) ran in this process (0 where the library is not loaded)."""
    return int(_lib.fx2xla_grouped_matmul_calls()) if load()[0] else 0


def elementwise_calls() -> int:
    """How many elementwise region handler calls ran in this process (0 where the library is not
    loaded)."""
    return int(_lib.fx2xla_elementwise_calls()) if load()[0] else 0


def few_rows_calls() -> int:
    """How many few-row float32 matmul handler calls ran in this process (0 where the library is
    not loaded)."""
    return int(_lib.fx2xla_few_rows_matmul_calls()) if load()[0] else 0


def status() -> str:
    """One line: whether torch's kernels run inside fx2xla's CPU executables, and if not, why."""
    if disabled():
        return "torch kernels: off (FX2XLA_TORCH_KERNELS=0)"
    ok, detail = load()
    if not ok:
        return f"torch kernels: off ({detail})"
    reduced = ", ".join(f"{str(d).removeprefix('torch.')} in {str(convolution_dtype(d)).removeprefix('torch.')}"
                        for d in _REDUCED_FLAGS)
    return f"torch kernels: on ({detail}); convolutions: {reduced}"
