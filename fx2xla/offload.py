"""Host offloading: values kept in the host memory of an accelerator instead of its own.

    y = fx2xla.place_to_host(x)      # inside compiled code: x's value, kept in host memory
    z = fx2xla.place_to_device(y)    # ... and brought back to the device when needed
    torch.compile(model, backend="fx2xla", options={"offload": "activations"})   # training
    torch.compile(opt.step, backend="fx2xla", options={"offload": "optimizer"})  # AdamW's moments
    print(fx2xla.explain_memory())   # each graph's bytes per memory kind

The two ops are `torch.library` custom ops (`fx2xla::place_to_host`, `fx2xla::place_to_device`)
that Dynamo and AOTAutograd carry as they are: eagerly each returns a copy of its input (an
identity on values); their gradients go the other way (the gradient of `place_to_host` is
`place_to_device` of the incoming gradient, and back). Compiled, they lower to XLA's memory
placement annotations (lowering/memory.py), and XLA's host-offload passes move the bytes.

`offload="activations"`: the forward's results that AOTAutograd saves for the backward are left
by the forward executable in host memory (`mhlo.memory_kind = "pinned_host"` on those results),
and the backward takes them as host-memory arguments, brought to the device where XLA schedules
the copy. Between the two, torch holds them as ordinary tensors (on the CPU client: views of the
host buffers themselves, zero-copy), and the backward receives the very host buffers the forward
left (no copy) unless something replaced the tensor in between. `offload="optimizer"`: the
optimizer state a compiled step writes (AdamW's moments, SGD's momentum buffers: written
inputs of a graph that also writes parameters, that are not parameters themselves) stays in host
memory between steps: the step takes it in host memory, XLA brings it to the device for the
update, and the new values are left in host memory.

Nothing here measures a saving: see `explain_memory` for what XLA compiled, and docs/offload.md.
"""
from __future__ import annotations

import math
import re
import warnings

import torch

from .errors import Fx2XlaError
from .metrics import is_compiled_graph, live_graphs
from .plan import input_mutations
from .runtime.executor import optimized_hlo_text
from .runtime.handoff import numpy_to_torch
from .sharding import fmt_bytes, mesh_by_id, per_device_bytes

# The memory kind host-offloaded values live in: jax's `jax.memory.Space.Host`, on accelerators
# and on the CPU client alike (which has "device", "pinned_host" and "unpinned_host").
HOST_KIND = "pinned_host"
# Values of the `offload` option (a string, or a list/tuple of them; None: no offloading).
OFFLOAD_VALUES = ("activations", "optimizer")


class OffloadError(Fx2XlaError, ValueError):
    """Host offloading cannot apply: the device has no host memory kind."""


# -- the ops -------------------------------------------------------------------------------------

@torch.library.custom_op("fx2xla::place_to_host", mutates_args=())
def _place_to_host(t: torch.Tensor) -> torch.Tensor:
    return t.clone()  # eagerly: the value (a custom op's result may not alias its input)


@torch.library.custom_op("fx2xla::place_to_device", mutates_args=())
def _place_to_device(t: torch.Tensor) -> torch.Tensor:
    return t.clone()


@_place_to_host.register_fake
def _(t):
    return torch.empty_like(t)


@_place_to_device.register_fake
def _(t):
    return torch.empty_like(t)


def _to_device_grad(ctx, grad):
    return torch.ops.fx2xla.place_to_device(grad)


def _to_host_grad(ctx, grad):
    return torch.ops.fx2xla.place_to_host(grad)


_place_to_host.register_autograd(_to_device_grad)
_place_to_device.register_autograd(_to_host_grad)

place_to_host_op = torch.ops.fx2xla.place_to_host.default
place_to_device_op = torch.ops.fx2xla.place_to_device.default
PLACEMENT_OPS = (place_to_host_op, place_to_device_op)


def place_to_host(t: torch.Tensor) -> torch.Tensor:
    """`t`'s value, kept in the device's host memory (memory kind "pinned_host") inside code
    compiled with fx2xla; `place_to_device` brings it back. Eagerly: a copy of `t`. Its
    gradient is `place_to_device` of the incoming gradient."""
    return torch.ops.fx2xla.place_to_host(t)


def place_to_device(t: torch.Tensor) -> torch.Tensor:
    """`t`'s value in the device's own memory (the inverse of `place_to_host`). Eagerly: a copy
    of `t`. Its gradient is `place_to_host` of the incoming gradient."""
    return torch.ops.fx2xla.place_to_device(t)


# -- options and devices ---------------------------------------------------------------------------

def parse_offload(value) -> frozenset:
    """The `offload` option as a set of OFFLOAD_VALUES; a clear error for anything else."""
    if value is None or value is False:
        return frozenset()
    values = (value,) if isinstance(value, str) else value
    try:
        chosen = frozenset(values)
    except TypeError:
        chosen = None
    if chosen is None or not chosen <= set(OFFLOAD_VALUES):
        raise ValueError(f"fx2xla: option offload={value!r}; expected None, "
                         f"{' or '.join(repr(v) for v in OFFLOAD_VALUES)}, or a list of them")
    return chosen


def memory_kinds(device) -> list[str]:
    """The memory kinds a runtime.Device offers (jax's `addressable_memories()`)."""
    try:
        return [m.kind for m in device.jax_device.addressable_memories()]
    except Exception:  # noqa: BLE001  (a PJRT plugin without memory spaces)
        return []


def require_host_memory(device, what: str) -> None:
    """Raise OffloadError naming `device` when it has no host memory kind for `what`."""
    kinds = memory_kinds(device)
    if HOST_KIND not in kinds:
        try:
            kind = f" ({device.kind})"
        except Exception:  # noqa: BLE001
            kind = ""
        raise OffloadError(f"fx2xla: {what} needs the {HOST_KIND!r} memory kind, and device {device}{kind} has "
                           f"none: its memory kinds are {kinds or 'not reported'}. Turn the option off "
                           f"(options={{'offload': None}}) or remove the placement ops for this device.")


def uses_placement(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in PLACEMENT_OPS for n in gm.graph.nodes)


def prepare_graph(gm: torch.fx.GraphModule) -> None:
    """A `place_to_host` value that graph ops read directly (not through `place_to_device`) is
    read through an inserted `place_to_device`: XLA's host offloading computes on device values
    only. Graph outputs are left as they are (their names tie forward and backward together);
    the lowering returns such a value in device memory unless the plan offloads it."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not place_to_host_op:
            continue
        readers = [u for u in node.users if u.op != "output"
                   and not (u.op == "call_function" and u.target is place_to_device_op)]
        if not readers:
            continue
        with gm.graph.inserting_after(node):
            back = gm.graph.call_function(place_to_device_op, (node,))
        back.meta = dict(node.meta)
        for u in readers:
            u.replace_input_with(node, back)
        changed = True
    if changed:
        gm.recompile()


# -- which values a training step offloads ---------------------------------------------------------

# The forward's offloaded results by compile id, until its backward is compiled: the backward's
# placeholders named as them take host memory.
_forward_offloads: dict = {}


def saved_outputs(gm: torch.fx.GraphModule, meta) -> set[int] | None:
    """Positions of a forward graph's outputs that AOTAutograd saves for the backward (tensors
    after the user's outputs, mutated inputs and intermediate bases); None without metadata."""
    try:
        start = len(meta.tokens or ()) + meta.num_forward
    except (AttributeError, TypeError):
        return None
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    return {j for j in range(start, len(outs))
            if isinstance(outs[j], torch.fx.Node) and isinstance(outs[j].meta.get("val"), torch.Tensor)}


def optimizer_state_inputs(gm: torch.fx.GraphModule, example_inputs, meta) -> set[int]:
    """Positions of the optimizer state an inference graph writes: floating tensors of one
    dimension or more that it writes and that are not parameters, in a graph that writes
    parameters too (an optimizer step; a step counter is 0-d and stays on the device)."""
    info = getattr(meta, "input_info", None)
    if info is None or len(info) != len(example_inputs):
        return set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = input_mutations(gm)
    positions = [i for i, n in enumerate(placeholders) if n in written]
    if not any(getattr(info[i], "requires_grad", False) for i in positions):
        return set()
    return {i for i in positions if not getattr(info[i], "requires_grad", False)
            and isinstance(example_inputs[i], torch.Tensor) and example_inputs[i].is_floating_point()
            and example_inputs[i].dim() >= 1}


def plan_offload(gm, example_inputs, kind: str, chosen: frozenset, device, key: str, meta):
    """(host input positions, host output positions) of a graph under option offload=`chosen`,
    or None when nothing is offloaded. Raises OffloadError where the device has no host memory."""
    if not chosen:
        return None
    require_host_memory(device, f"options={{'offload': {sorted(chosen) if len(chosen) > 1 else next(iter(chosen))!r}}}")
    inputs: set = set()
    outputs: set = set()
    if "activations" in chosen and kind == "forward":
        saved = saved_outputs(gm, meta)
        if saved is None:
            warnings.warn("fx2xla: offload='activations': AOTAutograd's metadata of this forward graph is "
                          "unavailable, so its saved activations are not known: kept in device memory", stacklevel=3)
        else:
            outputs |= saved
    if "activations" in chosen and kind == "backward":
        names = _forward_offloads.pop(key, set())
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        inputs |= {i for i, n in enumerate(placeholders) if n.name in names}
    if "optimizer" in chosen and kind == "inference":
        inputs |= optimizer_state_inputs(gm, example_inputs, meta)
    if not inputs and not outputs:
        return None
    return inputs, outputs


def note_forward(gm, plan, key: str) -> None:
    """Record the names of a forward's outputs its plan left in host memory, for its backward."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    names = {outs[j].name for j, p in enumerate(plan.outputs)
             if p.kind == "tensor" and plan.results[p.index].memory_kind is not None}
    if names:
        _forward_offloads[key] = names


# -- the call path -----------------------------------------------------------------------------------

def host_results(plan) -> list[int]:
    return [r for r, res in enumerate(plan.results) if res.memory_kind is not None]


def host_sharding(plan):
    """The jax sharding a one-device plan's host-memory inputs are handed over in."""
    from jax.sharding import SingleDeviceSharding

    return SingleDeviceSharding(plan.device.jax_device, memory_kind=HOST_KIND)


def host_export(export):
    """`export` for a result left in host memory: zero-copy through DLPack where the runtime
    allows it (the CPU client), else a copy into a CPU tensor (the values are what torch needs;
    the backward takes the host buffer itself, see CompiledGraph twins)."""
    refused = []

    def export_host(a):
        if not refused:
            try:
                return export(a)
            except Exception:  # noqa: BLE001  (a runtime whose DLPack has no host memory)
                refused.append(True)
        return numpy_to_torch(a)  # a copy: where DLPack refuses a host-memory Array

    return export_host


def make_host_launcher(exe, export, keep):
    """`launch(bufs)` for a one-device executable some of whose results live in host memory:
    every result as a torch tensor (`export`: one function, or one per result; the host results'
    through host_export), then the jax Arrays of results `keep`, as make_sharded_launcher keeps
    them (CompiledGraph records them as twins of the tensors, for the backward or the next step)."""
    execute = exe.execute
    keep = list(keep)
    exports = None

    def launch_host(bufs: list) -> list:
        nonlocal exports
        outs = execute(bufs)
        if exports is None:
            each = list(export) if isinstance(export, (list, tuple)) else [export] * len(outs)
            exports = [host_export(e) if r in keep else e for r, e in enumerate(each)]
        torch_outs = [e(o) for e, o in zip(exports, outs)]
        torch_outs += [outs[r] for r in keep]
        return torch_outs

    return launch_host


def offload_per_call(plan, example_inputs) -> tuple[int, int]:
    """(bytes a call leaves in host memory, bytes it takes from host memory): the host results'
    and host inputs' sizes (per device for a sharded graph: its shards; 0 for symbolic sizes)."""
    def size(meta, spec) -> int:
        if not isinstance(meta, torch.Tensor) or any(isinstance(s, torch.SymInt) for s in meta.shape):
            return 0
        shape = tuple(int(s) for s in meta.shape)
        if spec is not None and plan.mesh_id is not None:
            return per_device_bytes(shape, spec, mesh_by_id(plan.mesh_id)) * meta.element_size()
        return math.prod(shape) * meta.element_size()

    out = sum(size(r.node.meta.get("val"), r.sharding) for r in plan.results if r.memory_kind is not None)
    back = sum(size(ex, p.sharding) for p, ex in zip(plan.inputs, example_inputs) if p.memory_kind is not None)
    return out, back


# -- seeing it ---------------------------------------------------------------------------------------

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
             "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\](?:\{([^}]*)\})?")
# XLA's memory space numbers in layouts (`{1,0:S(5)}`): 0 is the device's, 5 its host memory.
_SPACES = {0: "device", 5: HOST_KIND}


def entry_layout(hlo_text: str) -> str:
    """The entry computation layout of an optimized HLO module's text (`(params)->results`, each
    array with its layout and memory space), or "" where the text has none."""
    m = re.search(r"entry_computation_layout=\{", hlo_text)
    if m is None:
        return ""
    depth, i = 1, m.end()
    while i < len(hlo_text) and depth:
        depth += {"{": 1, "}": -1}.get(hlo_text[i], 0)
        i += 1
    return hlo_text[m.end():i - 1]


def layout_bytes(part: str) -> dict:
    """{memory kind: bytes} of the arrays in one side of an entry computation layout."""
    found: dict = {}
    for dtype, dims, layout in _SHAPE.findall(part):
        if dtype not in _ITEMSIZE:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[dtype]
        space = re.search(r"S\((\d+)\)", layout or "")
        number = int(space.group(1)) if space else 0
        kind = _SPACES.get(number, f"memory space {number}")
        found[kind] = found.get(kind, 0) + n
    return found


def memory_by_kind(graph) -> dict | None:
    """What XLA compiled for a CompiledGraph (None before it has an executable, e.g. dynamic
    shapes): {"arguments": {kind: bytes}, "results": {kind: bytes}} from the optimized module's
    entry computation layout (XLA's memory space of each parameter and result), "xla": XLA's
    memory analysis (`get_compiled_memory_stats()`, its device and host_* fields; None where the
    runtime has none), "plan": the bytes the plan offloads per call (left in, taken from host)."""
    spec = getattr(graph, "static", None)
    if spec is None:
        return None
    layout = entry_layout(optimized_hlo_text(spec.exe))
    params, _, results = layout.partition("->")
    try:
        stats = spec.exe.get_compiled_memory_stats()
    except Exception:  # noqa: BLE001
        stats = None
    fields = None
    if stats is not None:
        fields = {k: int(getattr(stats, k)) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "host_argument_size_in_bytes", "host_output_size_in_bytes", "host_alias_size_in_bytes",
            "host_temp_size_in_bytes") if hasattr(stats, k)}
    per_call = getattr(graph, "offload_per_call", (0, 0))
    return {"arguments": layout_bytes(params), "results": layout_bytes(results), "xla": fields,
            "plan": {"offloaded": per_call[0], "reloaded": per_call[1]}}


def explain_memory(graph=None, file=None) -> str:
    """A report, per compiled graph, of its bytes per memory kind: XLA's memory analysis of the
    executable (device and host fields as the runtime reports them), the memory kind XLA compiled
    each argument and result into (its entry computation layout), and which values fx2xla
    offloaded. `graph`: a CompiledGraph, a list of them, or None for every live graph. Printed to
    `file` when given; returned."""
    if graph is None:
        graphs = sorted(live_graphs, key=lambda g: g.name)
    else:
        graphs = list(graph) if isinstance(graph, (list, tuple)) else [graph]
    if not all(is_compiled_graph(g) for g in graphs):
        raise TypeError("fx2xla.explain_memory: expected compiled graphs (or None for all)")
    lines = []
    for g in graphs:
        where = f"over {g.mesh}" if g.mesh is not None else f"on {g.device}"
        lines.append(f"graph {g.name} {where}")
        info = memory_by_kind(g)
        if info is None:
            lines.append("  (dynamic shapes: memory per specialization, once compiled)")
            continue
        xla = info["xla"]
        if xla is None:
            lines.append("  XLA's memory analysis: not available on this runtime")
        else:
            lines.append(f"  XLA's memory analysis (per device): device: arguments "
                         f"{fmt_bytes(xla['argument_size_in_bytes'])}, results {fmt_bytes(xla['output_size_in_bytes'])}, "
                         f"aliased {fmt_bytes(xla['alias_size_in_bytes'])}, "
                         f"temporaries {fmt_bytes(xla['temp_size_in_bytes'])}; host: arguments "
                         f"{fmt_bytes(xla.get('host_argument_size_in_bytes', 0))}, results "
                         f"{fmt_bytes(xla.get('host_output_size_in_bytes', 0))}, temporaries "
                         f"{fmt_bytes(xla.get('host_temp_size_in_bytes', 0))}")
        for side in ("arguments", "results"):
            kinds = info[side]
            lines.append(f"  {side} by memory kind (XLA's compiled layout, per device): "
                         + (", ".join(f"{k} {fmt_bytes(b)}" for k, b in sorted(kinds.items())) or "none"))
        host_layout = sum(b for side in ("arguments", "results") for k, b in info[side].items() if k != "device")
        host_xla = sum(v for k, v in (xla or {}).items() if k.startswith("host_"))
        if host_layout and xla is not None and not host_xla:
            lines.append(f"  note: this runtime's memory analysis counts host-memory buffers with the device's "
                         f"({g.device.platform}: its host_* fields are 0)")
        plan = g.plan
        placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
        offloaded = [f"input {n.name}" for n, p in zip(placeholders, plan.inputs) if p.memory_kind is not None]
        offloaded += [f"result {r.node.name}" for r in plan.results if r.memory_kind is not None]
        if offloaded:
            lines.append(f"  in host memory ({HOST_KIND}): {len(offloaded)} value(s), "
                         f"{fmt_bytes(info['plan']['offloaded'])} "
                         f"left there and {fmt_bytes(info['plan']['reloaded'])} taken from there per call: "
                         + ", ".join(offloaded[:12]) + (f", ... ({len(offloaded) - 12} more)" if len(offloaded) > 12 else ""))
    text = "\n".join(lines) if lines else "no compiled graphs"
    if file is not None:
        print(text, file=file)
    return text
