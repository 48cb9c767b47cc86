"""A compiled FX graph: the per-call path (argument hand-off -> PJRT execute -> outputs).

Everything that can be decided once is decided when the graph is compiled; `__call__` does
only the hand-off, the execute and the output wrapping.
"""
from __future__ import annotations

import functools
import itertools
import os
import threading
import time
import warnings
import weakref
from typing import Any, NamedTuple

import torch

from . import dump
from . import offload as _offload
from .errors import IndexOutOfRangeError
from .lowering.graph import LoweredGraph, lower_graph, passed_spec, spmd_shardings
from .lowering.memory import with_kind
from .metrics import counters, live_graphs
from .plan import GraphPlan, build_plan, input_mutations
from .runtime import Device, compile_module
from .runtime.client import device_of
from .sharding import ShardedTensor, keep_sharded_twin, mesh_by_id, sharded_twin
from .runtime.executor import (make_launcher, make_recording, make_sharded_launcher, make_traceback_pause,
                               optimized_hlo_text)
from .runtime.handoff import aligned, make_exporter, make_importer, make_stream_order

_pause_tracebacks, _resume_tracebacks = make_traceback_pause()
_recording = make_recording()


class ResidentInput(NamedTuple):
    """A resident input's record (the call path keeps it as a plain tuple, in this order)."""
    tensor: torch.Tensor
    version: int
    data_ptr: int
    buffer: Any


class Specialization:
    """One executable and the plan to call it with (one per concrete input signature). Read by
    reports, benches and tests: `exe` (the loaded executable), `lowered` (its LoweredGraph:
    module text, outputs, input stacks), `checks` (index-check records), `direct` (the call
    returns the executable's results as they are), `concats`, `needs_seed`."""

    __slots__ = ("exe", "launch", "lowered", "out_plans", "plain_outputs", "input_outputs", "concat_outputs",
                 "mutations", "num_outputs", "checks", "raise_failed", "direct", "twins", "keeps_arrays", "concats",
                 "needs_seed")

    def __init__(self, exe, lowered: LoweredGraph, exports, sharded_outputs: bool = False):
        plan = lowered.plan
        self.exe = exe
        # Sharded graphs keep, beside each sharded output and each written input (optimizer
        # steps), the value's shards as they left the executable: a later sharded graph reading
        # that tensor unchanged takes them as they are (a backward its saved activations, a
        # forward the parameters a step just wrote) instead of splitting it again.
        # (result index, input position the result is written to, or -1 for an output)
        self.twins: tuple = ()
        self.keeps_arrays = False  # jax Arrays of this call's results outlive it (twins, ShardedTensors)
        host = _offload.host_results(plan)  # host offloading: results left in host memory
        if plan.mesh_id is None and host:
            # Their jax Arrays are kept beside their tensors (twins): the backward (or the next
            # optimizer step) takes the host buffers as they are.
            written = {r: i for i, r in plan.mutations}
            self.twins = tuple((r, written.get(r, -1)) for r in host)
            self.launch = _offload.make_host_launcher(exe, exports, keep=host)
            self.keeps_arrays = True
        elif plan.mesh_id is None:
            self.launch = make_launcher(exe, exports)  # bufs -> every result as a torch tensor
        else:  # results come back whole, from their shards
            outs, code = spmd_shardings(plan)["out_shardings"]
            shardings = outs + [code] * (len(lowered.result_shapes) - len(outs))
            written = {r: i for i, r in plan.mutations}
            lazy = _lazy_results(plan, outs) if sharded_outputs else {}
            self.twins = tuple((r, written.get(r, -1)) for r in range(len(outs))
                               if r not in lazy and (r in written or not outs[r].is_fully_replicated or r in host))
            self.launch = make_sharded_launcher(exe, shardings, lowered.result_shapes, exports,
                                                keep=[r for r, _ in self.twins], lazy=lazy)
            self.keeps_arrays = bool(self.twins or lazy)
        self.lowered = lowered
        self.concats = tuple(lowered.input_concats)  # input groups stacked in torch (scan-folding)
        self.needs_seed = lowered.needs_seed  # random ops: a fresh seed per call
        self.out_plans = lowered.outputs
        self.plain_outputs = all(p.kind == "tensor" and p.inv_perm is None and p.stride is None and not p.views
                                 for p in self.out_plans)
        # Outputs that are (views of) weights concatenated in torch: returned without a copy.
        self.concat_outputs = sorted({p.index for p in self.out_plans if p.kind == "concat"})
        # Graph inputs returned as outputs (or views of them): kept past args.clear().
        self.input_outputs = sorted({p.index for p in self.out_plans if p.kind == "input"})
        # Inputs the graph writes: (input position, result index); their results follow the
        # graph's own outputs, which are the first `num_outputs` results.
        self.mutations = tuple(plan.mutations)
        self.num_outputs = plan.num_outputs
        if self.mutations:
            self.input_outputs = sorted(set(self.input_outputs) | {i for i, _ in self.mutations})
        # Index checks: the last result is their int32 verdict (see lowering/checks.py).
        self.checks = lowered.checks
        self.raise_failed = make_check_raiser(plan.platform) if self.checks else None
        # The executable's results are the call's results as they are.
        self.direct = self.plain_outputs and not self.mutations and not self.checks and not self.twins


def compile_lowered(lower, compile, what: str):
    """(lowered, executable): `lower()`'s module compiled by `compile(module_text)`. Where XLA
    or cuDNN refuses a cuDNN fused attention that jax's checks let through (a head dim, a mask
    form, this cuDNN version), the module is lowered again with the math attention rules and
    compiled, with a warning naming `what`."""
    from .lowering.nn import CUDNN_MARKER, cudnn_attention_disabled

    lowered = lower()
    try:
        return lowered, compile(lowered.module_text)
    except Exception as e:  # noqa: BLE001
        if CUDNN_MARKER not in lowered.module_text:
            raise
        warnings.warn(f"fx2xla: {what}: cuDNN fused attention did not compile "
                      f"({str(e).splitlines()[0][:300] if str(e) else type(e).__name__}); attention runs on "
                      "the math rules instead")
    with cudnn_attention_disabled():
        lowered = lower()
    return lowered, compile(lowered.module_text)


def draw_seed(device) -> torch.Tensor:
    """A graph's per-call int64 seed, from torch's generator of `device` (so torch.manual_seed
    makes runs repeatable, and a CUDA graph draws on its GPU without a host round trip)."""
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, device=device)


def _raise_failed_now(code: torch.Tensor, records) -> None:
    failed = int(code)
    if failed:
        raise IndexOutOfRangeError(records[failed - 1].message)


def _assert_async_private(code: torch.Tensor, records) -> None:
    # Enqueued on the tensor's stream: the call stays asynchronous, and a failure surfaces at
    # the next synchronisation, like the device-side asserts of eager CUDA's index kernels.
    # torch caps the message at 254 characters: the op names; the full text is the records'.
    ops = ", ".join(dict.fromkeys(r.message.split(":")[1].strip() for r in records if r.message.count(":") > 1))
    torch._assert_async(code == 0, f"fx2xla: index out of range in {ops}"[:254])


def make_check_raiser(platform: str, public: bool | None = None):
    """`raise_failed(code, records)` for one call's index-check verdict. CPU: read it now (the
    results are ready: their export waited for them) and raise IndexOutOfRangeError naming the
    op. Accelerators: torch's private `_assert_async`, so no host sync per call; public
    fallback (`FX2XLA_PUBLIC_CHECKS=1`, or no such function): read it now, a host sync."""
    if public is None:
        public = os.environ.get("FX2XLA_PUBLIC_CHECKS", "") not in ("", "0")
    if platform == "cpu" or public or not hasattr(torch, "_assert_async"):
        return _raise_failed_now
    return _assert_async_private


def _storage_use_count_private(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1  # minus our storage object


def _storage_use_count_public(t: torch.Tensor) -> int:
    return 2  # unknown: assume shared, so the write-back copies (always correct)


def make_storage_use_count(public: bool | None = None):
    """`use_count(t)`: how many tensors hold `t`'s storage (torch's private counter; the public
    fallback answers "shared"). 1 means a write-back may swap in a new storage."""
    if public is None:
        public = os.environ.get("FX2XLA_PUBLIC_STORAGE_COUNT", "") not in ("", "0")
    if not public and hasattr(torch._C, "_storage_Use_Count"):
        return _storage_use_count_private
    return _storage_use_count_public


def _lazy_results(plan: GraphPlan, shardings) -> dict:
    """The results returned as sharding.ShardedTensor under outputs="sharded": sharded graph
    outputs that reach the caller as they are (no view, permutation or restride in torch)."""
    used = {}
    for p in plan.outputs:
        if p.kind == "tensor":
            used.setdefault(p.index, []).append(p)
    lazy = {}
    for r, ps in used.items():
        res = plan.results[r]
        if (r < plan.num_outputs and len(ps) == 1 and not ps[0].views and ps[0].inv_perm is None
                and ps[0].stride is None and res.perm is None and not shardings[r].is_fully_replicated):
            meta = res.node.meta["val"]
            lazy[r] = functools.partial(_sharded_result, plan.mesh_id, res.sharding, meta.dtype,
                                        res.device or torch.device("cpu"))
    return lazy


def _sharded_result(mesh_id, spec, dtype, device, array, assemble) -> ShardedTensor:
    return ShardedTensor(array, mesh_id, spec, dtype, device, assemble)


_storage_use_count = make_storage_use_count()
# Resident-buffer epochs: each refresh takes a new value (next() on a count is atomic, so two
# threads refreshing at once never lose an update that must invalidate cached concatenations).
_epochs = itertools.count(1)
_SWAPPABLE_TYPES = (torch.Tensor, torch.nn.Parameter)
# Resident device buffers import a tensor's memory: id(tensor) -> [(graph, resident slot)], so
# an input whose storage is swapped out drops the buffers that would keep the old memory
# (entries leave with their tensor; each use re-checks the slot still holds that tensor).
_resident_holders: dict = {}


def install_input(dst: torch.Tensor, new: torch.Tensor) -> None:
    """Write `new` (a fresh executable result) into graph input `dst`, as AOTAutograd's
    write-back would. Where `dst` alone owns a dense storage of exactly its size, `new`'s
    storage is swapped in (zero copy; `dst` stays the same tensor object, its version bumps);
    otherwise (views, shared or strided storage, subclasses) its data is copied in."""
    if (type(dst) in _SWAPPABLE_TYPES and dst.is_contiguous() and dst.storage_offset() == 0
            and dst.dtype == new.dtype and dst.shape == new.shape and dst.device == new.device
            and dst.untyped_storage().nbytes() == new.untyped_storage().nbytes()
            and _storage_use_count(dst) == 1):
        dst.set_(new)
        for ref, slot in _resident_holders.get(id(dst), ()):
            graph = ref()
            if graph is not None:
                graph._drop_resident(slot, dst)
    else:
        dst.copy_(new)


def aot_metadata():
    """AOTAutograd's metadata of the graph being compiled (private: read once per graph), or
    None outside its compile or where the private API moved."""
    try:
        from torch._guards import TracingContext

        ctx = TracingContext.try_get()
        return ctx.fw_metadata if ctx is not None and ctx.fw_metadata else None
    except (ImportError, AttributeError):
        return None


def static_input_indices(num_inputs: int) -> set[int]:
    """Inputs AOTAutograd knows to be parameters/buffers (stable across calls): their device
    buffers are kept resident. Falls back to every input when the metadata is unavailable."""
    idx = getattr(aot_metadata(), "static_input_indices", None)
    return set(range(num_inputs)) if idx is None else set(idx)


def version_bumps(num_inputs: int) -> frozenset[int]:
    """Inputs whose version AOTAutograd's wrapper bumps just before each call because the graph
    writes them (an optimizer step's parameters): a twin recorded after the previous call is
    still current at one version more. Empty when the metadata is unavailable (or counts other
    inputs than the graph's): such twins are then not recognised, never wrongly taken."""
    meta = aot_metadata()
    try:
        idx = meta.mutated_graph_handled_indices_seen_by_autograd
        if len(meta.input_info) != num_inputs:
            return frozenset()
        return frozenset(idx)
    except AttributeError:
        return frozenset()


class CompiledGraph:
    """Callable with AOTAutograd's boxed convention: `compiled(args_list) -> list of outputs`."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs, device: Device, name: str,
                 resident_inputs: set[int] | None = None, no_recompile: bool = False,
                 batch_buckets: tuple[int, ...] | None = None, check_indices: bool = True,
                 annotations=None, solution=None, sharded_outputs: bool = False, offload=None):
        """`offload`: host offloading (offload.py): (input positions, output positions) whose
        values live in host memory, or None."""
        # In the instance dict: AOTAutograd wraps backward compilers' results with
        # functools.wraps, which copies __dict__ but not class attributes.
        self._boxed_call = True
        from .lowering.graph import check_rules

        check_rules(gm)  # unsupported ops fail at compile time, not on the first call
        placement = _offload.uses_placement(gm)  # fx2xla.place_to_host / place_to_device
        if placement:
            _offload.prepare_graph(gm)
        self.gm = gm
        self.name = name
        self.no_recompile = no_recompile
        self.check_indices = check_indices
        self.sharded_outputs = sharded_outputs  # sharded outputs stay on their devices (ShardedTensor)
        self.device = device
        self.example_inputs = list(example_inputs)
        resident = resident_inputs if resident_inputs is not None else static_input_indices(len(self.example_inputs))
        self.plan = plan = build_plan(gm, self.example_inputs, device, resident, annotations, solution,
                                      None if offload is None else (*offload, _offload.HOST_KIND))
        self.device = device = plan.device  # a sharded graph runs from its mesh's first device
        self.mesh = None if plan.mesh_id is None else mesh_by_id(plan.mesh_id)
        if placement:
            _offload.require_host_memory(device, f"graph {name}'s place_to_host/place_to_device")
        # Host offloading: (bytes left in host memory, bytes taken from it) per call, for metrics().
        self.offload_per_call = _offload.offload_per_call(plan, self.example_inputs) if offload else (0, 0)
        host_inputs = any(p.memory_kind is not None for p in plan.inputs)
        self._jax_device = device.jax_device
        self._torch_device = plan.torch_device
        self._import_tensor = make_importer(platform=device.platform)
        # CUDA: jax's import stream waits once per call for the torch kernels that made the
        # inputs (see handoff.make_stream_order); inputs are made aligned before that.
        gpu_torch = plan.torch_device is not None and plan.torch_device.type == "cuda"
        self._order_in = make_stream_order(platform=device.platform) if gpu_torch else None
        self._torch_index = plan.torch_device.index if gpu_torch else None
        self._align = gpu_torch
        self._tensor_positions = [i for i, p in enumerate(plan.inputs) if p.kind != "symint"]
        self.dynamic = any(
            isinstance(v, torch.SymInt)
            or (isinstance(v, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in v.shape))
            for v in self.example_inputs
        )
        self._resident: list = [None] * len(self._tensor_positions)
        twins = self.mesh is not None or host_inputs  # inputs that may arrive as another graph's buffers
        bumps = version_bumps(len(self.example_inputs)) if twins else frozenset()
        # Per tensor input, decided once: (arg position, resident slot or -1, kind, perm, move,
        # (donated, version bump): see _moved).
        # Inputs only stacked in torch (per-layer weights of a folded scan) never reach the
        # executable: resident ones are only checked for changes, which renew the stack.
        self._import_steps = [(i, j if plan.inputs[i].resident else -1, plan.inputs[i].kind, plan.inputs[i].perm,
                               self._input_move(plan.inputs[i]),
                               (plan.inputs[i].donated, int(i in bumps)) if twins else None)
                              for j, i in enumerate(self._tensor_positions) if plan.inputs[i].passed]
        self._check_steps = [(i, j) for j, i in enumerate(self._tensor_positions)
                             if not plan.inputs[i].passed and plan.inputs[i].resident]
        self._concat_moves = [plan.inputs[group[0]].move for _, group in plan.concats]
        self._seed_move = "" if plan.torch_device is not None else "pjrt"
        if self.mesh is not None:  # stacked weights and the seed: the same on every device
            replicated = self.mesh.named_sharding(())
            self._concat_moves = [replicated] * len(plan.concats)
            self._seed_move = replicated
        # "pjrt" moves start from CPU tensors (torch has no tensors on this device): decided once.
        self._host_import = make_importer()
        self._specializations: dict = {}
        self._compile_lock = threading.Lock()
        self._concat_cache: dict = {}  # input positions -> (resident epoch, tensor, buffer)
        # Bumped whenever `_import` refreshes a resident buffer: concatenations of resident
        # inputs stay valid while it is unchanged (no per-member check on the call path).
        self._resident_epoch = 0
        self._resident_args = {i for i in self._tensor_positions if plan.inputs[i].resident}
        self.static: Specialization | None = None  # a static-shape graph's one specialization
        self._weakself = weakref.ref(self)
        counters.graphs += 1
        self.executions = 0
        self.execute_seconds = 0.0
        self._timed = os.environ.get("FX2XLA_TIME_EXECUTE", "") not in ("", "0")  # opt-in: ~0.2 µs
        live_graphs.add(self)
        # (Never for graphs that write their inputs: the write would land in a padded copy.)
        self._buckets = (BatchBuckets.find(gm, self.example_inputs, batch_buckets)
                         if self.dynamic and batch_buckets and not input_mutations(gm) else None)
        if not self.dynamic:
            self.static = self._specialize(None)

    # -- compile --------------------------------------------------------------------------
    def _specialize(self, args) -> Specialization:
        from .serving import check_compile_allowed

        if args is not None:  # a new concrete shape of a dynamic graph
            from .serving import InputSignature, signature_change

            names = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]

            def signature(key):  # a _signature() key: shapes of tensors, values of sizes
                return tuple(InputSignature(name, s, ex.dtype) if isinstance(s, tuple) else InputSignature(name, None, None)
                             for name, s, ex in zip(names, key, self.example_inputs))

            shapes = ", ".join(str(list(a.shape)) for a in args if isinstance(a, torch.Tensor))
            seen = [signature(key) for key in self._specializations]
            check_compile_allowed(f"graph {self.name} for input shapes {shapes}", self.no_recompile,
                                  signature_change(seen, signature(self._signature(args))) if seen else "")
        lower_seconds = []

        def lower():
            t0 = time.perf_counter()
            lowered = lower_graph(self.gm, self.plan, self.example_inputs, args, check_indices=self.check_indices)
            lower_seconds.append(time.perf_counter() - t0)
            return lowered

        mesh_devices = None if self.mesh is None else tuple(self.mesh.devices.flat)
        lowered, exe = compile_lowered(lower, lambda text: compile_module(text, self.device, mesh_devices=mesh_devices),
                                       f"graph {self.name}")
        counters.lower_seconds += sum(lower_seconds)
        counters.specializations += 1
        suffix = "" if args is None else "_" + "_".join("x".join(map(str, s)) for s, _ in lowered.arg_shapes)[:80]
        dump.write_graph(self.name + suffix, self.gm, lowered.module_text, lambda: optimized_hlo_text(exe))
        return Specialization(exe, lowered, result_exports(self.plan, bool(lowered.checks)), self.sharded_outputs)

    def _signature(self, args):
        return tuple(
            tuple(a.shape) if isinstance(a, torch.Tensor) else int(a) for a in args
        )

    # -- call -----------------------------------------------------------------------------
    def __call__(self, args: list):
        spec = self.static
        if spec is None:
            if self._buckets is not None:
                return self._buckets.call(self, args)
            return self._run(self._specialization_for(args), args)
        return self._run(spec, args)

    def _specialization_for(self, args) -> Specialization:
        key = self._signature(args)
        spec = self._specializations.get(key)
        if spec is None:
            with self._compile_lock:  # threads asking for one new shape compile it once
                spec = self._specializations.get(key)
                if spec is None:
                    spec = self._specializations[key] = self._specialize(list(args))
        return spec

    def _stacks(self, groups, args, bufs: list, fresh: list) -> list:
        """`torch.cat` of graph inputs (weights stacked for a folded scan), for `_import`, after
        its resident checks: a concatenation of resident inputs is rebuilt only when one of them
        changed (inference: once; training: per update); one with a non-resident member, every
        call. Cached buffers go to `bufs`; rebuilt stacks to `fresh`, imported by the caller.
        Returns (position in bufs, group, epoch it stays valid for, stack) of those rebuilt."""
        cache = self._concat_cache
        epoch = self._resident_epoch
        rebuilt = []
        for group, move in zip(groups, self._concat_moves):
            hit = cache.get(group)
            if hit is not None and hit[0] == epoch:
                bufs.append(hit[2])
                continue
            with torch.no_grad():
                stacked = torch.cat([args[i] for i in group])
            dense = stacked  # a fresh allocation: aligned
            if move == "torch":
                dense, move = stacked.to(self._torch_device, non_blocking=True), ""
            fresh.append((len(bufs), dense, move, None, -1, stacked))
            rebuilt.append((len(bufs), group, epoch if self._resident_args.issuperset(group) else -1, stacked))
            bufs.append(None)
        return rebuilt

    def _concat_outputs(self, spec) -> dict:
        """("concat", j) -> the torch tensor of concatenation j, for outputs that return it."""
        groups = spec.lowered.input_concats
        return {("concat", j): self._concat_cache[groups[j]][1] for j in spec.concat_outputs}

    def _run(self, spec: Specialization, args):
        # The hand-off's arrays need no recorded Python stack. A sharded graph's may be kept past
        # the call and read by jax later, which demands the context recording gives.
        if spec.keeps_arrays:
            with _recording():
                return self._run_paused(spec, args)
        paused = _pause_tracebacks()
        try:
            return self._run_paused(spec, args)
        finally:
            if paused:
                _resume_tracebacks(paused)

    def _run_paused(self, spec: Specialization, args):
        self.executions += 1
        bufs = self._import(args, spec.concats, spec.needs_seed)
        held = {i: args[i] for i in spec.input_outputs} if spec.input_outputs else None
        if spec.concat_outputs:
            held = {**(held or {}), **self._concat_outputs(spec)}
        if type(args) is list:
            args.clear()  # boxed convention: drop our references to the inputs early
        if self._timed:
            return self._execute_timed(spec, bufs, held)
        if spec.direct:
            return spec.launch(bufs)
        return self._finish(spec, spec.launch(bufs), held)

    def _finish(self, spec, outs, held):
        """The call's results from the executable's: index checks read (a failure raises before
        any input is written), written inputs installed, views rebuilt."""
        arrays = None
        if spec.twins:
            arrays = outs[-len(spec.twins):]
            del outs[-len(spec.twins):]
        if spec.checks:
            spec.raise_failed(outs.pop(), spec.checks)
        if spec.mutations:
            with torch.no_grad():  # a parameter's update is no autograd op
                for i, r in spec.mutations:
                    install_input(held[i], outs[r])
        if arrays is not None:
            for (r, i), array in zip(spec.twins, arrays):
                keep_sharded_twin(held[i] if i >= 0 else outs[r], array)
        if spec.mutations:
            del outs[spec.num_outputs:]
        return outs if spec.plain_outputs else self.wrap_outputs(spec, outs, held)

    def _execute_timed(self, spec, bufs, held):
        t0 = time.perf_counter()
        results = self._finish(spec, spec.launch(bufs), held)
        self.execute_seconds += time.perf_counter() - t0  # export waits for the results
        return results

    def call_unboxed(self, *args):
        """Dynamo's calling convention, for graphs that bypass AOTAutograd's wrappers."""
        spec = self.static
        if spec is None:
            return self(list(args))
        return self._run(spec, args)  # a tuple: nothing of ours to clear

    def _import(self, args, concats=(), seed: bool = False):
        """The executable's arguments for one call: every input's device buffer (resident ones
        kept while unchanged), then the stacks of `concats`, then, with `seed`, a fresh seed
        (random ops) from torch's generator of the seed's device. The torch side of them all
        (dense copies, moves, stacks, the seed: kernels queued on torch's stream) comes first,
        then one stream order (CUDA), then the imports."""
        dev = self._jax_device
        import_tensor = self._import_tensor
        resident = self._resident
        bufs = []
        # (position in bufs, tensor to import, move, twin use, resident slot or -1, input)
        fresh = []
        renewed = False  # a resident buffer is replaced: stacks of resident inputs are rebuilt
        for i, j, kind, perm, move, twin in self._import_steps:
            t = args[i]
            if j >= 0:  # a parameter/buffer: its device buffer stays resident
                r = resident[j]
                # Same tensor, unchanged since, same storage (`p.data = ...` keeps _version).
                if r is not None and r[0] is t and r[1] == t._version and r[2] == t.data_ptr():
                    bufs.append(r[3])
                    continue
                renewed = True
            dense = t if kind == "tensor" else t.permute(perm) if kind == "permuted" else t.contiguous()
            if move == "torch":  # a CPU scalar beside CUDA tensors, moved before the order below.
                # Not pinned: a copy of pageable memory returns once the bytes are staged, with
                # no device sync (CUDA's documented behaviour); pinning would allocate per call.
                dense, move = dense.to(self._torch_device, non_blocking=True), ""
            if self._align and not move:
                dense = aligned(dense)
            fresh.append((len(bufs), dense, move, twin, j, t))
            bufs.append(None)
        for i, j in self._check_steps:
            t, r = args[i], resident[j]
            if r is None or r[0] is not t or r[1] != t._version or r[2] != t.data_ptr():
                resident[j] = (t, t._version, t.data_ptr(), None)
                renewed = True
        if renewed:
            self._resident_epoch = next(_epochs)
        stacks = self._stacks(concats, args, bufs, fresh) if concats else None
        if seed:
            t = draw_seed(self.plan.seed_device)
            fresh.append((len(bufs), t, self._seed_move, None, -1, t))
            bufs.append(None)
        if fresh:
            if self._order_in is not None:  # once per call, after every torch kernel queued above
                self._order_in(dev, self._torch_index)
            for pos, dense, move, twin, j, t in fresh:
                buf = import_tensor(dense, dev) if not move else self._moved(dense, move, twin)
                if j >= 0:
                    resident[j] = (t, t._version, t.data_ptr(), buf)
                    self._hold(t, j)
                bufs[pos] = buf
        if stacks:
            for pos, group, valid, stacked in stacks:
                self._concat_cache[group] = (valid, stacked, bufs[pos])
        return bufs

    def _order(self) -> None:
        """jax's import stream waits for torch's current stream (CUDA; see _import)."""
        if self._order_in is not None:
            self._order_in(self._jax_device, self._torch_index)

    def _input_move(self, p):
        """An input's move (plan.MOVES); for a sharded graph, the jax sharding it is handed over
        with (per-device shards); for an input in host memory (offload.py), the jax sharding of
        that memory kind."""
        if self.mesh is None:
            return _offload.host_sharding(self.plan) if p.memory_kind is not None else p.move
        return with_kind(self.mesh.named_sharding(passed_spec(p.sharding, p.perm if p.kind == "permuted" else None)),
                         p.memory_kind)

    def _moved(self, t: torch.Tensor, move, twin_use=None):
        """The device buffer of `t`, which lives on another device than the executable's (see
        plan.MOVES): moved in torch, or imported on its own device and copied by PJRT; or, for
        a graph over a mesh (`move` is a jax sharding), split into per-device shards, or the
        shards a sharded graph left it as. `twin_use`: (donated, bump): whether the executable
        writes into the shards (which must then be XLA's own, never a view of `t`'s memory),
        and how far AOTAutograd moved `t`'s version since the shards were recorded."""
        if move == "torch":  # (_import moves its inputs, stacks and seed before the call's order)
            t = t.to(self._torch_device, non_blocking=True)
            self._order()
            return self._import_tensor(aligned(t) if self._align else t, self._jax_device)
        import jax

        if move != "pjrt":
            donated, bump = twin_use or (False, 0)
            if type(t) is ShardedTensor:  # another sharded graph's output, passed as it is
                if t.array.sharding == move and not donated:
                    return t.array
                t = t.full_tensor()
            twin = sharded_twin(t, bump)  # written by a sharded graph since: its shards are on the devices
            if twin is not None and twin.sharding == move and not twin.is_deleted():  # (deleted: a
                return twin  # step that donated it raised before installing)
            # _import ordered jax's stream after torch's work so far; torch work queued here
            # (a move, copies) needs one more order before its imports.
            queued = False
            if self._torch_device is None:
                t = t.cpu()
            elif t.device != self._torch_device:
                # Blocking (a host sync per call where `t` is on the host); a mesh's inputs
                # normally live on its first device already, and this is skipped.
                t, queued = t.to(self._torch_device), True
            if self.mesh is not None and self.mesh.spans_processes:  # this process's shards, each from its slice
                # Every piece cut (a donated one copied, never a view of `t`) in torch first,
                # then one order, then the imports.
                pieces = {}
                for index in move.addressable_devices_indices_map(tuple(t.shape)).values():
                    key = _index_key(index)
                    if key not in pieces:
                        part = t[index].clone() if donated else t[index].contiguous()
                        pieces[key] = aligned(part) if self._align else part
                self._order()
                return jax.make_array_from_callback(
                    tuple(t.shape), move, lambda index: self._import_tensor(pieces[_index_key(index)], self._jax_device)
                ).block_until_ready()
            if self._align:
                dense = aligned(t)
                queued = queued or dense is not t
                t = dense
            if queued:
                self._order()
            # The shards are copied from `t`'s memory asynchronously: done before torch may
            # write `t` again.
            return jax.device_put(self._import_tensor(t, self._jax_device), move,
                                  may_alias=False if donated else None).block_until_ready()

        buf = jax.device_put(self._host_import(t, device_of(t.device).jax_device), self._jax_device)
        # The copy reads `t`'s memory asynchronously: done before torch may write `t` again.
        return buf.block_until_ready()

    def _drop_resident(self, slot: int, t: torch.Tensor) -> None:
        """Forget resident slot `slot` if it still imports `t` (whose storage was swapped out):
        releases the old memory now rather than at the next call."""
        r = self._resident[slot]
        if r is not None and r[0] is t:
            self._resident[slot] = None
            self._resident_epoch = next(_epochs)

    def _hold(self, t: torch.Tensor, slot: int) -> None:
        """Record that resident slot `slot` imports `t`'s memory (see install_input)."""
        holders = _resident_holders.get(id(t))
        if holders is None:
            try:
                weakref.finalize(t, _resident_holders.pop, id(t), None)
            except TypeError:  # not weak-referenceable: nothing to drop later
                return
            holders = _resident_holders[id(t)] = []
        entry = (self._weakself, slot)
        if entry not in holders:
            holders.append(entry)

    def resident_buffers(self) -> list:
        """Per resident input slot, a ResidentInput as last imported (the device buffer is None
        for an input only checked for changes: stacked weights), or None: what a later call
        reuses while the tensor's version and data pointer are unchanged."""
        return [None if r is None else ResidentInput(*r) for r in self._resident]

    @staticmethod
    def wrap_outputs(spec: Specialization, outs, held):
        """The graph's outputs from the executable's results `outs` and the inputs it returns
        (`held`), as `spec`'s output plans say (constants, views, eager's strides)."""
        results = []
        for p in spec.out_plans:
            if p.kind == "const":
                results.append(p.value)
                continue
            if p.kind == "input" or p.kind == "concat":
                t = held[p.index] if p.kind == "input" else held[("concat", p.index)]
            else:
                t = outs[p.index]
                if p.inv_perm is not None:
                    t = t.permute(p.inv_perm)
                elif p.stride is not None:
                    t = _restride(t, p.stride)
            for op, op_args in p.views:  # views of an input or of one computed value
                t = op(t, *op_args)
            results.append(t)
        return results


def _index_key(index) -> tuple:
    """A hashable form of a shard's index (a tuple of slices; slices hash from Python 3.12 only)."""
    return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)


def result_exports(plan: GraphPlan, checks: bool) -> list:
    """Per executable result, the function that hands it to torch on the device its output
    lives on (see plan.MOVES); the index-check code, when `checks`, stays on the device."""
    platform, index = plan.device.platform, plan.device.index
    export = make_exporter(platform=platform, index=index)

    def moved(r):
        if not r.move:
            return export
        if r.move == "torch":
            home = r.device
            return lambda a: export(a).to(home)
        import jax

        own = device_of(r.device)
        own_export = make_exporter(platform=own.platform, index=own.index)
        return lambda a: own_export(jax.device_put(a, own.jax_device))

    if not any(r.move for r in plan.results):
        return export  # one exporter for every result: the launcher's fastest form
    exports = [moved(r) for r in plan.results]
    return exports + [export] if checks else exports


def _restride(t: torch.Tensor, stride) -> torch.Tensor:
    """`t` with eager's strides: broadcast (stride-0) dims become an expand of one slice, as in
    eager; gaps are laid out with empty_strided. Values are what matter; layouts torch cannot
    write into (other overlaps) keep XLA's dense layout."""
    zero = [d for d, s in enumerate(stride) if s == 0 and t.shape[d] > 1]
    if zero:
        index = tuple(slice(0, 1) if d in zero else slice(None) for d in range(t.dim()))
        return t[index].contiguous().expand(t.shape)
    try:
        return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
    except RuntimeError:
        return t


class BatchBuckets:
    """Opt-in padding of a dynamic batch dimension up to the next bucket size, so a few
    executables serve every batch size (`options={"batch_buckets": [1, 2, 4, 8, 16]}`).

    Safe only where rows never interact: each output row depends on its own input row alone
    (inference; no batch statistics, no reductions or attention across the batch). Inputs
    whose first dim is the batch size are zero-padded, outputs with that first dim sliced back.
    """

    def __init__(self, buckets, pad_positions, symint_positions, slice_outputs):
        self.buckets = buckets
        self.pad_positions = pad_positions
        self.symint_positions = symint_positions
        self.slice_outputs = slice_outputs

    @classmethod
    def find(cls, gm, example_inputs, buckets):
        batch = None
        for v in example_inputs:
            if isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], torch.SymInt):
                batch = v.shape[0].node.expr
                break
        if batch is None:
            return None
        pad = [i for i, v in enumerate(example_inputs)
               if isinstance(v, torch.Tensor) and v.dim() and isinstance(v.shape[0], torch.SymInt)
               and v.shape[0].node.expr == batch]
        syms = [i for i, v in enumerate(example_inputs) if isinstance(v, torch.SymInt) and v.node.expr == batch]
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        outs = out_node.args[0] if isinstance(out_node.args[0], (list, tuple)) else [out_node.args[0]]
        sliced = []
        for j, o in enumerate(outs):
            val = o.meta.get("val") if isinstance(o, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[0], torch.SymInt) \
                    and val.shape[0].node.expr == batch:
                sliced.append(j)
        return cls(tuple(sorted(buckets)), pad, syms, set(sliced))

    def call(self, graph: "CompiledGraph", args: list):
        n = args[self.pad_positions[0]].shape[0]
        size = next((b for b in self.buckets if b >= n), None)
        if size is None or size == n:  # beyond the largest bucket, or already a bucket size
            return graph._run(graph._specialization_for(args), args)
        padded = list(args)
        args.clear()
        for i in self.pad_positions:
            t = padded[i]
            padded[i] = torch.cat([t, t.new_zeros((size - n, *t.shape[1:]))])
        for i in self.symint_positions:
            padded[i] = size
        outs = graph._run(graph._specialization_for(padded), padded)
        return [o[:n] if j in self.slice_outputs else o for j, o in enumerate(outs)]
