"""What a sharded graph does: the collectives in its optimized HLO (`collectives`), which
compiled object each graph belongs to (`graphs_of`), and `explain_sharding`."""
from __future__ import annotations

import math
import re
import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..metrics import is_compiled_graph, live_graphs
from ..runtime.executor import optimized_hlo_text
from .specs import Mesh, describe_spec, is_mark

# -- explain ---------------------------------------------------------------------------------

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
              "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclass(frozen=True)
class Collective:
    """One collective in an optimized HLO module: op, result type (per device), bytes of the
    result, and the devices in each of its groups (0: not read from the HLO)."""

    op: str
    type: str
    bytes: int
    group: int = 0

    @property
    def moved(self) -> float:
        """Bytes each device sends by a ring over its group: what the auto-sharding cost model
        prices. An all-reduce moves 2 (n-1)/n of its result, an all-gather or all-to-all
        (n-1)/n, a reduce-scatter (n-1) times its result (a 1/n share of its operand), a
        permute its result. Unknown group: the result's bytes."""
        n = self.group
        if n == 1:
            return 0.0
        if n < 1 or self.op == "collective-permute":
            return float(self.bytes)
        share = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1}.get(self.op, (n - 1) / n)
        return self.bytes * share


def collectives(hlo_text: str) -> list[Collective]:
    """The collectives XLA's partitioner put in an optimized (per-device) HLO module, with the
    bytes of each result (async pairs are counted once, at their start)."""
    pattern = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(")
    found = []
    for line in hlo_text.splitlines():
        # A long tuple's shape numbers its elements in comments, "/*index=5*/", whose "=" would
        # end the match early and drop the shapes before it.
        m = pattern.search(re.sub(r"/\*.*?\*/", "", line))
        if m is None:
            continue
        types = re.findall(r"([a-z]+\d*)\[([\d,]*)\]", m.group(1))
        sizes = [_HLO_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in types]
        # An async start returns (operand, result, ...): its last shape is the result.
        nbytes = sizes[-1] if m.group(3) and sizes else sum(sizes)
        found.append(Collective(m.group(2), m.group(1).strip(), nbytes, _group_size(line)))
    return found


def _group_size(line: str) -> int:
    """The devices in each replica group of an HLO collective, in any of the forms XLA prints:
    `mesh['x'=2,'y'=4] {'y'}` (the named axes' sizes), `[2,4]<=[8]` (groups x size, an iota),
    `{{0,1},{2,3}}` (explicit). 0 if there is none to read."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m is not None:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if m is not None:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m is not None:
        return len([d for d in m.group(1).split(",") if d])
    return 0


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def per_device_bytes(shape, spec, mesh: Mesh) -> int:
    parts = 1
    for axes in spec:
        parts *= math.prod(mesh.shape[a] for a in axes)
    return math.prod(shape) // parts if parts else 0


# -- which compiled object a graph belongs to --------------------------------------------------

# The graphs of one Dynamo compile share a name prefix ("g<frame>_<compile>_", see the backend's
# _graph_name); a backward graph, compiled later by autograd, has its forward's. Names repeat
# after torch._dynamo.reset(), so each prefix keeps a list of origins, newest last: the
# torch.compile context that was running (a weak reference), what it compiled in words, whether
# that is an optimizer's step, and which graphs are its: those of the prefix made after it was
# noted (the live ones then are `before`), until the prefix is noted again (then fixed, `mine`).
_origins: dict = {}


@dataclass
class _Origin:
    ctx: Any
    label: str
    optimizer: bool
    before: Any
    mine: Any = None

    def owns(self, g) -> bool:
        return g in self.mine if self.mine is not None else g not in self.before


def note_compile_origin(prefix: str) -> None:
    """Called by the backend as Dynamo hands it a graph (the graph names start with `prefix`):
    records which `torch.compile(...)` result is running, found as the innermost of Dynamo's
    compile wrappers on the Python stack (each result has its own context object)."""
    ctx_type = _dynamo_context_type()
    if ctx_type is None:
        return
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "compile_wrapper":
            local = f.f_locals
            ctx = local.get("self")
            if isinstance(ctx, ctx_type):
                try:
                    ref = weakref.ref(ctx)
                except TypeError:
                    return
                fn = local.get("fn")
                for k in list(_origins):  # contexts gone
                    _origins[k] = [o for o in _origins[k] if o.ctx() is not None]
                    if not _origins[k]:
                        del _origins[k]
                live = weakref.WeakSet(g for g in list(live_graphs) if g.name.startswith(prefix))
                entries = _origins.setdefault(prefix, [])
                if entries and entries[-1].mine is None:
                    last = entries[-1]
                    last.mine = weakref.WeakSet(g for g in live if g not in last.before)
                entries.append(_Origin(ref, _describe_callable(fn), _is_optimizer_step(fn), live))
                return
        f = f.f_back


def _origin_of(g):
    for prefix, entries in _origins.items():
        if g.name.startswith(prefix):
            return next((o for o in reversed(entries) if o.owns(g)), None)
    return None


def _dynamo_context_type():
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except ImportError:  # a torch without it: compiled objects are not recognised
        return None
    return _TorchDynamoContext


def _is_optimizer_step(fn) -> bool:
    return isinstance(getattr(fn, "__self__", None), torch.optim.Optimizer)


def _describe_callable(fn) -> str:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return f"{type(owner).__name__}"
    if owner is not None and not isinstance(owner, type(torch)):
        return f"{type(owner).__name__}.{getattr(fn, '__name__', '?')}"
    wrapped = getattr(fn, "__wrapped__", None)
    if isinstance(wrapped, torch.nn.Module):
        return type(wrapped).__name__
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _dynamo_context_of(obj):
    """The torch.compile context of what torch.compile returned (an OptimizedModule, or a
    compiled function or method); None for anything else."""
    ctx_type = _dynamo_context_type()
    if ctx_type is None:
        return None
    ctx = getattr(obj, "dynamo_ctx", None) if isinstance(obj, torch.nn.Module) else None
    if isinstance(ctx, ctx_type):
        return ctx
    if callable(obj) and hasattr(obj, "_torchdynamo_orig_callable"):
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, ctx_type):
                return value
    return None


def _role(g) -> str:
    """What a graph is, in words: forward, backward, optimizer step, inference; and of what."""
    origin = _origin_of(g)
    kind = next((k for k in ("forward", "backward", "inference") if f"_{k}" in g.name), "graph")
    if origin is None:
        return kind
    if origin.optimizer:
        return f"optimizer step ({origin.label})"
    return f"{kind} of {origin.label}"


def _graph_order(g):
    """Compile order: the numbers in the graph's name, forward before backward."""
    kinds = {"forward": 0, "backward": 1, "inference": 2}
    kind = next((v for k, v in kinds.items() if f"_{k}" in g.name), 3)
    return [int(n) for n in re.findall(r"\d+", g.name.split("_forward")[0].split("_backward")[0]
                                          .split("_inference")[0])], kind, g.name


def graphs_of(compiled) -> list:
    """The live fx2xla graphs (CompiledGraph) of what `torch.compile(..., backend="fx2xla")`
    returned: a compiled module's forward and backward graphs, a compiled function's or
    optimizer step's graphs, in compile order. Raises TypeError for anything that is not a
    compiled module or function."""
    ctx = _dynamo_context_of(compiled)
    if ctx is None:
        raise TypeError(f"fx2xla.explain_sharding: expected what torch.compile(..., backend=\"fx2xla\") returned "
                        f"(a compiled module, function or optimizer step), a CompiledGraph, a list of them, or None "
                        f"for every live sharded graph; got {type(compiled).__name__}")
    found = []
    for g in list(live_graphs):
        origin = _origin_of(g)
        if origin is not None and origin.ctx() is ctx:
            found.append(g)
    return sorted(found, key=_graph_order)


def explain_sharding(graph=None, file=None) -> str:
    """A report of how compiled graphs are sharded: per input and per result its spec, where
    the spec came from (user, propagated, default), bytes per device; the constraints inside;
    the collectives XLA's partitioner inserted (from the optimized HLO); each device's memory.
    `graph`: what `torch.compile(..., backend="fx2xla")` returned (a compiled module: its
    forward and backward graphs; a compiled function or optimizer step: its graphs), once it
    has run; a CompiledGraph; a list of any of these; or None for every live sharded graph.
    Each graph is named, with what it is (forward, backward, optimizer step) and of what.
    Printed to `file` when given; returned."""
    if graph is None:
        graphs = sorted((g for g in list(live_graphs) if g.mesh is not None), key=_graph_order)
    else:
        graphs = []
        for item in (list(graph) if isinstance(graph, (list, tuple)) else [graph]):
            if is_compiled_graph(item):
                graphs.append(item)
                continue
            found = graphs_of(item)
            if not found:
                what = _describe_callable(getattr(item, "_orig_mod", None) and item._orig_mod.forward
                                          or getattr(item, "_torchdynamo_orig_callable", item))
                ctx = _dynamo_context_of(item)
                if any(o.ctx() is ctx for entries in _origins.values() for o in entries):
                    raise ValueError(f"fx2xla.explain_sharding: the compiled {what} ran, but its fx2xla graphs are "
                                     f"gone (torch._dynamo.reset() or a recompile dropped them): call it again")
                raise ValueError(f"fx2xla.explain_sharding: the compiled {what} has no fx2xla graphs yet: call it "
                                 f"once first (torch.compile compiles at the first call; a training step's backward "
                                 f"graph at the first backward), with backend=\"fx2xla\"")
            graphs += [g for g in found if g not in graphs]
    lines = []
    for g in graphs:
        plan = g.plan
        role = _role(g)
        if g.mesh is None:
            lines.append(f"graph {g.name} ({role}): one device ({g.device}), not sharded")
            continue
        mesh, sh = g.mesh, plan.shardings
        lines.append(f"graph {g.name} ({role}) over {mesh}")
        solution = g.auto_sharding
        if solution is not None:
            origin = f" (reused from the {solution.cached} cache)" if getattr(solution, "cached", None) else ""
            lines.append(f"  auto-sharding{origin}: {solution.status} in {solution.seconds:.2f} s ({solution.variables} "
                         f"variables); predicted: {fmt_bytes(solution.collective_bytes)} of collectives per device, "
                         f"peak {fmt_bytes(solution.memory_bytes)} per device ({fmt_bytes(solution.input_bytes)} of "
                         f"inputs), ~{solution.objective * 1e3:.3f} ms"
                         + (f"; compiled peak {fmt_bytes(solution.xla_peak_bytes)} per device (XLA's memory analysis)"
                            if getattr(solution, "xla_peak_bytes", None) is not None else ""))
        placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
        names = g.input_names or [n.name for n in placeholders]
        rows = [("input", n, p.sharding, name) for n, p, name in zip(placeholders, plan.inputs, names) if p.passed]
        rows += [("result", r.node, r.sharding, r.node.name) for r in plan.results]
        rows += [("constraint", n, sh.spec(n), n.name) for n in g.gm.graph.nodes if is_mark(n)]
        width = max([24] + [len(r[3]) for r in rows])
        for kind, node, spec, name in rows:
            val = node.meta.get("val")
            shape = tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()
            dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "?"
            whole = math.prod(shape) * (val.element_size() if isinstance(val, torch.Tensor) else 0)
            mine = per_device_bytes(shape, spec, mesh) * (val.element_size() if isinstance(val, torch.Tensor) else 0)
            lines.append(f"  {kind:10s} {name:{width}s} {dtype:>8s}{list(shape)!s:>16s}  {describe_spec(spec):24s} "
                         f"{sh.source(node):10s} {fmt_bytes(mine)}/device of {fmt_bytes(whole)}")
        spec_ = g.static
        if spec_ is None:
            lines.append("  (dynamic shapes: collectives and memory per specialization, once compiled)")
            continue
        found = collectives(optimized_hlo_text(spec_.exe))
        if found:
            by_op: dict = {}
            for c in found:
                n, b = by_op.get(c.op, (0, 0))
                by_op[c.op] = (n + 1, b + c.bytes)
            lines.append("  collectives: " + ", ".join(f"{op} x{n} ({fmt_bytes(b)})" for op, (n, b) in by_op.items()))
            for c in found:
                lines.append(f"    {c.op:20s} {c.type}")
        else:
            lines.append("  collectives: none")
        stats = spec_.exe.get_compiled_memory_stats()
        lines.append(f"  memory per device: arguments {fmt_bytes(stats.argument_size_in_bytes)}, outputs "
                     f"{fmt_bytes(stats.output_size_in_bytes)}, temporaries {fmt_bytes(stats.temp_size_in_bytes)}")
    text = "\n".join(lines)
    if file is not None:
        print(text, file=file)
    return text
