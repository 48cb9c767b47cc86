"""One explicit plan per graph: how every input reaches the executable, where every value lives,
what the executable returns and how each result becomes the call's output.

`build_plan` reads only the FX graph, its example inputs (FakeTensors: shapes, strides, dtypes,
devices) and the PJRT device chosen for it; nothing here traces. `lower_graph` emits a module FOR
a plan, and `plan_executor.PlanExecutor` runs one. Every tensor value the plan names carries its
torch device, and room for a sharding (filled by the SPMD passes).

Devices: a graph runs on one PJRT device. An input that lives elsewhere (a CPU 0-d scalar beside
CUDA tensors; CPU tensors under an explicit `PJRT_DEVICE=CUDA`) is moved first, never handed to
the executable as is: a host pointer given to a GPU executable as a device buffer crashes the
process. Results go back to the device their output lives on in eager PyTorch.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import sympy
import torch
import torch.fx

from . import torch_kernels as _torch_kernels
from .layouts import dense_permutation, inverse, is_identity, symbolic
from .lowering import channels_last as _channels_last
from .lowering import linalg as _linalg
from .lowering import regions as _regions
from .lowering.registry import PYTHON_OPS, graph_uses_randomness, lowering_for
from .passes.sharding import graph_mesh, propagate
from .runtime import inplace as _inplace
from .runtime import twins as _twins
from .runtime.client import Device, get_backend, torch_index
from .sharding import ShardingError, mesh_by_id

class _Named(str, Enum):
    """A kind written as its plain string (in reprs, messages and a package's JSON)."""

    __str__ = str.__str__
    __format__ = str.__format__


class InputKind(_Named):
    """How one graph input reaches the executable."""

    TENSOR = "tensor"  # passed as it is (row-major)
    PERMUTED = "permuted"  # passed as `t.permute(perm)`, a dense view, and permuted back in the graph
    CONTIGUOUS = "contiguous"  # copied dense first (sliced, expanded or symbolic strides)
    # copied in `perm` order when imported, and permuted back in the graph: a resident
    # convolution weight of an inference graph, kept channels-last (lowering/channels_last.py)
    RELAID = "relaid"
    # imported as a float32 copy, once while unchanged: a resident bf16/float16 weight that only
    # matmuls of many rows read (nn.Linear's, Conv1D's), which multiply the copy (lowering/linalg.py:
    # widened_weights); the graph sees the weight's own dtype, rounded back exactly
    WIDENED = "widened"
    # copied with torch's lazy conjugate and negative bits applied (`x.conj()`, `x.mH` of a complex
    # tensor, `x.conj().imag`): such a view's memory holds the values before the conjugation or
    # negation, which the graph's ops already see applied
    RESOLVED = "resolved"
    SYMINT = "symint"  # a size: specialises the executable, not passed
    # an effect token (the first input of `with_effects`): AOTAutograd passes None at run time
    # and drops the graph's token outputs, so it is neither passed nor returned
    TOKEN = "token"
    # a Python int that sizes nothing (a step count, an offset used as a value): passed as a 0-d
    # int64 array, so one executable serves every value (plan.value_symints)
    SCALAR = "scalar"


class OutputKind(_Named):
    """Where one graph output comes from."""

    TENSOR = "tensor"  # an executable result
    CONST = "const"  # a Python value fixed at lowering time
    INPUT = "input"  # a graph input, or a view of one replayed in torch
    CONCAT = "concat"  # a torch-side concatenation of inputs (stacked weights), or a view of it


class Move(_Named):
    """How a value crosses between its own device and the executable's."""

    NONE = ""  # it lives on the executable's device: zero-copy hand-off (falsy)
    TORCH = "torch"  # moved in torch first (`t.to(device)`): the executable's device is one torch has
    # Handed to its own device's PJRT client, then copied by PJRT (torch has no tensors on the
    # executable's device, e.g. a CPU build of torch beside jax's CUDA plugin).
    PJRT = "pjrt"
    # Handed over through a jax sharding: split into a mesh's shards, or placed in host memory
    # (offload.py). Only the executor's import steps carry it; a plan's inputs keep their
    # device move and say their sharding and memory kind.
    PLACED = "placed"


class Mutation(NamedTuple):
    """A graph input the graph writes: its position, and the result holding its new contents."""

    input: int
    result: int


class Concat(NamedTuple):
    """Graph inputs concatenated along dim 0 in torch before the call (weights stacked for a
    scan), passed as one more executable input: the `aten.cat` node, and the input positions."""

    node: Any  # torch.fx.Node (None in a plan read back from a package)
    inputs: tuple[int, ...]


@dataclass(frozen=True)
class InputPlan:
    """How one graph input reaches the executable.

    `kind` (InputKind) and, for PERMUTED and RELAID, `perm` say the layout it is passed in.
    """

    kind: InputKind
    perm: tuple[int, ...] | None = None
    device: torch.device | None = None  # where the tensor lives (None: a size)
    move: Move = Move.NONE
    resident: bool = False  # a parameter/buffer: its device buffer is kept across calls
    passed: bool = True  # reaches the executable (False: a size, or read only by a concatenation)
    sharding: Any = None
    # A written input (an optimizer step's parameter or moment) whose new contents the
    # executable writes into its buffers (donated), so the update happens in place: over a mesh,
    # a sharded input whose new contents keep its layout, on every device; on one CPU device, a
    # dense one (runtime/inplace.py).
    donated: bool = False
    # Host offloading (fx2xla/offload.py): the memory kind the executable takes this input in
    # ("pinned_host"), None for the device's own memory.
    memory_kind: str | None = None
    # How far AOTAutograd moves this input's version just before each call (1: the graph writes
    # it, an optimizer step's parameter): the array a graph left it as (its twin: shards over a
    # mesh, a host buffer, or one device's result, runtime/twins.py) is still current at that
    # many versions more.
    bump: int = 0
    # A resident weight that only 2-D convolutions of an inference graph read and that the graph
    # does not write: its device buffer is pinned while current, so that torch's convolution
    # packs it once (torch_kernels.WeightPins).
    pinned: bool = False


def orders_after_torch(p: InputPlan) -> bool:
    """Whether input plan `p` can be imported again to order a GPU call after torch's stream:
    passed to the executable as the tensor itself (dense), on its device, and not donated."""
    return (p.kind in (InputKind.TENSOR, InputKind.CONTIGUOUS) and p.passed and p.move is Move.NONE
            and not p.donated and p.memory_kind is None and p.sharding is None)


@dataclass(frozen=True)
class OutputPlan:
    """How one graph output is produced.

    kind (OutputKind): TENSOR (executable result `index`, then `.permute(inv_perm)` if set, or
    restrided to `stride` if set, then `views` replayed), CONST (a Python value fixed at
    lowering time, e.g. a size or None; `value` may be a SymInt, resolved per specialization),
    INPUT (below), CONCAT (the torch-side concatenation `index` of `GraphPlan.concats`, then
    `views`).
    """

    kind: OutputKind
    index: int = -1
    inv_perm: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None
    value: Any = None
    # INPUT: graph input `index` itself, or a view of it replayed in torch with `views`
    # ((aten view op, args) pairs): no copy through the executable (e.g. saved activations).
    views: tuple = ()
    device: torch.device | None = None  # where eager PyTorch puts this output


@dataclass(frozen=True)
class ResultPlan:
    """One result of the executable: the value of graph node `node`, transposed by `perm` in
    the graph when set (a non-row-major output leaves as a dense permutation), exported to
    `device` (moved there by `move`)."""

    node: torch.fx.Node | None  # None in a plan read back from a package
    perm: tuple[int, ...] | None = None
    device: torch.device | None = None
    move: Move = Move.NONE
    sharding: Any = None
    memory_kind: str | None = None  # host offloading: the memory kind it is left in (None: device)


@dataclass
class GraphPlan:
    """The calling convention of one graph on one device, decided once."""

    device: Device  # the PJRT device the executable runs on
    torch_device: torch.device | None  # the same device as torch names it (None: torch has none)
    inputs: list[InputPlan]
    # Concatenations of graph inputs along dim 0 (weights stacked for a scan), passed as extra
    # executable inputs after the graph's tensors. The executor keeps each while its inputs are
    # unchanged.
    concats: list[Concat]
    seed: bool  # random ops: one more executable input, an int64 seed drawn by torch per call
    seed_device: torch.device | None  # where the seed is drawn (the executable's device if torch has it)
    results: list[ResultPlan]  # the executable's results, in order (before the index-check code)
    outputs: list[OutputPlan]
    # Graph inputs the graph writes (AOTAutograd's `copy_(input, new)` kept in inference
    # graphs). Their results follow the outputs' own; the executor installs them in the inputs.
    mutations: list[Mutation]
    constants: dict = field(default_factory=dict)  # input-independent nodes -> values (literals)
    # SPMD: the mesh the executable runs over (None: one device). Then each passed input's and
    # each result's `sharding` is a spec (per torch dim, a tuple of mesh axes), and `shardings`
    # holds every value's spec and its source (see passes/sharding.py).
    mesh_id: int | None = None
    shardings: Any = None
    # Values the module pins to a spec (node -> spec): under sharding="auto", every value the
    # solver chose a layout for, so XLA's partitioner realises the plan the solver priced
    # (left to its own propagation, it took other layouts and moved 2-5x the bytes).
    constraints: dict = field(default_factory=dict)
    # node -> {operand node: spec}: the layout the solver priced the node's read of an operand
    # in, where it differs from the operand's own (the reshard happens there, as priced).
    operand_constraints: dict = field(default_factory=dict)
    # The values computed channels-last between convolutions on the CPU (lowering/channels_last.py).
    channels_last: Any = _channels_last.NONE
    # CPU inference matmuls of a few rows computed with their weight as the dot's left operand,
    # (W . x^T)^T (lowering/linalg.py: weight_lhs_matmuls); their weights are passed as torch
    # holds them.
    weight_lhs: frozenset = frozenset()
    # CPU inference matmuls of 2-8 rows computed in the kernel library's few-row matmul
    # (lowering/linalg.py: few_row_matmuls); their weights too are passed as torch holds them.
    few_rows: frozenset = frozenset()
    # CPU elementwise regions run in one pass by the kernel library (lowering/regions.py): an
    # optimizer's update of each large parameter.
    regions: tuple = ()

    @property
    def platform(self) -> str:
        return self.device.platform

    @property
    def num_outputs(self) -> int:
        """Results before the written inputs' new contents."""
        return min((r for _, r in self.mutations), default=len(self.results))


# View ops whose result an output may be rebuilt with in torch, zero-copy, from a graph input
# (not expand: its overlapping elements could not be written to in place afterwards).
_VIEW_OPS = {
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.permute.default,
    torch.ops.aten.t.default, torch.ops.aten.transpose.int,
    torch.ops.aten.alias.default, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims, torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
    torch.ops.aten.diagonal.default,
}


def _view_chain(node):
    """(base node, ((view op, args), ...)): `node` as a chain of view ops applied to `base` (no
    views: `node` itself), with static arguments or symbolic ints (`x[s]` and `x[s:]` for an int
    Dynamo made dynamic), which each specialization resolves (lowering.graph.lower_graph).

    An output that is a view of an input must be that view, offset included: AOTAutograd
    rebuilds such an output from the input with the output's own storage offset and strides. An
    argument another node computes as a tensor ends the chain."""
    views = []
    while node.op == "call_function" and node.target in _VIEW_OPS and not node.kwargs:
        src, *rest = node.args
        if not isinstance(src, torch.fx.Node):
            break
        args = torch.fx.node.map_aggregate(tuple(rest), _symbolic_value)
        if any(isinstance(a, torch.fx.Node) for a in _leaves(args)):
            break
        views.append((node.target, args))
        node = src
    return node, tuple(reversed(views))


def _leaves(v):
    """The non-sequence values in `v`, a value or nested tuples and lists of them."""
    if isinstance(v, (tuple, list)):
        for x in v:
            yield from _leaves(x)
    else:
        yield v


def _symbolic_value(a):
    """A view argument: a node that computes a symbolic int (a size, an index) as that SymInt."""
    if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.SymInt):
        return a.meta["val"]
    return a


def input_mutations(gm: torch.fx.GraphModule) -> dict:
    """placeholder node -> the last `aten.copy_` node writing it (AOTAutograd's in-graph
    write-back of a mutated input)."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
                and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "placeholder":
            found[node.args[0]] = node
    return found


# The input kinds that are no tensor at run time.
NOT_TENSORS = frozenset((InputKind.SYMINT, InputKind.TOKEN))


def effect_tokens(gm: torch.fx.GraphModule) -> set:
    """The graph's effect-token values: placeholders that only `with_effects` nodes take as their
    token (or the output returns), and the tokens those nodes return (`getitem(node, 0)`)."""
    with_effects = torch.ops.higher_order.with_effects
    found = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.users and all(
                u.op == "output" or (u.target is with_effects and u.args[0] is node and node not in u.args[1:])
                for u in node.users) and any(u.target is with_effects for u in node.users):
            found.add(node)
        elif (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0
              and isinstance(node.args[0], torch.fx.Node) and node.args[0].target is with_effects):
            found.add(node)
    return found


def value_symints(gm: torch.fx.GraphModule, placeholders) -> frozenset:
    """The graph's symbolic-int inputs (a Python int Dynamo made dynamic after it changed) whose
    symbol sizes no tensor of the graph, nor any stride or offset: values such as a step count
    or a scale. Passing them to the executable as values spares a compile per value; a rule
    that needs one as a Python int refuses it while lowering, and the graph then specializes
    per value instead (CompiledGraph.specialization_for)."""
    candidates = {}
    for n in placeholders:
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
            candidates[v.node.expr] = n
    if not candidates:
        return frozenset()
    sizing = set()  # (and symbols of sizes the graph returns, which AOTAutograd reads as ints)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for a in output.all_input_nodes:  # (an int returned as it came in is returned as the argument)
        v = a.meta.get("val")
        if isinstance(v, torch.SymInt) and a.op != "placeholder":
            sizing |= v.node.expr.free_symbols
    for node in gm.graph.nodes:
        for v in _leaves(node.meta.get("val")):
            if isinstance(v, torch.Tensor):
                for s in (*v.shape, *v.stride(), v.storage_offset()):
                    if isinstance(s, torch.SymInt):
                        sizing |= s.node.expr.free_symbols
    return frozenset(n for sym, n in candidates.items() if sym not in sizing)


def plan_input(val) -> InputPlan:
    """The layout half of an input's plan (kind, perm), from its example value alone."""
    if isinstance(val, torch.SymInt) or isinstance(val, (int, float, bool)):
        return InputPlan(InputKind.SYMINT, passed=False)
    if not isinstance(val, torch.Tensor):
        raise TypeError(f"fx2xla: unsupported graph input {val!r}")
    if val.is_conj() or val.is_neg():  # (Dynamo guards on both bits: a plain tensor is another graph)
        return InputPlan(InputKind.RESOLVED)
    shape, stride = val.shape, val.stride()
    if any(isinstance(s, torch.SymInt) for s in list(shape) + list(stride)):
        return InputPlan(InputKind.CONTIGUOUS)
    if val.numel() <= 1 or val.is_contiguous():
        return InputPlan(InputKind.TENSOR)
    perm = dense_permutation(tuple(shape), tuple(stride))
    if perm is not None and not is_identity(perm):
        return InputPlan(InputKind.PERMUTED, perm)
    return InputPlan(InputKind.CONTIGUOUS)


def _input_concats(gm, placeholders, plans) -> list:
    """(cat node, graph input positions) for each `aten.cat(inputs, 0)` whose operands are all
    dense graph inputs of one dtype whose shapes differ in dim 0 at most (weights stacked by
    scan-folding, or concatenated for one matmul by lowering/merge_linears.py): computing it in
    torch once per weight update beats a concatenation inside every call (and its kernels)."""
    index = {n: i for i, n in enumerate(placeholders)}
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if dim != 0 or len(tensors) < 2 or not all(isinstance(t, torch.fx.Node) and t in index for t in tensors):
            continue
        metas = [t.meta.get("val") for t in tensors]
        if not all(isinstance(m, torch.Tensor) and m.dim() > 0 and not symbolic(m.shape) for m in metas):
            continue
        if len({(tuple(m.shape[1:]), m.dtype, m.device) for m in metas}) != 1 \
                or any(plans[index[t]].kind is not InputKind.TENSOR for t in tensors):
            continue
        found.append(Concat(node, tuple(index[t] for t in tensors)))
    return found


def _read_only_by(placeholders, concats) -> set[int]:
    nodes = {node for node, _ in concats}
    if not nodes:
        return set()
    return {i for i, n in enumerate(placeholders) if n.users and all(u in nodes for u in n.users)}


# Input-independent values (shape-derived masks, position ids) up to this many elements are
# computed once, in torch, when the graph is planned, and reach XLA as literals: no kernel to
# compile for them, no work per call. Larger ones stay computations (a literal that size
# bloats the module text, which is also the cache key).
CONSTANT_FOLD_MAX_ELEMENTS = 1 << 16
_NO_FOLD = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
            torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
            torch.ops.aten.new_empty_strided.default}  # uninitialised: never worth a literal


def _foldable_value(v, computed: bool = True) -> bool:
    """Whether `v` may become a literal: small, static, strided, with a numpy twin. A computed
    value must be a CPU tensor; a node's example value may live on any device (a CUDA graph's
    constants are computed on the CPU, and a literal has no device)."""
    if isinstance(v, torch.Tensor):
        fp8 = v.dtype.is_floating_point and v.dtype.itemsize == 1  # no numpy twin
        return (v.layout == torch.strided and (v.device.type == "cpu" or not computed) and not v.is_complex()
                and not fp8 and all(isinstance(d, int) for d in v.shape)
                and math.prod(v.shape) <= CONSTANT_FOLD_MAX_ELEMENTS)
    if isinstance(v, (tuple, list)):
        return all(_foldable_value(x, computed) for x in v)
    return isinstance(v, (bool, int, float))


def constant_values(gm: torch.fx.GraphModule) -> dict:
    """The graph's input-independent nodes (no placeholder or attribute among their
    ancestors, deterministic and functional ops, small static results), evaluated in torch on
    the CPU: {node: value}. An op torch cannot evaluate here is simply left to XLA."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    values: dict = {}
    with unset_fake_temporarily(), torch.no_grad():
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target in _NO_FOLD:
                continue
            if not all(i in values for i in node.all_input_nodes):
                continue
            if node.target not in PYTHON_OPS:
                rule = lowering_for(node.target)
                schema = getattr(node.target, "_schema", None)
                if rule is None or rule.random or rule.subgraphs is not None or schema is None or schema.is_mutable:
                    continue
            if "val" not in node.meta or not _foldable_value(node.meta["val"], computed=False):
                continue
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = _cpu_kwargs(torch.fx.node.map_arg(node.kwargs, values.__getitem__))
            try:
                value = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - XLA computes it instead
                continue
            if _foldable_value(value):
                values[node] = value
    return values


def _cpu_kwargs(kwargs: dict) -> dict:
    """Creation ops of a CUDA graph name their device: constants are computed on the CPU."""
    if "device" in kwargs and kwargs["device"] is not None:
        return {**kwargs, "device": torch.device("cpu")}
    return kwargs


def _move(device: torch.device | None, target: Device, torch_target: torch.device | None) -> str:
    if device is None or target.holds(device):
        return Move.NONE
    return Move.TORCH if torch_target is not None else Move.PJRT


def build_plan(gm: torch.fx.GraphModule, example_inputs, device: Device,
               resident: set[int] | None = None, annotations=None, solution=None, offload=None,
               bumps: frozenset[int] = frozenset(), saved: frozenset[int] = frozenset(),
               channels_last: bool = True, relaid_weights: bool = False, pinned_weights: bool = False,
               linear_weights_kn: bool | str = False, linear_weight_lhs: bool = False,
               few_row_kernel: bool = False, elementwise_regions: bool = False,
               widened_weights: bool | str = False, scalar_symints: bool = True) -> GraphPlan:
    """The plan of `gm` on `device`. `resident`: input positions that are parameters/buffers
    (kept as device buffers across calls); None: none. `annotations`: per input, the
    sharding.Annotation of the tensor behind it (or None). A graph with sharding constraints or
    annotated inputs runs over their mesh, whose first device replaces `device`. `solution`:
    auto-sharding's (passes/auto_sharding.py): its layouts become the plan's constraints.
    `offload`: host offloading (offload.py), (input positions, output positions, memory kind):
    those inputs arrive in, and those outputs' results (and the written inputs' new contents)
    are left in, that memory kind. `bumps`: the inputs whose version AOTAutograd bumps before
    each call (see InputPlan.bump). `saved`: positions of a forward graph's outputs that only
    its backward reads, whose strides the compiler chooses: a channels-last value among them
    leaves the executable channels-last. `channels_last`: whether values between convolutions
    may be computed channels-last at all (the option of that name). `relaid_weights`: resident
    convolution weights are imported channels-last, once while unchanged (inference graphs:
    their weights rarely change; a training step's change every step). `pinned_weights`: the same
    weights (whatever layout they arrive in) are pinned for torch's convolutions to pack
    (InputPlan.pinned; inference graphs whose convolutions may be torch's). `linear_weights_kn`:
    resident float32 weights that only matmuls of several rows read transposed (nn.Linear's) are
    imported laid out [in, out] where XLA:CPU's dot reads them faster so on this machine
    (`lowering.linalg.kn_weights`), "always": all of them (callers ask for it in CPU inference
    graphs and packages exported on a CPU; never over a mesh). `linear_weight_lhs`: float32
    matmuls of 4-64 rows against such a weight compute (W . x^T)^T, the weight as torch holds it
    (`lowering.linalg.weight_lhs_matmuls`; CPU graphs, inference and training, never over a mesh).
    `few_row_kernel`: float32 matmuls of 2-8 rows against such a weight run in the kernel
    library's few-row matmul instead (`lowering.linalg.few_row_matmuls`; the same graphs, where
    the library may run), the weight as torch holds it. `elementwise_regions`: float32 elementwise
    ops that write several results run in one pass each (`lowering.regions.find_regions`; CPU
    graphs on one device, without host offloading, where the library may run). `widened_weights`:
    resident bf16/float16 weights that only matmuls of many rows read, as their right operand
    (nn.Linear's, transformers' Conv1D's), are imported as float32 copies, once while unchanged
    (`lowering.linalg.widened_weights`; CPU inference graphs on one device), up to
    `lowering.linalg.WIDEN_MAX_BYTES` of copies; "always": all of them. `scalar_symints`: symbolic
    ints that size no tensor are passed as values (InputKind.SCALAR, `value_symints`)."""
    resident = resident or set()
    host_inputs, host_outputs, host_kind = offload if offload is not None else ((), (), None)
    annotations = list(annotations) if annotations is not None else [None] * len(example_inputs)
    mesh_id = graph_mesh(gm, annotations)
    shardings, constraints, operand_constraints = None, {}, {}
    if mesh_id is not None:
        device = _mesh_device(mesh_id, example_inputs)
        shardings = propagate(gm, annotations, mesh_id)
        if solution is not None:
            constraints = solution.constraints()
            operand_constraints = solution.operand_constraints
            for node, spec in constraints.items():
                shardings.specs[node], shardings.sources[node] = spec, "auto"
    torch_device = device.torch_device
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    tokens = effect_tokens(gm)
    scalars = value_symints(gm, placeholders) if scalar_symints else frozenset()
    layouts = [InputPlan(InputKind.TOKEN, passed=False) if n in tokens
               else InputPlan(InputKind.SCALAR) if n in scalars else plan_input(v)
               for n, v in zip(placeholders, example_inputs)]
    concats = _input_concats(gm, placeholders, layouts)
    skipped = _read_only_by(placeholders, concats)
    written = input_mutations(gm)
    # In place on one CPU device, or one CUDA device when the twins are on: their fence and
    # ordered calls are what release a GPU holder's array after torch's stream passes.
    in_place = (mesh_id is None and torch_device is not None and _inplace.enabled()
                and (device.platform == "cpu" or (device.platform == "cuda" and _twins.enabled())))
    laid = (_channels_last.plan_channels_last(gm, example_inputs, device.platform, mesh_id) if channels_last
            else _channels_last.NONE)
    cpu_single = mesh_id is None and device.platform == "cpu"
    few_rows = _linalg.few_row_matmuls(gm) if few_row_kernel and cpu_single else frozenset()
    weight_lhs = (_linalg.weight_lhs_matmuls(gm) - few_rows if linear_weight_lhs and cpu_single else frozenset())
    wide = (_linalg.widened_weights(gm, example_inputs, None if widened_weights == "always" else _linalg.WIDEN_MAX_BYTES)
            if widened_weights and cpu_single else frozenset())
    kn = (_linalg.kn_weights(gm, example_inputs, always=linear_weights_kn == "always", weight_lhs=weight_lhs | few_rows)
          if linear_weights_kn and mesh_id is None else frozenset())
    inputs = []
    for i, (layout, ex) in enumerate(zip(layouts, example_inputs)):
        if layout.kind in (InputKind.SYMINT, InputKind.TOKEN):
            inputs.append(layout)
            continue
        if layout.kind is InputKind.SCALAR:  # made a 0-d CPU tensor per call (plan_executor)
            cpu = torch.device("cpu")
            inputs.append(InputPlan(InputKind.SCALAR, None, cpu, _move(cpu, device, torch_device)))
            continue
        node = placeholders[i]
        spec = shardings.spec(node) if shardings is not None else None
        # A dense written input whose new contents have its shape and dtype may be written in place.
        writable = (layout.kind is InputKind.TENSOR and i not in skipped and node in written
                    and _same_value_type(node, written[node]))
        if shardings is not None:
            # Replicated ones are not donated: their new contents reach torch as device 0's
            # buffer itself (zero-copy), which must then outlive the next call.
            donated = (writable and shardings.spec(written[node]) == spec
                       and not mesh_by_id(mesh_id).named_sharding(spec).is_fully_replicated)
        else:
            # One device: the executable writes the new contents where the input's buffer is
            # (runtime/inplace.py), when that buffer is XLA's own (a view torch holds over an
            # earlier result); torch's memory otherwise.
            donated = (writable and in_place and ex.device == torch_device and i not in host_inputs
                       and ex.numel() > 0 and _inplace.viewable(ex.dtype))
        steady = i in resident and not donated and node not in written and ex.device == torch_device
        weight = steady and node in laid.weights
        # (Only where the convolution is torch's: a dtype its kernels compute, natively or widened.)
        pinned = (pinned_weights and weight and i not in skipped
                  and _torch_kernels.convolution_dtype(ex.dtype) is not None)
        if relaid_weights and weight and layout.kind is InputKind.TENSOR:
            # Converted to the layout torch's convolution reads once, not by the executable on
            # every call.
            layout = InputPlan(InputKind.RELAID, _channels_last.TO_LAST)
        elif steady and node in kn and layout.kind is InputKind.TENSOR:
            # nn.Linear's weight laid out [in, out] once: XLA:CPU's float32 dot is faster so.
            layout = InputPlan(InputKind.RELAID, (1, 0))
        elif steady and node in wide and layout.kind is InputKind.TENSOR and i not in host_inputs:
            # XLA:CPU's half-precision dot would convert the weight to float32 on every call.
            layout = InputPlan(InputKind.WIDENED)
        # A donated buffer is consumed by each call: never kept resident.
        inputs.append(InputPlan(layout.kind, layout.perm, ex.device, _move(ex.device, device, torch_device),
                                resident=i in resident and not donated, passed=i not in skipped,
                                sharding=spec, donated=donated,
                                memory_kind=host_kind if i in host_inputs and i not in skipped else None,
                                bump=int(i in bumps), pinned=pinned))
    seed = graph_uses_randomness(gm)
    if in_place and device.platform != "cpu" and not seed and not any(map(orders_after_torch, inputs)):
        # A GPU call that donates must be ordered after torch's stream by importing an input
        # it does not write (or its seed): with none, its written inputs are swapped in.
        inputs = [dataclasses.replace(p, donated=False) if p.donated else p for p in inputs]
    seed_device = torch_device if torch_device is not None else torch.device("cpu")

    constants = constant_values(gm)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_vals = list(output_node.args[0]) if isinstance(output_node.args[0], (list, tuple)) else [output_node.args[0]]
    # (An int passed as a value and returned, a forward's for its backward, is returned as the
    # call's argument: OutputKind.INPUT.)
    tensor_inputs = {n: i for i, (n, p) in enumerate(zip(placeholders, inputs)) if p.kind not in NOT_TENSORS}
    concat_index = {node: j for j, (node, _) in enumerate(concats)}
    results: list[ResultPlan] = []
    outputs: list[OutputPlan] = []
    base_result: dict = {}  # base node -> result index, for outputs that are views of it

    def result(node, perm=None, home=None, memory=None) -> int:
        spec = shardings.spec(node) if shardings is not None else None
        results.append(ResultPlan(node, perm, home, _move(home, device, torch_device), spec, memory))
        return len(results) - 1

    # How many outputs read each computed base through views: a base only one output reads, as
    # a view that keeps its bytes in order (a reshape), leaves the executable as that output.
    view_bases: dict = {}
    for v in out_vals:
        if isinstance(v, torch.fx.Node):
            base = _view_chain(v)[0]
            view_bases[base] = view_bases.get(base, 0) + 1

    for j, v in enumerate(out_vals):
        memory = host_kind if j in host_outputs else None
        if not isinstance(v, torch.fx.Node) or v in tokens:  # (AOTAutograd drops returned tokens)
            outputs.append(OutputPlan(OutputKind.CONST, value=None if v in tokens else v))
            continue
        meta = v.meta.get("val")
        base, views = _view_chain(v)
        if base in tensor_inputs:  # an input or a view of one: no copy through XLA
            outputs.append(OutputPlan(OutputKind.INPUT, index=tensor_inputs[base], views=views, device=_device(meta)))
            continue
        if base in concat_index:  # weights stacked in torch before the call
            outputs.append(OutputPlan(OutputKind.CONCAT, index=concat_index[base], views=views, device=_device(meta)))
            continue
        if not isinstance(meta, torch.Tensor):  # a size, a Python value, or None
            outputs.append(OutputPlan(OutputKind.CONST, value=meta))
            continue
        base_meta = base.meta.get("val")
        if views and view_bases[base] == 1 and _reshape_of(meta, base_meta) and base not in constants:
            # A reshape of a value nothing else returns (a bias gradient summed to [1, n] then
            # viewed as [n], a permutation undone): XLA's reshape is free, and the output then
            # is the executable's result itself (no view op in torch, and a twin, runtime/twins.py).
            outputs.append(OutputPlan(OutputKind.TENSOR, index=result(v, home=meta.device, memory=memory), device=meta.device))
            continue
        if (views or view_bases[base] > 1) and isinstance(base_meta, torch.Tensor) \
                and not symbolic(base_meta.shape) and base_meta.is_contiguous() and base not in constants:
            # Views of one computed value (per-layer gradients of stacked weights), the value
            # itself among them or not: it leaves the executable once, the views are taken in
            # torch, so they share its memory as eager's outputs do.
            if (base, memory) not in base_result:
                base_result[(base, memory)] = result(base, home=base_meta.device, memory=memory)
            outputs.append(OutputPlan(OutputKind.TENSOR, index=base_result[(base, memory)], views=views, device=meta.device))
            continue
        if j in saved and v in laid.physical and meta.dim() == 4 and not symbolic(meta.shape) \
                and meta.numel() > 1 and meta.is_contiguous() and memory is None:
            # An activation the backward reads, left as XLA computed it (NHWC); the backward
            # takes it so (AOTAutograd hands it the strides reported for it).
            outputs.append(OutputPlan(OutputKind.TENSOR, index=result(v, _channels_last.TO_LAST, meta.device),
                                      inv_perm=_channels_last.TO_FIRST, device=meta.device))
            continue
        if meta.dim() > 1 and not symbolic(meta.shape) and meta.numel() > 1 and not meta.is_contiguous():
            shape, stride = tuple(meta.shape), tuple(meta.stride())
            perm = dense_permutation(shape, stride)
            if perm is not None and not is_identity(perm):
                outputs.append(OutputPlan(OutputKind.TENSOR, index=result(v, perm, meta.device, memory), inv_perm=inverse(perm),
                                          device=meta.device))
            else:
                outputs.append(OutputPlan(OutputKind.TENSOR, index=result(v, home=meta.device, memory=memory), stride=stride,
                                          device=meta.device))
            continue
        outputs.append(OutputPlan(OutputKind.TENSOR, index=result(v, home=meta.device, memory=memory), device=meta.device))
    mutations = []
    for dst, node in written.items():  # the inputs' new contents, after the outputs
        position = placeholders.index(dst)
        mutations.append(Mutation(position, result(node, home=inputs[position].device, memory=inputs[position].memory_kind)))
    regions = ()
    if elementwise_regions and cpu_single and offload is None:
        # A donated input's update is written where the input is (the region's loop writes an
        # element's results after reading its inputs).
        donated_writes = {dst: node.args[1] for dst, node in written.items()
                          if inputs[placeholders.index(dst)].donated}
        regions = tuple(_regions.with_aliases(r, donated_writes)
                        for r in _regions.find_regions(gm, exclude=frozenset(constants) | frozenset(laid.nodes)))
    return GraphPlan(device, torch_device, inputs, concats, seed, seed_device, results, outputs, mutations, constants,
                     mesh_id, shardings, constraints, operand_constraints, laid, weight_lhs, few_rows, regions)


def _reshape_of(meta, base_meta) -> bool:
    """Whether tensor `meta` holds `base_meta`'s bytes in the same order: both static, dense and
    row-major, of one dtype and size (a view chain that only reshapes)."""
    return (isinstance(meta, torch.Tensor) and isinstance(base_meta, torch.Tensor)
            and not symbolic(meta.shape) and not symbolic(base_meta.shape) and meta.dtype == base_meta.dtype
            and meta.numel() == base_meta.numel() and meta.is_contiguous() and base_meta.is_contiguous()
            and meta.storage_offset() == 0 and base_meta.storage_offset() == 0)


def _same_value_type(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    ma, mb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(ma, torch.Tensor) and isinstance(mb, torch.Tensor) and ma.dtype == mb.dtype
            and not symbolic(ma.shape) and tuple(ma.shape) == tuple(mb.shape))


def _mesh_device(mesh_id: int, example_inputs) -> Device:
    """This process's first device of a graph's mesh, as the plan's device; tensors of another platform
    than the mesh's are refused (they would be moved device by device behind the user's back)."""
    mesh = mesh_by_id(mesh_id)
    for ex in example_inputs:
        if isinstance(ex, torch.Tensor) and ex.device.type not in ("cpu", "meta") and ex.device.type != mesh.platform:
            raise ShardingError(f"fx2xla: a {ex.device} tensor in a graph sharded over {mesh}")
    # Over several processes: this process's first device of the mesh.
    local = {d.id for d in get_backend(mesh.platform).local_devices()}
    first = next((d for d in mesh.devices.flat if d.id in local), None)
    if first is None:
        raise ShardingError(f"fx2xla: {mesh} has none of this process's devices "
                            f"({', '.join(map(str, sorted(local)))}); each process must hold a part of the mesh")
    return Device(mesh.platform, torch_index(first))


def _device(meta):
    return meta.device if isinstance(meta, torch.Tensor) else None


# -- A plan as a package stores it ----------------------------------------------------------
# A package (package.py) keeps the node-free part of a plan in its manifest: what the executor
# needs to call the executable again in another process, on the device the package is loaded
# on. Output constants and view arguments are stored as JSON numbers, lists and dtype names.

def plan_record(plan: GraphPlan) -> dict:
    """The JSON form of `plan`'s calling convention (a one-device plan without torch-side
    concatenations; its outputs are stored per specialization, see `outputs_record`)."""
    if plan.mesh_id is not None or plan.concats:
        raise TypeError("only a one-device plan without torch-side concatenations can be stored")
    return {"inputs": [{"kind": p.kind, "perm": None if p.perm is None else list(p.perm), "resident": p.resident,
                        "passed": p.passed, "donated": p.donated, "pinned": p.pinned} for p in plan.inputs],
            "results": len(plan.results), "mutations": [list(m) for m in plan.mutations], "seed": plan.seed}


def plan_from_record(record: dict, device: Device, outputs: list[OutputPlan]) -> GraphPlan:
    """The plan `plan_record` stored, on `device` (every input and result lives there: a
    loaded model moves its inputs to its device before the call)."""
    home = device.torch_device
    inputs = [InputPlan(InputKind(p["kind"]), None if p["perm"] is None else tuple(p["perm"]),
                        None if p["kind"] in NOT_TENSORS else home, Move.NONE, p["resident"], p["passed"],
                        donated=p.get("donated", False), pinned=p.get("pinned", False))
              for p in record["inputs"]]
    results = [ResultPlan(None, device=home) for _ in range(record["results"])]
    return GraphPlan(device, home, inputs, [], record["seed"], home, results, list(outputs),
                     [Mutation(*m) for m in record["mutations"]])


def outputs_record(outputs: list[OutputPlan]) -> list:
    """The JSON form of one specialization's output plans (sizes resolved); TypeError names a
    value JSON cannot hold."""
    return [{"kind": o.kind, "index": o.index, "inv_perm": json_value(o.inv_perm), "stride": json_value(o.stride),
             "value": json_value(o.value), "views": [[_op_name(op), json_value(args)] for op, args in o.views]}
            for o in outputs]


def outputs_from_record(record: list) -> list[OutputPlan]:
    return [OutputPlan(OutputKind(o["kind"]), o["index"], _tuple(o["inv_perm"]), _tuple(o["stride"]),
                       from_json(o["value"]), tuple((_op(name), tuple(from_json(args))) for name, args in o["views"]))
            for o in record]


def json_value(v):
    """`v` (a number, string, None, dtype, or a list or tuple of them) as JSON holds it."""
    if isinstance(v, (tuple, list)):
        return [json_value(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    raise TypeError(f"an output or view argument {v!r} ({type(v).__name__}) cannot be stored")


def from_json(v):
    if isinstance(v, list):
        return [from_json(x) for x in v]
    if isinstance(v, dict) and "dtype" in v:
        return getattr(torch, v["dtype"])
    return v


def _tuple(v):
    return tuple(v) if v is not None else None


def _op_name(op) -> str:
    return f"{op.namespace}.{op._schema.name.split('::')[1]}.{op._overloadname}"


def _op(name: str):
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)
