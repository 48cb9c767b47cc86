"""Scan-folding: a run of structurally identical layers becomes one loop over stacked weights.

Runs on Dynamo's graph, before AOTAutograd. Layers are found through the `nn_module_stack`
Dynamo records on every node: the nodes of `...layers.0`, `...layers.1`, ... (children of a
ModuleList or Sequential) form one segment each. Consecutive segments that are isomorphic
(same ops, same literal arguments, same shapes and dtypes; inputs either shared by all layers,
threaded from one layer to the next, or per-layer like weights) are replaced by torch's `scan`
higher-order op over the weights stacked with `torch.stack`. AOTAutograd then differentiates
the loop like any user code (its backward is another scan, gradients reach every layer's own
weights through the stack), and the lowering turns each scan into one StableHLO `while`.

Calls of a `torch.compiler.nested_compile_region` (invoke_subgraph nodes, one traced body for
every call) are matched first and need no module numbering: a run of consecutive calls of one
region with nothing between them folds the same way, the body inlined into the loop body.

Random ops (dropout) fold too: each iteration draws its own bits (the lowering folds the
iteration into the key), and the backward reads the masks the forward saved, as unrolled.

Where layers differ, or a layer reads another layer's intermediates, nothing is folded and a
note (logged at debug level, dumped with the graph) says why.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx

from .manager import PassResult, register_pass

# "L['self'].model.layers.3" or "L['self'].layers[3]": a numbered child of a container module.
_NUMBERED = re.compile(r"^(?P<prefix>.+?)(?:\.(?P<a>\d+)|\[(?P<b>\d+)\])$")
# Shallow stacks stay unrolled by default: on XLA:CPU a folded 4-layer GPT-2 compiles barely
# faster (0.83 vs 0.95 s) and each call may pay a few percent for the per-iteration copies of
# its weight slices; from ~12 layers on, folding compiles 1.8-6x faster and the first call is
# 1.5x shorter (bench/scan.py). `options={"scan_min_layers": 2}` folds any run of two or more.
MIN_LAYERS = 8
MAX_NESTING = 4  # numbered modules inside numbered modules: tried outermost first

def _layer_key(node: torch.fx.Node, level: int = 0):
    """(container path, index) of the `level`-th numbered module (outermost first) `node`
    runs in, or None."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        m = _NUMBERED.match(path)
        if m:
            if level == 0:
                return m["prefix"], int(m["a"] if m["a"] is not None else m["b"])
            level -= 1
    return None


def _meta(value):
    """A comparable summary of an example value: shape, dtype and strides for tensors."""
    if isinstance(value, torch.Tensor):  # not requires_grad: layer 0's input may not need grad
        return ("T", tuple(str(s) for s in value.shape), value.dtype,
                tuple(str(s) for s in value.stride()) if value.layout == torch.strided else None)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_meta(v) for v in value))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("S", str(value))
    if value is None or isinstance(value, (int, float, bool, str, torch.dtype, torch.device)):
        return ("C", value)
    return ("O", type(value).__name__)


def _node_meta(node):
    return _meta(node.meta.get("example_value"))


class _Mismatch(Exception):
    pass


_INVOKE = torch.ops.higher_order.invoke_subgraph


def _is_region_attr(node: torch.fx.Node) -> bool:
    """A get_attr holding the body of a `torch.compiler.nested_compile_region`, read only as
    the subgraph of invoke_subgraph calls."""
    return node.op == "get_attr" and bool(node.users) and all(
        u.op == "call_function" and u.target is _INVOKE and u.args[0] is node for u in node.users)


def _region_members(node: torch.fx.Node) -> list | None:
    """The nodes of one region call `node` (its subgraph get_attr when read by it alone, the
    call, the getitems of its results), or None when its results are read otherwise."""
    members = []
    attr = node.args[0]
    if isinstance(attr, torch.fx.Node) and _is_region_attr(attr) and len(attr.users) == 1:
        members.append(attr)
    members.append(node)
    for u in node.users:
        if not (u.op == "call_function" and u.target is operator.getitem):
            return None
        members.append(u)
    return members


def _writes_inputs(body: torch.fx.GraphModule) -> bool:
    """Whether a region's body updates one of its inputs in place (BatchNorm's statistics, an
    `x.add_()`). Such a body can be neither a scan body nor, under autograd, an invoke_subgraph
    (torch refuses both). An input already written before the call counts too: conservative,
    it only costs the fold."""
    return any(_written(p) for p in body.graph.find_nodes(op="placeholder"))


def _written(node: torch.fx.Node) -> bool:
    """Whether the graph updates input `node` in place: Dynamo ran the graph's ops on the fake
    tensors it records, whose version counters then moved."""
    value = node.meta.get("example_value")
    if node.op not in ("placeholder", "get_attr") or not isinstance(value, torch.Tensor):
        return False
    try:
        return value._version > 0
    except RuntimeError:  # an inference tensor keeps no version counter
        return False


def _calls_to_inline(gm: torch.fx.GraphModule) -> list:
    """Region calls whose body writes its inputs: they are inlined (the graph Dynamo would have
    traced without the region), each as [call, its getitems]."""
    calls, verdict = [], {}
    for node in gm.graph.nodes:
        if not (node.op == "call_function" and node.target is _INVOKE):
            continue
        attr = node.args[0]
        if not (isinstance(attr, torch.fx.Node) and attr.op == "get_attr"):
            continue
        if attr.target not in verdict:
            body = _attr(gm, attr.target)
            verdict[attr.target] = _writes_inputs(body) and _inlinable(body)
        if verdict[attr.target]:
            calls.append([node, *(u for u in node.users
                                  if u.op == "call_function" and u.target is operator.getitem)])
    return calls


def _inlinable(body: torch.fx.GraphModule) -> bool:
    return not any(n.op == "call_module" or (n.op == "get_attr" and not _is_region_attr(n))
                   for n in body.graph.nodes)


def _region_runs(gm: torch.fx.GraphModule, claimed: set, min_layers: int):
    """Maximal runs of consecutive calls of one nested_compile_region with nothing between
    them: [(identifier, [node lists])]. Exact: every call runs the very same traced body."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    runs, current, last_end = [], [], None

    def close():
        if len(current) >= min_layers:
            runs.append((current[0][0], [nodes for _, nodes in current]))

    for node in gm.graph.nodes:
        if not (node.op == "call_function" and node.target is _INVOKE) or node in claimed:
            continue
        members = _region_members(node)
        if members is None or any(m in claimed for m in members):
            close()
            current = []
            continue
        members.sort(key=order.__getitem__)
        span = [order[m] for m in members]
        contiguous = span == list(range(span[0], span[0] + len(span)))
        ident = node.args[1]
        if not (contiguous and current and current[-1][0] == ident and last_end + 1 == span[0]):
            close()
            current = []
        if contiguous:  # (a call whose nodes are interleaved with others starts no run)
            current.append((ident, members))
            last_end = span[-1]
    close()
    return runs


@dataclass
class _Segment:
    nodes: list
    position: dict  # node -> index within the segment
    structure: list
    externals: list  # nodes outside the segment it reads, in order of first use


def _literal(a):
    if isinstance(a, float) and a != a:
        return ("nan",)
    try:
        hash(a)
        return (type(a).__name__, a)
    except TypeError:
        return ("id", id(a))


def _segment(nodes: list) -> _Segment:
    position = {n: i for i, n in enumerate(nodes)}
    externals: list = []
    ext_index: dict = {}

    def enc(a):
        if isinstance(a, torch.fx.Node):
            if a not in position and _is_region_attr(a):  # a region body shared by the calls
                return ("attr", a.target)
            if a in position:
                return ("n", position[a])
            if a not in ext_index:
                ext_index[a] = len(externals)
                externals.append(a)
            return ("e", ext_index[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(enc(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, enc(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", enc(a.start), enc(a.stop), enc(a.step))
        return _literal(a)

    structure = [(n.op, n.target, enc(n.args), enc(n.kwargs), _node_meta(n)) for n in nodes]
    return _Segment(nodes, position, structure, externals)


def _runs(gm: torch.fx.GraphModule, level: int, claimed: set, min_layers: int = MIN_LAYERS):
    """Maximal runs of consecutive layer segments of one container, numbered modules nested
    `level` deep: [(prefix, [node lists], indices)]. Nodes in `claimed` break runs."""
    pieces = []  # (key, nodes) with consecutive equal keys merged
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        key = None if node in claimed else _layer_key(node, level)
        if pieces and pieces[-1][0] == key:
            pieces[-1][1].append(node)
        else:
            pieces.append((key, [node]))
    seen_pieces: dict = {}
    for key, _ in pieces:
        if key is not None:
            seen_pieces[key] = seen_pieces.get(key, 0) + 1
    runs, current = [], []
    for key, nodes in pieces:
        ok = key is not None and seen_pieces[key] == 1  # a layer split in two never folds
        if ok and current and current[-1][0][0] == key[0] and current[-1][0][1] + 1 == key[1]:
            current.append((key, nodes))
            continue
        if len(current) >= min_layers:
            runs.append(current)
        current = [(key, nodes)] if ok else []
    if len(current) >= min_layers:
        runs.append(current)
    return [(run[0][0][0], [nodes for _, nodes in run], [k[1] for k, _ in run]) for run in runs]


@dataclass
class _Plan:
    segments: list
    carries: list  # (external position, output position within a segment)
    xs: list  # external positions whose value differs per layer (weights)
    invariants: list  # external positions shared by all layers
    ys: list  # output positions read after the loop (stacked per layer)
    body: torch.fx.GraphModule | None = None


def _plan(segments: list[_Segment]) -> _Plan:
    first = segments[0]
    for k, seg in enumerate(segments[1:], 1):
        if len(seg.nodes) != len(first.nodes) or len(seg.externals) != len(first.externals):
            raise _Mismatch(f"layer {k} has {len(seg.nodes)} nodes and {len(seg.externals)} inputs, "
                            f"layer 0 {len(first.nodes)} and {len(first.externals)}")
        for j, (a, b) in enumerate(zip(first.structure, seg.structure)):
            if a != b:
                raise _Mismatch(f"layer {k} differs from layer 0 at node {j} "
                                f"({seg.nodes[j].format_node()} vs {first.nodes[j].format_node()})")
    owner = {n: k for k, seg in enumerate(segments) for n in seg.nodes}
    carries, xs, invariants = [], [], []
    for n in [*first.nodes, *first.externals]:
        if isinstance(n.meta.get("example_value"), torch.SymFloat) or (n.op == "call_method" and n.target == "item"):
            # A Python float Dynamo made dynamic (a dropout rate that changed reaches the graph
            # as a 0-d tensor read with .item()): inside a loop body the value has no hint,
            # and ops that branch on it (dropout's range check) cannot be traced. Unrolled, it
            # keeps its hint.
            raise _Mismatch(f"a layer reads a tensor's value as a Python number ({n.format_node()})")
    for e in range(len(first.externals)):
        vals = [seg.externals[e] for seg in segments]
        metas = {_node_meta(v) for v in vals[1:]} | {_node_meta(vals[0])}
        if all(v is vals[0] for v in vals):
            invariants.append(e)
        elif vals[0] not in owner and all(owner.get(v) == k - 1 for k, v in enumerate(vals) if k):
            positions = {segments[k - 1].position[v] for k, v in enumerate(vals) if k}
            if len(positions) != 1 or len(metas) != 1:
                raise _Mismatch(f"input {e} is threaded from inconsistent positions or shapes")
            carries.append((e, positions.pop()))
        elif not any(v in owner for v in vals) and len(set(vals)) == len(vals):
            if len(metas) != 1:
                raise _Mismatch(f"per-layer input {e} changes shape or dtype across layers")
            written = next((v for v in vals if _written(v)), None)
            if written is not None:
                # torch's scan lets a body update only its loop-invariant inputs in place
                raise _Mismatch(f"a layer updates its own input {written.name} in place (BatchNorm's running "
                                "statistics in training, an add_ on a buffer)")
            xs.append(e)
        else:
            raise _Mismatch(f"input {e} of a layer comes from a layer other than the previous one")
    carry_positions = {p for _, p in carries}
    ys = set()
    last = len(segments) - 1
    for k, seg in enumerate(segments):
        for p, n in enumerate(seg.nodes):
            outside = [u for u in n.users if u not in owner]
            if not outside:
                continue
            if k == last and p in carry_positions:
                continue
            if not isinstance(n.meta.get("example_value"), torch.Tensor):
                raise _Mismatch(f"layer {k} returns a non-tensor value ({n.format_node()})")
            ys.add(p)
    return _Plan(segments, carries, xs, invariants, sorted(ys))


def _build_body(plan: _Plan, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The loop body: layer 0's nodes on placeholders (carries, per-layer inputs, shared
    inputs), region calls inlined. Raises _Mismatch for what cannot be a scan body."""
    first = plan.segments[0]
    graph = torch.fx.Graph()
    env: dict = {}

    def placeholder(name, source):
        ph = graph.placeholder(name)
        ph.meta["example_value"] = source.meta.get("example_value")
        env[source] = ph

    for i, (e, _) in enumerate(plan.carries):
        placeholder(f"carry_{i}", first.externals[e])
    for i, e in enumerate(plan.xs):
        placeholder(f"x_{i}", first.externals[e])
    for i, e in enumerate(plan.invariants):
        placeholder(f"shared_{i}", first.externals[e])
    for n in first.nodes:
        env[n] = _copy_node(graph, n, env, gm)
    carries = [env[first.nodes[p]] for _, p in plan.carries]
    # torch's scan refuses outputs that may alias each other or an input (a layer's output
    # that is both the next carry and a per-layer result): per-layer results are copies
    # (XLA elides them).
    ys = [graph.call_function(torch.clone, (env[first.nodes[p]],)) for p in plan.ys]
    graph.output(carries + ys)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _attr(root: torch.nn.Module, target: str):
    for part in target.split("."):
        root = getattr(root, part)
    return root


def _inline(graph: torch.fx.Graph, sub: torch.fx.GraphModule, args: list) -> list:
    """Copy region body `sub` into `graph` on `args`; its results, as a list of nodes/values."""
    env: dict = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise _Mismatch(f"a nested_compile_region body takes {len(placeholders)} inputs, its call passes {len(args)}")
    env.update(zip(placeholders, args))
    for n in sub.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "output":
            out = n.args[0]
            return [env[o] if isinstance(o, torch.fx.Node) else o
                    for o in (out if isinstance(out, (list, tuple)) else [out])]
        env[n] = _copy_node(graph, n, env, sub)
    raise _Mismatch("a nested_compile_region body has no output")


def _copy_node(graph: torch.fx.Graph, n: torch.fx.Node, env: dict, root: torch.nn.Module):
    """`n` copied into `graph` (inputs looked up in `env`), region calls inlined: a node, a
    list of nodes (a region call's results) or a region body (its get_attr)."""
    if _is_region_attr(n):
        return _attr(root, n.target)
    if n.op == "call_function" and n.target is _INVOKE:
        sub = env[n.args[0]] if n.args[0] in env else _attr(root, n.args[0].target)
        return _inline(graph, sub, [env[a] if isinstance(a, torch.fx.Node) else a for a in n.args[2:]])
    if n.op == "call_function" and n.target is operator.getitem and isinstance(env.get(n.args[0]), list):
        return env[n.args[0]][n.args[1]]
    if n.op in ("get_attr", "call_module"):
        raise _Mismatch(f"a layer reads {n.op} {n.target}")
    return graph.node_copy(n, env.__getitem__)


def _emit_scan(graph: torch.fx.Graph, env: dict, plan: _Plan, body_name: str) -> None:
    """Emit the loop of `plan` into `graph` (the stacks of per-layer inputs, the scan and its
    results) and bind, in `env`, every node of the run that is read after it to its result."""
    segments = plan.segments
    stacked = [graph.call_function(torch.stack, ([env[seg.externals[e]] for seg in segments], 0)) for e in plan.xs]
    scan = graph.call_function(
        torch.ops.higher_order.scan,
        (graph.get_attr(body_name), [env[segments[0].externals[e]] for e, _ in plan.carries], stacked,
         [env[segments[0].externals[e]] for e in plan.invariants]),
    )
    outs = [graph.call_function(operator.getitem, (scan, j)) for j in range(len(plan.carries) + len(plan.ys))]
    owner = {n for seg in segments for n in seg.nodes}
    for c, (_, p) in enumerate(plan.carries):
        env[segments[-1].nodes[p]] = outs[c]
    for yi, p in enumerate(plan.ys):
        for k, seg in enumerate(segments):
            node = seg.nodes[p]
            if node not in env and any(u not in owner for u in node.users):
                env[node] = graph.call_function(operator.getitem, (outs[len(plan.carries) + yi], k))


def _rebuild(gm: torch.fx.GraphModule, plans: list, inline: list = ()) -> torch.fx.GraphModule:
    """A new GraphModule: `gm`'s graph with each plan's run replaced by its loop and the
    region calls of `inline` by their bodies. Built in one pass that copies only the nodes
    outside the runs (copying the whole graph and erasing the runs costs ~4x more at 48
    layers); `gm` itself is left as it was."""
    first_node = {plan.segments[0].nodes[0]: (i, plan) for i, plan in enumerate(plans)}
    folded = {n for plan in plans for seg in plan.segments for n in seg.nodes}
    inlined = {nodes[0] for nodes in inline}
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    env: dict = {}
    for node in gm.graph.nodes:
        if node in first_node:
            i, plan = first_node[node]
            name = f"_fx2xla_scan_body_{i}"
            root.add_module(name, plan.body)
            _emit_scan(graph, env, plan, name)
        if node in folded:
            continue
        if node in inlined:
            args = [env[a] if isinstance(a, torch.fx.Node) else a for a in node.args[2:]]
            env[node] = _inline(graph, _attr(gm, node.args[0].target), args)  # its results, a list
            continue
        if node.op == "call_function" and node.target is operator.getitem and isinstance(env.get(node.args[0]), list):
            env[node] = env[node.args[0]][node.args[1]]
            continue
        if node.op == "get_attr" and node.users and all(u in inlined for u in node.users):
            continue  # a region body read only by calls that were inlined
        if node.op == "get_attr":  # Dynamo's graphs rarely hold attributes; carry them over
            _copy_attr(gm, root, node.target)
        env[node] = graph.node_copy(node, env.__getitem__)
        if node.op == "placeholder" and hasattr(node, "_dynamo_source"):
            # node_copy keeps meta (with Dynamo's static-input marks) but not this attribute,
            # which AOTAutograd reads to tell parameters (kept resident) from activations.
            env[node]._dynamo_source = node._dynamo_source
    new = torch.fx.GraphModule(root, graph)
    new.meta = dict(getattr(gm, "meta", {}))
    if hasattr(gm, "_param_name_to_source"):
        # With it (and the placeholders' sources) AOTAutograd knows the graph came from Dynamo
        # and which inputs are parameters: fx2xla keeps those resident across calls.
        new._param_name_to_source = gm._param_name_to_source
    return new


def _copy_attr(src: torch.nn.Module, dst: torch.nn.Module, target: str) -> None:
    *path, leaf = target.split(".")
    for part in path:
        src = getattr(src, part)
        if not hasattr(dst, part):
            dst.add_module(part, torch.nn.Module())
        dst = getattr(dst, part)
    value = getattr(src, leaf)
    if isinstance(value, torch.nn.Module):
        dst.add_module(leaf, value)
    elif isinstance(value, torch.nn.Parameter):
        dst.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        dst.register_buffer(leaf, value)
    else:
        setattr(dst, leaf, value)


@register_pass("scan_folding", default=True,
               help="fold runs of identical layers into one loop over stacked weights (see passes/scan_fold.py)",
               options={"scan_min_layers": (MIN_LAYERS, "scan_folding folds runs of at least this many layers")})
def scan_folding(gm: torch.fx.GraphModule, example_inputs, options) -> PassResult:
    min_layers = int(options.get("scan_min_layers", MIN_LAYERS))
    if min_layers < 2:
        raise ValueError(f"fx2xla: option scan_min_layers={min_layers}; expected at least 2")
    if options.get("_sharded_graph"):
        # The stacked weights would be one replicated input, and neither the propagation pass
        # nor the auto-sharding solver sees inside a scan body yet: each layer stays unrolled,
        # with its own weights' shardings (and memory per device as the plan says).
        return PassResult(gm, False, ["not folded: the graph is sharded over a mesh"])
    notes, plans = [], []
    # Region calls whose body writes its inputs are inlined, never folded
    inline = _calls_to_inline(gm)
    claimed: set = {n for nodes in inline for n in nodes}  # nodes of runs already folded (regions, then outer levels first)
    if inline:
        idents = sorted({nodes[0].args[1] for nodes in inline})
        notes.append(f"inlined {len(inline)} calls of nested_compile_region {', '.join(idents)}: the body updates "
                     "its inputs in place, which neither a loop nor torch's invoke_subgraph under autograd can do")

    def candidates():
        # Calls of a torch.compiler.nested_compile_region first: the same traced body by
        # construction, and found even when the region is a plain function, not a module.
        for ident, node_lists in _region_runs(gm, claimed, min_layers):
            yield f"nested_compile_region {ident} calls 0..{len(node_lists) - 1}", node_lists
        for level in range(MAX_NESTING):
            for prefix, node_lists, indices in _runs(gm, level, claimed, min_layers):
                yield f"{prefix}.{indices[0]}..{indices[-1]}", node_lists

    for where, node_lists in candidates():
        if any(n.op == "call_module" or (n.op == "get_attr" and not _is_region_attr(n))
               for nodes in node_lists for n in nodes):
            notes.append(f"not folded {where}: a layer calls a submodule or reads an attribute")
            continue
        try:
            plan = _plan([_segment(nodes) for nodes in node_lists])
            plan.body = _build_body(plan, gm)
        except _Mismatch as e:
            notes.append(f"not folded {where}: {e}")
            continue
        plans.append((where, plan))
        claimed.update(n for nodes in node_lists for n in nodes)
    if not plans and not inline:
        return PassResult(gm, False, notes)
    new = _rebuild(gm, [plan for _, plan in plans], inline)
    for where, plan in plans:
        notes.append(f"folded {where}: {len(plan.segments)} layers of {len(plan.segments[0].nodes)} "
                     f"nodes, {len(plan.carries)} carried, {len(plan.xs)} stacked, "
                     f"{len(plan.invariants)} shared inputs, {len(plan.ys)} per-layer outputs")
    return PassResult(new, True, notes)
