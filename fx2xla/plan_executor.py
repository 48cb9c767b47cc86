"""The per-call path of a plan: hand every input off, launch, assemble every output.

`CompiledGraph` (a graph torch.compile gave us) and `LoadedModel` (a package) both run their
plans through one `PlanExecutor`. Everything that can be decided once per plan is decided in its
constructor (the import steps, resident slots, moves, twins); everything per executable (its
launcher, output assembly, index checks) in a `Specialization`. A call then reads: for each
import step, hand the tensor off (or reuse its resident buffer); launch; read the index checks;
install written inputs; for each output plan, assemble.

Inputs handed over through a jax sharding (a mesh's shards, host memory) go through
`sharded_call.PlacedHandOff`, and sharded results through `sharded_call.placed_launch`: the
one-device path below never branches on a mesh.
"""
from __future__ import annotations

import functools
import itertools
import os
import threading
import time
import weakref
from typing import Any, NamedTuple

import torch

from . import sharded_call, torch_kernels
from .errors import IndexOutOfRangeError, InvalidValueError, LinAlgError
from .lowering.checks import INDEX, LINALG, VALUE
from .metrics import counters
from .plan import NOT_TENSORS, GraphPlan, InputKind, Move, OutputKind, OutputPlan, orders_after_torch
from .runtime.client import device_of
from .runtime.executor import make_launcher, make_recording, make_served_launcher, make_traceback_pause
from .runtime import host_memory
from .runtime import inplace as _inplace
from .runtime import twins as _twins
from .runtime.handoff import aligned, make_exporter, make_importer, make_stream_order, make_stream_wait

_pause_tracebacks, _resume_tracebacks = make_traceback_pause()
_twin_of, _twins_waiting = _twins.twin, _twins.waiting
_get_ident, _MAIN_THREAD = threading.get_ident, threading.main_thread().ident
_serving, _SERVE_ON = torch_kernels._serving, torch_kernels.SERVE_ON
_team_running, _run_parked, _run_helped = (torch_kernels.torch_team_running, torch_kernels.run_parked,
                                           torch_kernels.run_helped)
_recording = make_recording()
# The kinds the call path tests, as module globals: reading an enum member through its class
# costs ~60 ns on Python 3.11, a global ~8 ns, and a call tests several per input.
_TENSOR, _PERMUTED, _RELAID, _WIDENED, _RESOLVED, _SCALAR = (InputKind.TENSOR, InputKind.PERMUTED, InputKind.RELAID,
                                                      InputKind.WIDENED, InputKind.RESOLVED, InputKind.SCALAR)
_NO_MOVE, _TORCH_MOVE, _PLACED = Move.NONE, Move.TORCH, Move.PLACED
_CONST, _INPUT, _CONCAT = OutputKind.CONST, OutputKind.INPUT, OutputKind.CONCAT
_TENSOR_OUT = OutputKind.TENSOR
GPU_PLATFORMS = ("cuda", "rocm")  # whose results' arrays wait for torch's stream (runtime/twins.py)

# CPU inputs of up to this many bytes that arrive afresh on every call are copied into buffers
# XLA holds instead of imported (PlanExecutor._import).
STAGE_MAX_BYTES = 128 * 1024


def staging_on() -> bool:
    """Whether CPU executors stage small fresh inputs (read when a graph is compiled);
    FX2XLA_STAGE_INPUTS=0 imports every input instead."""
    return os.environ.get("FX2XLA_STAGE_INPUTS", "1") != "0"


class TwinUse(NamedTuple):
    """How an input handed over through a jax sharding may take the shards another graph left
    it as (sharded_call.PlacedHandOff)."""

    donated: bool  # the executable writes into the shards: they must be XLA's own
    bump: int  # how far AOTAutograd moves the input's version before each call


class ImportStep(NamedTuple):
    """How one graph input reaches the executable on every call. A tuple, unpacked once per
    input per call."""

    position: int  # the input's position in the call's arguments
    slot: int  # its resident slot (a parameter/buffer whose device buffer is kept), or -1
    kind: InputKind
    perm: tuple[int, ...] | None  # InputKind.PERMUTED: passed as `t.permute(perm)`; RELAID: a copy in that order
    move: Move
    placement: Any  # Move.PLACED: the jax sharding it is handed over with, else None
    twin: TwinUse | None  # Move.PLACED: see TwinUse


class ResidentInput(NamedTuple):
    """A resident input as last imported: reused while the same tensor object keeps its version
    and data pointer (`p.data = ...` keeps the version)."""

    tensor: torch.Tensor
    version: int
    data_ptr: int
    buffer: Any  # its device buffer; None for an input only checked for changes (stacked weights)


class Twin(NamedTuple):
    """A result whose jax Array is kept beside the torch tensor it became (sharded_call)."""

    result: int
    written_input: int  # the input position the result is written to, or -1 for an output


class Specialization:
    """One executable and how to call it (one per concrete input signature). Read by reports,
    benches and tests: `exe` (the loaded executable), `lowered` (its LoweredGraph: module text,
    outputs, input shapes; None for a package's), `checks` (index-check records), `direct` (the
    call returns the executable's results as they are)."""

    __slots__ = ("exe", "launch", "lowered", "out_plans", "plain_outputs", "input_outputs", "concat_outputs",
                 "mutations", "num_outputs", "checks", "raise_failed", "direct", "twins", "kept", "keeps_arrays",
                 "park", "parked_wait", "helped", "served", "serve_trial", "in_place", "twinned_in_place", "wait_for_writes", "stages")

    def __init__(self, exe, plan: GraphPlan, outputs: list[OutputPlan], checks: tuple, result_shapes, *,
                 lowered=None, sharded_outputs: bool = False, training: bool = False):
        """`training`: the plan is a forward's or a backward's, whose returned results the next
        graph reads (twin_results)."""
        self.exe = exe
        self.lowered = lowered
        exports = result_exports(plan, bool(checks))
        self.twins: tuple[Twin, ...] = ()
        self.kept = ()  # results whose jax Arrays are kept as their tensors' twins (runtime/twins.py)
        self.keeps_arrays = False  # jax Arrays of this call's results outlive it (twins, ShardedTensors)
        # Written inputs the executable writes in place (runtime/inplace.py): their results
        # leave it as jax Arrays, installed by _finish.
        self.in_place: tuple[tuple[int, int], ...] = ()
        placed = sharded_call.placed_launch(exe, plan, result_shapes, exports, sharded_outputs)
        if placed is None:
            self.in_place = tuple(m for m in plan.mutations if plan.inputs[m.input].donated)
            self.kept = (twin_results(plan, outputs, bool(checks), training or _twins.inference_outputs_kept())
                         if _twins.enabled() else ())
            if self.kept or self.in_place:
                exports = keeping_exports(plan, exports, self.kept, bool(checks), {r for _, r in self.in_place})
            self.launch = make_launcher(exe, exports)  # bufs -> every result as a torch tensor
            # CPU: a call from the main thread serves the torch work the handlers post, on torch's
            # own team (torch_kernels, "Serving"); from any other thread it runs as launched.
            self.served = (make_served_launcher(exe, exports, torch_kernels.serve_hooks())
                           if plan.platform == "cpu" and torch_kernels.worth_serving(exe) else None)
        else:
            self.launch, twins, self.keeps_arrays = placed
            self.twins = tuple(Twin(r, i) for r, i in twins)
            self.served = None
        # set_serving("auto"): this executable's first main-thread calls time it both ways.
        self.serve_trial = ServeTrial() if self.served is not None else None
        self.out_plans = outputs
        # (Output i is result i: one result returned twice, a value and its view, are not plain.)
        self.plain_outputs = all(p.kind is OutputKind.TENSOR and p.index == i and p.inv_perm is None
                                 and p.stride is None and not p.views for i, p in enumerate(outputs))
        # Outputs that are (views of) weights concatenated in torch: returned without a copy.
        self.concat_outputs = sorted({p.index for p in outputs if p.kind is OutputKind.CONCAT})
        # Graph inputs returned as outputs (or views of them), and inputs the graph writes:
        # kept past the boxed convention's args.clear().
        self.mutations = tuple(m for m in plan.mutations if m not in self.in_place)
        self.input_outputs = sorted({p.index for p in outputs if p.kind is OutputKind.INPUT}
                                    | {m.input for m in plan.mutations})
        self.num_outputs = plan.num_outputs  # the written inputs' results follow these
        self.twinned_in_place = _twins.enabled()  # in-place results are recorded as twins (by _finish)
        # CUDA: torch's stream waits for the execution through any result exported to it; where
        # every result stays XLA's (written in place), through one of them (runtime/inplace.py).
        gpu = plan.device.platform in GPU_PLATFORMS
        self.wait_for_writes = (gpu and bool(self.in_place)
                                and len(self.in_place) == len(plan.results) and not checks)
        # Index checks: the last result is their int32 verdict (see lowering/checks.py).
        self.checks = checks
        self.raise_failed = make_check_raiser(plan.platform) if checks else None
        self.direct = self.plain_outputs and not plan.mutations and not checks and not self.twins
        # A call that exports at least one result (the index checks' verdict counts) returns only
        # once it is exported, which on the CPU waits for the result, and so for the whole
        # execution: XLA:CPU's client defines every result of one execution by the same event.
        # Its staged inputs (PlanExecutor._import, CPU only) may be reused after it. Results
        # written in place leave as jax Arrays, unexported: a call with only those does not
        # stage; neither does a sharded call (its results may stay jax Arrays).
        self.stages = placed is None and (bool(checks) or len(self.in_place) < len(plan.results))
        # CPU: a long executable launched while torch's OpenMP workers spin runs with them parked
        # (torch_kernels.run_parked); decided here from XLA's cost analysis.
        self.park = plan.platform == "cpu" and torch_kernels.worth_parking(exe)
        # CPU: glibc's malloc keeps the memory of XLA's freed buffers for the next call's instead
        # of returning it and faulting fresh pages in (runtime/host_memory.py); once per process.
        if plan.platform == "cpu":
            host_memory.tune()
        # CPU, few-row matmuls: the library's helper threads poll for their splits' parts while a
        # call runs (torch_kernels.run_helped), as it is launched from any thread.
        self.helped = plan.platform == "cpu" and torch_kernels.worth_helping(exe)
        # Parked workers stay parked until the execution ends, not only through its launch:
        # released early, they spin beside it (right after eager work, an MLP's AdamW step took
        # 9.3-10.2 ms parked through its launch, 7.3-7.7 ms parked to its end; docs/
        # benchmarks.md, "Parked until the execution ends"). A call that exports a result returns
        # only after the execution; one whose every result is written in place (an optimizer
        # step) exports none, and its parked call waits for `parked_wait`'s result (XLA:CPU's
        # client makes every result of one execution ready by the same event). None: no wait.
        self.parked_wait = (self.in_place[0][1] if self.park and placed is None and not self.stages and self.in_place
                            else None)


class ServeTrial:
    """set_serving("auto") for one executable that may serve (Specialization.served): its first
    main-thread calls alternate between serving and not, one untimed call each, then
    SERVE_TRIAL_ROUNDS timed calls each, from launch until every result is ready; from then on
    every main-thread call goes the way whose fastest call was faster (`choice`). Serving wins
    where the handlers' work dominates the execution (an MLP's training step) and loses where
    many products, each run whole on the main thread, would otherwise run beside XLA's own loops
    (a GPT-2's; docs/benchmarks.md, "Serving chosen per executable"). Only the main thread
    calls it, so it needs no lock."""

    __slots__ = ("calls", "seconds", "choice")

    def __init__(self):
        self.calls = 0
        self.seconds: tuple[list[float], list[float]] = ([], [])  # (not served, served)
        self.choice: bool | None = None  # None while timing

    def launch(self, spec: Specialization, bufs):
        choice = self.choice
        if choice is not None:
            return spec.served(bufs) if choice else PlanExecutor._launch_unserved(spec, bufs)
        served = self.calls % 2 == 1
        self.calls += 1
        t0 = time.perf_counter()
        if served:
            outs = spec.served(bufs)  # returns once the execution has ended
        else:
            outs = PlanExecutor._launch_unserved(spec, bufs)
            for o in outs:  # a result written in place leaves unexported: wait for it here
                if type(o) is not torch.Tensor:
                    o.block_until_ready()
                    break
        elapsed = time.perf_counter() - t0
        if self.calls > 2:  # each way's first call is not timed
            times = self.seconds[served]
            times.append(elapsed)
            if len(times) >= SERVE_TRIAL_ROUNDS and served:
                self.choice = min(self.seconds[1]) < min(self.seconds[0])
                if self.choice:
                    counters.serving_chosen += 1
                else:
                    counters.serving_declined += 1
        return outs


SERVE_TRIAL_ROUNDS = 3


class PlanExecutor:
    """Runs one plan's executables."""

    def __init__(self, plan: GraphPlan):
        self.plan = plan
        device = plan.device
        self.jax_device = device.jax_device
        self._torch_device = plan.torch_device
        # The hand-off's functions (public: tests watch them): DLPack import, the stream order,
        # and whether inputs are made 16-byte aligned first.
        self.import_tensor = make_importer(platform=device.platform)
        self._host_import = make_importer()  # Move.PJRT starts from CPU tensors: decided once
        # CUDA: jax's import stream waits once per call for the torch kernels that made the
        # inputs (see handoff.make_stream_order); inputs are made aligned before that.
        gpu_torch = plan.torch_device is not None and plan.torch_device.type == "cuda"
        self.stream_order = make_stream_order(platform=device.platform) if gpu_torch else None
        self._torch_index = plan.torch_device.index if gpu_torch else None
        self.align = gpu_torch
        # GPU: arrays of dropped results wait for torch's stream before they are released
        # (runtime/twins.py): claimed by a call that imports (ordered), else fenced (public:
        # tests stand in for it).
        self.fence = (functools.partial(_twins.fence, functools.partial(_twins.torch_stream_event, self._torch_index))
                       if gpu_torch and _twins.enabled() else None)
        # CUDA, written inputs in place (runtime/inplace.py): each call is ordered after torch's
        # stream by importing `_order_step`'s input (plan.orders_after_torch) when it imports
        # nothing else; torch's stream waits for the execution through `stream_wait`; a donated
        # input is taken as its twin only where no export references the twin's array.
        self.writes_in_place = any(p.donated for p in plan.inputs) and plan.mesh_id is None
        self._cuda_writes = self.writes_in_place and device.platform in GPU_PLATFORMS
        self.stream_wait = make_stream_wait(index=self._torch_index) if self._cuda_writes else None
        # A donated input imported from torch's memory is copied into a buffer XLA owns first:
        # PJRT would otherwise alias the result with memory torch owns (first calls only: later
        # ones take the owned twin of the last result).
        self._owned_copies = frozenset(i for i, p in enumerate(plan.inputs) if p.donated) if self._cuda_writes else ()
        self._placed = sharded_call.PlacedHandOff(plan, lambda t, d: self.import_tensor(t, d), self._order, gpu_torch)
        tensors = [i for i, p in enumerate(plan.inputs) if p.kind not in NOT_TENSORS]
        # Per resident slot, (weak reference to the tensor, version, data_ptr, device buffer) as a
        # plain tuple (see _steps, _ref); resident_buffers() gives them as ResidentInput records.
        self._resident: list[tuple | None] = [None] * len(tensors)
        twins = self._placed.takes_twins  # inputs that may arrive as another graph's buffers
        steps = []
        for slot, i in enumerate(tensors):
            p = plan.inputs[i]
            if not p.passed:
                continue
            placement = self._placed.placement(p)
            steps.append(ImportStep(i, slot if p.resident else -1, p.kind, p.perm,
                                    p.move if placement is None else Move.PLACED, placement,
                                    TwinUse(p.donated, p.bump) if twins else None))
        self.import_steps: tuple[ImportStep, ...] = tuple(steps)
        # Per input, the version bump with which it may arrive as the twin of an earlier
        # executable's result on this device (runtime/twins.py), or None: dense inputs on this
        # device only (a permuted one is passed as a view; a moved or placed one, every input
        # over a mesh among them, is a copy).
        twinned = _twins.enabled()
        bumps = [plan.inputs[s.position].bump
                 if twinned and s.move is _NO_MOVE and s.kind in (_TENSOR, InputKind.CONTIGUOUS) else None
                 for s in steps]
        # What _import unpacks per input, as exact tuples: CPython unpacks a tuple subclass (a
        # NamedTuple) through its generic iterator path, ~40 ns slower per input.
        owned = [self._cuda_writes and plan.inputs[s.position].donated for s in steps]
        self._steps = tuple((s.position, s.slot, s.kind, s.perm, s.move, b, o, s)
                            for s, b, o in zip(steps, bumps, owned))
        # The input imported again to order a call after torch's stream (GPU: written inputs,
        # dropped twins pressing): one the call does not write, as its position among the
        # executable's arguments and its import step.
        self._order_step = next(((k, s) for k, s in enumerate(steps)
                                 if s.placement is None and orders_after_torch(plan.inputs[s.position])), None)
        # Inputs only stacked in torch (per-layer weights of a folded scan) never reach the
        # executable: resident ones are only checked for changes, which renew their stack.
        self.check_steps = tuple((i, slot) for slot, i in enumerate(tensors)
                                  if not plan.inputs[i].passed and plan.inputs[i].resident)
        # Stacks and the seed: moved as their inputs (the seed is drawn on the executable's
        # device when torch has it); over a mesh, replicated.
        replicated = self._placed.replicated
        self._stack_steps = tuple((c.inputs, _extra_step(plan.inputs[c.inputs[0]].move, replicated)) for c in plan.concats)
        self._seeded = plan.seed
        self._seed_step = _extra_step(Move.NONE if plan.torch_device is not None else Move.PJRT, replicated)
        self._concat_cache: dict = {}  # input positions -> (resident epoch, tensor, buffer)
        # Bumped whenever a resident buffer is refreshed: concatenations of resident inputs stay
        # valid while it is unchanged (no per-member check on the call path).
        self._resident_epoch = 0
        self._resident_args = {i for i in tensors if plan.inputs[i].resident}
        self._weakself = weakref.ref(self)
        # CPU: the buffers of the plan's pinned weights (InputPlan.pinned) are pinned while
        # current, so that torch's convolution packs each once (torch_kernels.WeightPins);
        # unpinned when renewed, dropped, or when this executor is freed.
        self._pins = None
        self._pinned_slots = frozenset(s.slot for s in steps if s.slot >= 0 and plan.inputs[s.position].pinned)
        if device.platform == "cpu" and self._pinned_slots and torch_kernels.available("convolution"):
            self._pins = torch_kernels.WeightPins()
            weakref.finalize(self, self._pins.clear)
        # CPU: a small input that arrives afresh on every call (not resident, not donated, not
        # requiring grad) is copied into a buffer XLA already holds instead of being imported:
        # a DLPack import and its release take 25-120 µs between back-to-back calls where the copy
        # of up to STAGE_MAX_BYTES takes a few (docs/benchmarks.md, "Small inputs staged"). One
        # set of such buffers per call in flight: a call takes a free set (or starts one) and
        # gives it back once its results are out (Specialization.stages).
        self._stageable = frozenset(
            k for k, s in enumerate(steps)
            if device.platform == "cpu" and s.slot < 0 and s.move is _NO_MOVE
            and s.placement is None and not plan.inputs[s.position].donated) if staging_on() else frozenset()
        self._free_stages: list[dict] = []
        # A graph that writes its inputs (a buffer's counter, a cache, an optimizer's parameters)
        # hands their buffers to XLA and installs the new contents after the execution: two such
        # calls at once, from two threads on the same tensors, would each take a buffer the other
        # is writing, or free a swapped-out storage under the other's execution. They run one at
        # a time, each reading what the last one wrote.
        self._writes = threading.Lock() if plan.mutations else None
        if self._writes is not None:
            self.run = self._run_one_at_a_time  # (other graphs' calls take no lock, nor its frame)
        self.staged_inputs = 0  # inputs handed over through a staging buffer (metrics())
        self.executions = 0
        self.execute_seconds = 0.0
        self.import_seconds = 0.0  # the inputs' hand-off (_import), timed with execute_seconds
        self._timed = os.environ.get("FX2XLA_TIME_EXECUTE", "") not in ("", "0")  # opt-in: ~0.2 µs

    # -- a call -----------------------------------------------------------------------------
    def run(self, spec: Specialization, args):
        """One call of `spec`'s executable on `args` (a list is cleared once its inputs are
        handed off: AOTAutograd's boxed convention). A graph that writes its inputs replaces
        this method by `_run_one_at_a_time` (see `_writes`)."""
        # The hand-off's arrays need no recorded Python stack. Arrays kept past the call (twins,
        # ShardedTensors) may be read by jax later, which demands the context recording gives.
        if spec.keeps_arrays:
            with _recording():
                return self._run(spec, args)
        paused = _pause_tracebacks()
        try:
            return self._run(spec, args)
        finally:
            if paused:
                _resume_tracebacks(paused)

    def _run_one_at_a_time(self, spec: Specialization, args):
        with self._writes:
            return PlanExecutor.run(self, spec, args)

    def _run(self, spec: Specialization, args):
        self.executions += 1
        stages = None
        if spec.stages and self._stageable:
            try:
                stages = self._free_stages.pop()  # atomic: each call in flight has its own set
            except IndexError:
                stages = {}
        if self._timed:
            t0 = time.perf_counter()
            bufs = self._import(args, stages)
            self.import_seconds += time.perf_counter() - t0
        else:
            bufs = self._import(args, stages)
        held = {i: args[i] for i in spec.input_outputs} if spec.input_outputs else None
        if spec.concat_outputs:
            held = {**(held or {}), **{("concat", j): self._concat_cache[self.plan.concats[j].inputs][1]
                                       for j in spec.concat_outputs}}
        if type(args) is list:
            args.clear()  # boxed convention: drop our references to the inputs early
        if self._timed:  # parked and served calls included
            t0 = time.perf_counter()
            if spec.served is not None and _serving[0] and _get_ident() == _MAIN_THREAD:
                outs = self._launch_served(spec, bufs)
            else:
                outs = self._launch_unserved(spec, bufs)
            results = self._finish(spec, outs, held)
            self.execute_seconds += time.perf_counter() - t0  # export waits for the results
        elif spec.served is not None and _serving[0] and _get_ident() == _MAIN_THREAD:
            outs = self._launch_served(spec, bufs)
            results = outs if spec.direct else self._finish(spec, outs, held)
        elif spec.park and _team_running():
            outs = self._launch_parked(spec, bufs)
            results = outs if spec.direct else self._finish(spec, outs, held)
        elif spec.helped:
            outs = _run_helped(spec.launch, bufs)
            results = outs if spec.direct else self._finish(spec, outs, held)
        elif spec.direct:
            results = spec.launch(bufs)
        else:
            results = self._finish(spec, spec.launch(bufs), held)
        if stages is not None:
            self._free_stages.append(stages)  # the results are out: the execution read them
        return results

    @staticmethod
    def _launch(spec: Specialization, bufs):
        return _run_helped(spec.launch, bufs) if spec.helped else spec.launch(bufs)

    @staticmethod
    def _launch_served(spec: Specialization, bufs):
        """A main-thread launch while serving is on: served, or as its trial decides ("auto")."""
        return spec.served(bufs) if _serving[0] == _SERVE_ON else spec.serve_trial.launch(spec, bufs)

    @staticmethod
    def _launch_unserved(spec: Specialization, bufs):
        """A launch as a call that does not serve makes it (parked where torch's team runs)."""
        if spec.park and _team_running():
            return PlanExecutor._launch_parked(spec, bufs)
        return PlanExecutor._launch(spec, bufs)

    @staticmethod
    def _launch_parked(spec: Specialization, bufs):
        if spec.parked_wait is None:
            return _run_parked(PlanExecutor._launch, spec, bufs)
        return _run_parked(PlanExecutor._launch_and_wait, spec, bufs)

    @staticmethod
    def _launch_and_wait(spec: Specialization, bufs):
        """The launch, returned once the execution has ended (spec.parked_wait's result ready)."""
        outs = PlanExecutor._launch(spec, bufs)
        outs[spec.parked_wait].block_until_ready()
        return outs

    def _import(self, args, stages: dict | None = None) -> list:
        """The executable's arguments for one call: every passed input's device buffer
        (resident ones kept while unchanged), then the plan's stacks, then a fresh seed. The
        torch side of them all (dense copies, moves, stacks, the seed: kernels queued on
        torch's stream) comes first, then one stream order (CUDA), then the imports. `stages`:
        this call's staging buffers (see __init__), position -> (tensor, its buffer), filled
        where missing."""
        resident = self._resident
        bufs = []
        fresh = []  # (position in bufs, tensor to import, its import step, the input)
        renewed = False  # a resident buffer is replaced: stacks of resident inputs are rebuilt
        for i, slot, kind, perm, move, bump, owned, step in self._steps:
            t = args[i]
            if slot >= 0:
                r = resident[slot]
                if r is not None:
                    held, version, ptr, buf = r
                    if held() is t and ptr == t.data_ptr():
                        try:
                            if version == t._version:
                                bufs.append(buf)
                                continue
                        except RuntimeError:  # an inference tensor: no version, imported again
                            pass
                renewed = True
            if bump is not None:  # an earlier result, unchanged: its own array, no import
                buf = _twin_of(t, self.jax_device, bump, owned)
                if buf is not None:
                    if slot >= 0:
                        resident[slot] = (_ref(t), t._version, t.data_ptr(), buf)  # (a twin is never an inference tensor)
                        self._hold(t, slot)
                    bufs.append(buf)
                    continue
            dense = (t if kind is _TENSOR else t.permute(perm) if kind is _PERMUTED
                     else torch.tensor(t, dtype=torch.int64) if kind is _SCALAR
                     else t.permute(perm).clone(memory_format=torch.contiguous_format) if kind is _RELAID
                     else t.to(torch.float32, memory_format=torch.contiguous_format) if kind is _WIDENED
                     else t.resolve_conj().resolve_neg().contiguous() if kind is _RESOLVED
                     # a strided input to be staged is copied once, into its staging buffer, below
                     else t if stages is not None and len(bufs) in self._stageable
                     else t.contiguous())
            if move is _TORCH_MOVE:  # a CPU scalar beside CUDA tensors, moved before the order below.
                # Not pinned: a copy of pageable memory returns once the bytes are staged, with
                # no device sync (CUDA's documented behaviour); pinning would allocate per call.
                dense = dense.to(self._torch_device, non_blocking=True)
            if self.align and (move is _NO_MOVE or move is _TORCH_MOVE):
                dense = aligned(dense)
            fresh.append((len(bufs), dense, step, t))
            bufs.append(None)
        for i, slot in self.check_steps:
            t, r = args[i], resident[slot]
            if r is None or r[0]() is not t or r[1] != version_of(t) or r[2] != t.data_ptr():
                resident[slot] = (_ref(t), version_of(t), t.data_ptr(), None)
                renewed = True
        if renewed:
            self._resident_epoch = next(_epochs)
        stacks = self._stacks(args, bufs, fresh) if self._stack_steps else None
        if self._seeded:
            t = draw_seed(self.plan.seed_device)
            fresh.append((len(bufs), t, self._seed_step, t))
            bufs.append(None)
        claimed = None  # GPU: dropped results' arrays, let go once this call is ordered after them
        if self.fence is not None:
            waiting = _twins_waiting()
            if not fresh and self._order_step is not None and (self._cuda_writes or (waiting and _twins.pressing())):
                pos, step = self._order_step
                t = args[step.position]
                dense = t if step.kind is _TENSOR else t.contiguous()
                fresh.append((pos, aligned(dense), step, t))  # imported again: ordered
            if waiting:
                if fresh:
                    claimed = _twins.claim()
                else:
                    self.fence()
        if fresh:
            if self.stream_order is not None:  # once per call, after every torch kernel queued above
                self.stream_order(self.jax_device, self._torch_index)
            import_tensor, device, owned_copies = self.import_tensor, self.jax_device, self._owned_copies
            for pos, dense, step, t in fresh:
                move = step.move
                if stages is not None and pos in self._stageable:
                    staged = stages.get(pos)
                    if (staged is not None and staged[0].shape == dense.shape and staged[0].dtype == dense.dtype
                            and not dense.requires_grad):
                        staged[0].copy_(dense)
                        bufs[pos] = staged[1]
                        self.staged_inputs += 1
                        continue
                    dense = dense.contiguous()  # left strided above for the copy: imported dense
                    if dense.nbytes <= STAGE_MAX_BYTES and not dense.requires_grad:  # staged from the next call on
                        stage = torch.empty_like(dense, memory_format=torch.contiguous_format)
                        stages[pos] = (stage, import_tensor(stage, device))
                if move is _NO_MOVE or move is _TORCH_MOVE:
                    buf = import_tensor(dense, device)
                    if step.position in owned_copies:
                        buf = owned_copy(buf, device)
                else:
                    buf = self._hand_off(dense, step)
                bufs[pos] = buf
                if step.slot >= 0:
                    resident[step.slot] = (_ref(t), version_of(t), t.data_ptr(), buf)
                    self._hold(t, step.slot)
                    if self._pins is not None and step.slot in self._pinned_slots:
                        self._pins.pin(step.slot, buf)
            del claimed  # the imports are ordered after torch's stream, and this execution after them
        if stacks:
            for pos, group, valid, stacked in stacks:
                self._concat_cache[group] = (valid, stacked, bufs[pos])
        return bufs

    def _hand_off(self, dense: torch.Tensor, step: ImportStep):
        """The device buffer of `dense` handed over through a jax sharding, or through its own
        device's PJRT client (_import imports the others itself, after one stream order)."""
        if step.move is _PLACED:
            return self._placed(dense, step.placement, step.twin)
        import jax

        buf = jax.device_put(self._host_import(dense, device_of(dense.device).jax_device), self.jax_device)
        # The copy reads the tensor's memory asynchronously: done before torch may write it again.
        return buf.block_until_ready()

    def _order(self) -> None:
        """jax's import stream waits for torch's current stream (CUDA; see _import)."""
        if self.stream_order is not None:
            self.stream_order(self.jax_device, self._torch_index)

    def _stacks(self, args, bufs: list, fresh: list) -> list:
        """`torch.cat` of graph inputs (weights stacked for a folded scan), after _import's
        resident checks: a concatenation of resident inputs is rebuilt only when one of them
        changed (inference: once; training: per update); one with a non-resident member, every
        call. Cached buffers go to `bufs`; rebuilt stacks to `fresh`, imported by _import.
        Returns (position in bufs, group, epoch it stays valid for, stack) of those rebuilt."""
        cache = self._concat_cache
        epoch = self._resident_epoch
        rebuilt = []
        for group, step in self._stack_steps:
            hit = cache.get(group)
            if hit is not None and hit[0] == epoch:
                bufs.append(hit[2])
                continue
            with torch.no_grad():
                stacked = torch.cat([args[i] for i in group])
            dense = stacked  # a fresh allocation: aligned
            if step.move is _TORCH_MOVE:
                dense = stacked.to(self._torch_device, non_blocking=True)
            fresh.append((len(bufs), dense, step, stacked))
            rebuilt.append((len(bufs), group, epoch if self._resident_args.issuperset(group) else -1, stacked))
            bufs.append(None)
        return rebuilt

    def _finish(self, spec: Specialization, outs, held):
        """The call's results from the executable's: index checks read (a failure raises before
        any input is written), written inputs installed, outputs assembled."""
        arrays = None
        if spec.twins:
            arrays = outs[-len(spec.twins):]
            del outs[-len(spec.twins):]
        later = None
        if spec.in_place:  # before the checks: XLA has written these inputs' memory either way
            later = self._written_in_place(spec, outs, held)
        if spec.checks:
            spec.raise_failed(outs.pop(), spec.checks)
        if spec.mutations or later:
            with torch.no_grad():  # a parameter's update is no autograd op
                for i, r in spec.mutations:
                    install_input(held[i], outs[r])
                if later:
                    self._install_views(spec, later, outs, held)
        if arrays is not None:
            sharded_call.keep_twins(spec.twins, arrays, outs, held)
        if len(outs) > spec.num_outputs:
            del outs[spec.num_outputs:]
        return outs if spec.plain_outputs else wrap_outputs(spec.out_plans, outs, held)

    def _written_in_place(self, spec: Specialization, outs, held) -> list | None:
        """The donated written inputs XLA wrote at their own address (runtime/inplace.py): the
        memory's holder takes the new Array, which owns it now, and the tensor's version moves.
        Returns those whose new contents are elsewhere (the input was torch's memory, or a
        result exported to torch), for _install_views."""
        later = None
        keep = _twins.keep if spec.twinned_in_place else None
        device = self.jax_device
        cuda = self._cuda_writes
        if spec.wait_for_writes:  # torch's next kernel reads the tensors after the execution
            self.stream_wait(outs[spec.in_place[0][1]])
        for i, r in spec.in_place:
            a, dst = outs[r], held[i]
            if not cuda:
                a.block_until_ready()  # torch reads the tensor as soon as the call returns
            ptr = dst.data_ptr()
            if a.unsafe_buffer_pointer() == ptr:
                _inplace.rehome(ptr, a)
                _inplace.written_in_place(dst)
                if keep is not None:
                    keep(dst, a, device, cuda, True)
            else:
                if _inplace.consumed(ptr):
                    raise RuntimeError(
                        f"fx2xla: XLA took the buffer of written input {i} ({dst.dtype}{list(dst.shape)}) without "
                        "writing its result there; its memory may be gone. Please report this; FX2XLA_INPLACE=0 "
                        "avoids it.")
                if later is None:
                    later = []
                later.append((i, r))
        return later

    def _install_views(self, spec: Specialization, later: list, outs, held) -> None:
        """Written inputs whose new contents XLA put in a new buffer: it reaches torch as a view
        that holds its Array (not a DLPack export), so that the next call can donate it."""
        keep = _twins.keep if spec.twinned_in_place else None
        device, cuda = self.jax_device, self._cuda_writes
        index = self._torch_index if cuda else None
        for i, r in later:
            a, dst = outs[r], held[i]
            install_input(dst, _inplace.own_view(a, dst.dtype, index))
            if keep is not None and dst.data_ptr() == a.unsafe_buffer_pointer():
                keep(dst, a, device, cuda, True)

    # -- resident buffers -------------------------------------------------------------------
    def drop_resident(self, slot: int, t: torch.Tensor) -> None:
        """Forget resident slot `slot` if it still imports `t` (whose storage was swapped out):
        releases the old memory now rather than at the next call."""
        r = self._resident[slot]
        if r is not None and r[0]() is t:
            self.release_slot(slot)

    def release_dead(self, slot: int) -> None:
        """Empty resident slot `slot` if the tensor it imported has died."""
        r = self._resident[slot]
        if r is not None and r[0]() is None:
            self.release_slot(slot)

    def release_slot(self, slot: int) -> None:
        """Empty resident slot `slot`, its buffer let go (the next call imports afresh)."""
        self._resident[slot] = None
        self._resident_epoch = next(_epochs)
        if self._pins is not None:
            self._pins.unpin(slot)

    def _hold(self, t: torch.Tensor, slot: int) -> None:
        """Record that resident slot `slot` imports `t`'s memory (see install_input)."""
        holders = _resident_holders.get(id(t))
        if holders is None:
            try:
                weakref.finalize(t, _release_holders, id(t))
            except TypeError:  # not weak-referenceable: nothing to drop later
                return
            holders = _resident_holders[id(t)] = []
        entry = (self._weakself, slot)
        if entry not in holders:
            holders.append(entry)

    def cached_stacks(self) -> dict:
        """The stacks kept for the next call: input positions -> the stacked tensor."""
        return {group: hit[1] for group, hit in self._concat_cache.items()}

    def resident_buffers(self) -> list[ResidentInput | None]:
        """Per resident input slot, its ResidentInput as last imported, or None."""
        return [None if r is None else ResidentInput(r[0](), *r[1:]) for r in self._resident]


# The version recorded for an inference tensor, which has no version counter: NaN equals
# nothing, so a resident buffer of one is never taken as current (it is imported again per call:
# torch could have written it in inference mode without a trace).
UNTRACKED = float("nan")


def version_of(t: torch.Tensor):
    """`t._version`, or UNTRACKED for an inference tensor."""
    try:
        return t._version
    except RuntimeError:
        return UNTRACKED


def owned_copy(buf, device):
    """A copy of imported `buf` in memory XLA owns, on `buf`'s device (`device`), queued after
    it: a copy kernel (a same-device PJRT copy is not offered by every client). x64 on, so that
    64-bit dtypes stay as they are."""
    import jax

    with jax.enable_x64(True):
        return jax.numpy.copy(buf)


def _extra_step(move: Move, replicated) -> ImportStep:
    """The import step of a stack or the seed (no input position, never resident)."""
    if replicated is not None:
        return ImportStep(-1, -1, InputKind.TENSOR, None, Move.PLACED, replicated, None)
    return ImportStep(-1, -1, InputKind.TENSOR, None, move, None, None)


def wrap_outputs(out_plans: list[OutputPlan], outs, held) -> list:
    """The graph's outputs from the executable's results `outs` and the inputs it returns
    (`held`), as the output plans say (constants, views, eager's strides)."""
    results = []
    for p in out_plans:
        kind = p.kind
        if kind is _CONST:
            results.append(p.value)
            continue
        if kind is _INPUT:
            t = held[p.index]
        elif kind is _CONCAT:
            t = held[("concat", p.index)]
        else:
            t = outs[p.index]
            if p.inv_perm is not None:
                t = t.permute(p.inv_perm)
            elif p.stride is not None:
                t = restride(t, p.stride)
        for op, op_args in p.views:  # views of an input or of one computed value
            t = op(t, *op_args)
        results.append(t)
    return results


def result_exports(plan: GraphPlan, checks: bool):
    """Per executable result, the function that hands it to torch on the device its output
    lives on (see plan.Move); the index-check code, when `checks`, stays on the device. One
    function for every result where none moves: the launcher's fastest form."""
    platform, index = plan.device.platform, plan.device.index
    export = make_exporter(platform=platform, index=index)

    def moved(r):
        if not r.move:
            return export
        if r.move is Move.TORCH:
            home = r.device
            return lambda a: export(a).to(home)
        import jax

        own = device_of(r.device)
        own_export = make_exporter(platform=own.platform, index=own.index)
        return lambda a: own_export(jax.device_put(a, own.jax_device))

    if not any(r.move for r in plan.results):
        return export
    exports = [moved(r) for r in plan.results]
    return exports + [export] if checks else exports


def twin_results(plan: GraphPlan, outputs: list[OutputPlan], checks: bool = False,
                 returned: bool = True) -> tuple[int, ...]:
    """The results of a one-device plan whose jax Arrays are kept as their tensors' twins
    (runtime/twins.py), so that a later executable reading the tensor unchanged takes the array
    instead of importing it again. Results moved to another device are copies: none of them.
    CPU: the new contents of written inputs, and where `returned` (training graphs) results
    returned as they are (a view, permutation or restride gives the caller another tensor). GPU:
    every other result, and the index checks' verdict (`checks`, read by torch's `_assert_async`
    on its stream), since each is recorded to hold its memory until torch's stream is done with
    it. (Plans over a mesh, or with results in host memory, keep theirs through sharded_call
    instead: never called for them.)"""
    candidates = [r for r, res in enumerate(plan.results) if not res.move and res.memory_kind is None]
    if plan.device.platform in GPU_PLATFORMS:
        return tuple(candidates) + ((len(plan.results),) if checks else ())
    written = {r for _, r in plan.mutations}
    kept = {p.index for p in outputs if p.kind is _TENSOR_OUT} if returned else set()
    reshaped = {p.index for p in outputs
                if p.kind is _TENSOR_OUT and (p.inv_perm is not None or p.stride is not None or p.views)}
    return tuple(r for r in candidates if r in written or (r in kept and r not in reshaped))


def keeping_exports(plan: GraphPlan, exports, kept: tuple[int, ...], checks: bool, raw=frozenset()) -> list:
    """`exports` (one function, or one per result) as one per result, those of `kept` also
    recording the result's array as the twin of the tensor it becomes, those of `raw` the
    result's jax Array itself (runtime/inplace.py)."""
    n = len(plan.results) + int(checks)
    each = list(exports) if isinstance(exports, (list, tuple)) else [exports] * n
    device = plan.device.jax_device
    keep = _twins.keep
    fenced = plan.device.platform in GPU_PLATFORMS

    def keeping(export):
        def export_keep(a):
            t = export(a)
            keep(t, a, device, fenced)
            return t

        return export_keep

    return [_as_array if r in raw else keeping(e) if r in kept else e for r, e in enumerate(each)]


def _as_array(a):
    return a


def restride(t: torch.Tensor, stride) -> torch.Tensor:
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


def draw_seed(device) -> torch.Tensor:
    """A graph's per-call int64 seed, from torch's generator of `device` (so torch.manual_seed
    makes runs repeatable, and a CUDA graph draws on its GPU without a host round trip)."""
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, device=device)


# -- index checks -----------------------------------------------------------------------------
_CHECK_ERRORS = {INDEX: IndexOutOfRangeError, LINALG: LinAlgError, VALUE: InvalidValueError}


def _raise_failed_now(code: torch.Tensor, records) -> None:
    failed = int(code)
    if failed:
        record = records[failed - 1]
        raise _CHECK_ERRORS[record.error](record.message)


@functools.lru_cache(maxsize=256)
def _async_message(records) -> str:
    """The device-side assert's message for a graph's checks, made once per graph. torch caps it
    at 254 characters: the ops' names; the full text is the records'."""
    ops = ", ".join(dict.fromkeys(r.message.split(":")[1].strip() for r in records if r.message.count(":") > 1))
    what = "a check failed" if any(r.error != INDEX for r in records) else "index out of range"
    return f"fx2xla: {what} in {ops}"[:254]


def _assert_async_private(code: torch.Tensor, records) -> None:
    # Enqueued on the tensor's stream: the call stays asynchronous, and a failure surfaces at
    # the next synchronisation, like the device-side asserts of eager CUDA's index kernels.
    torch._assert_async(code == 0, _async_message(records))


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


# -- written inputs ---------------------------------------------------------------------------
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


storage_use_count = make_storage_use_count()
# Resident-buffer epochs: each refresh takes a new value (next() on a count is atomic, so two
# threads refreshing at once never lose an update that must invalidate cached concatenations).
_epochs = itertools.count(1)
_SWAPPABLE_TYPES = (torch.Tensor, torch.nn.Parameter)
# Resident device buffers import a tensor's memory: id(tensor) -> [(executor, resident slot)],
# so an input whose storage is swapped out drops the buffers that would keep the old memory
# (entries leave with their tensor; each use re-checks the slot still holds that tensor).
_resident_holders: dict = {}


def _ref(t: torch.Tensor):
    """A resident slot's reference to its tensor: weak, so that a model dropped by its user
    frees its weights even where torch keeps the compiled graph alive (AOTAutograd's compiled
    function outlives torch._dynamo.reset()); the tensor's death empties the slot
    (_release_holders). A tensor that cannot be weakly referenced is held."""
    try:
        return weakref.ref(t)
    except TypeError:
        return lambda: t


def _release_holders(tensor_id: int) -> None:
    """A resident tensor died: the slots importing its memory let their buffers go."""
    for ref, slot in _resident_holders.pop(tensor_id, ()):
        executor = ref()
        if executor is not None:
            executor.release_dead(slot)


def install_input(dst: torch.Tensor, new: torch.Tensor) -> None:
    """Write `new` (a fresh executable result) into graph input `dst`, as AOTAutograd's
    write-back would. Where `dst` alone owns a dense storage of exactly its size, `new`'s
    storage is swapped in (zero copy; `dst` stays the same tensor object, its version bumps);
    otherwise (views, shared or strided storage, subclasses) its data is copied in."""
    if (type(dst) in _SWAPPABLE_TYPES and dst.is_contiguous() and dst.storage_offset() == 0
            and dst.dtype == new.dtype and dst.shape == new.shape and dst.device == new.device
            and dst.untyped_storage().nbytes() == new.untyped_storage().nbytes()
            and storage_use_count(dst) == 1):
        dst.set_(new)
        _twins.rebind(dst)  # later readers show dst's version counter, not new's
        for ref, slot in _resident_holders.get(id(dst), ()):
            executor = ref()
            if executor is not None:
                executor.drop_resident(slot, dst)
    else:
        dst.copy_(new)
