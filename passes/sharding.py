"""Sharding: from the user's annotations to a sharding of every value of a graph.

Two parts:
- `sharding_annotations`, a pass over Dynamo's graph: an input (parameter, buffer, argument)
  marked eagerly with `fx2xla.mark_sharding` gets a `fx2xla::mark_sharding` constraint op right
  after its placeholder, which AOTAutograd carries into the forward graph and, through the op's
  autograd rule, onto the gradient in the backward graph. A constraint whose result the user
  discarded inside compiled code is given to the value's later uses.
- `propagate`, run when a graph's plan is built (on AOTAutograd's core-ATen graphs): from the
  constraints and the inputs' annotations, forward through each op's rule (the table in
  passes/op_rules.py, which the auto-sharding solver reads too), then backward into
  inputs nobody annotated (an optimizer state takes its parameter's sharding), to a fixed point.
  Each value ends with a spec (one tuple of mesh axes per dim) and where it came from: "user",
  "auto", "forward", "propagated", or "default" (replicated: no rule or annotation reached it).

The plan takes the inputs' and results' specs from here; the module carries them as Shardy
shardings, with the user's constraints inside, and XLA's partitioner completes the rest.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from fx2xla.sharding import MARK_SHARDING, ShardingError, annotation_of, decode_spec, encode_spec, is_mark, mesh_by_id

from .manager import PassResult, register_pass
from .op_rules import rule_of
from .spec_rules import fit_spec, is_pointwise, is_sharded, is_spec, node_ndim, node_shape, node_value

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# Dynamo-level pass: eager annotations -> constraint ops in the graph


_VIEW_METHODS = {"view", "reshape", "transpose", "t", "permute", "narrow", "select", "unsqueeze", "squeeze",
                 "expand", "as_strided", "split", "chunk", "unbind", "flatten", "unflatten", "view_as",
                 "expand_as", "swapaxes", "movedim", "diagonal", "T", "mT", "detach", "__getitem__"}


_WRITING_OPERATORS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def _name(target) -> str:
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _mutates(node: torch.fx.Node) -> bool:
    """Whether a Dynamo graph node writes one of its arguments (in-place method or function,
    `out=`, item assignment)."""
    if node.op not in ("call_method", "call_function"):
        return False
    if "out" in node.kwargs or node.target in _WRITING_OPERATORS:
        return True
    name = _name(node.target)
    return name.endswith("_") and not name.endswith("__")


def _aliases(node: torch.fx.Node) -> list[torch.fx.Node]:
    """`node` and the views taken of it (transitively), in a Dynamo graph."""
    out, todo = [], [node]
    while todo:
        n = todo.pop()
        out.append(n)
        for u in n.users:
            if (u.op == "call_method" and u.target in _VIEW_METHODS) or (
                    u.op == "call_function" and (_name(u.target) in _VIEW_METHODS or u.target is operator.getitem)):
                todo.append(u)
    return out


def _real_example(node: torch.fx.Node):
    grapharg = node.meta.get("grapharg")
    try:
        return grapharg.example if grapharg is not None else None
    except Exception:  # noqa: BLE001  (a freed weak reference, a symbolic size)
        return None


def _attr_tensors(gm: torch.fx.GraphModule) -> list:
    """The graph's own parameters then buffers, in the order AOTAutograd lifts them into
    graph inputs ahead of the placeholders (an optimizer step's parameters and states)."""
    return [t for _, t in gm.named_parameters(remove_duplicate=False)] + \
        [t for _, t in gm.named_buffers(remove_duplicate=False)]


def input_tensors(gm: torch.fx.GraphModule) -> list:
    """The real tensors behind the inputs of AOTAutograd's graphs of `gm` (as input_annotations;
    None where Dynamo kept none, e.g. a size)."""
    return _attr_tensors(gm) + [_real_example(n) for n in gm.graph.nodes if n.op == "placeholder"]


def input_annotations(gm: torch.fx.GraphModule) -> list:
    """Per input of the graphs AOTAutograd makes of a Dynamo graph (its lifted parameters and
    buffers, then its placeholders), the Annotation of the real tensor behind it (or None)."""
    return [annotation_of(t) for t in _attr_tensors(gm)] + \
        [annotation_of(_real_example(n)) for n in gm.graph.nodes if n.op == "placeholder"]


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


# Uses that only read their tensors, by function or method name. A use outside this list keeps
# reading the value itself: some functions write arguments their schema does not mark
# (F.batch_norm updates running statistics), and a write must reach the original tensor.
_READERS = {"linear", "matmul", "mm", "bmm", "addmm", "embedding", "conv1d", "conv2d", "conv3d",
            "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "layer_norm", "group_norm", "rms_norm",
            "scaled_dot_product_attention", "add", "sub", "mul", "truediv", "div", "neg", "relu", "gelu",
            "silu", "tanh", "sigmoid", "softmax", "log_softmax", "view", "reshape", "transpose", "permute",
            "t", "contiguous", "float", "type_as", "sum", "mean", "pow", "exp", "where", "getitem"}


def _constrain_uses(graph: torch.fx.Graph, value: torch.fx.Node, mark: torch.fx.Node) -> bool:
    """Route the reading uses of `value` after `mark` through `mark` (see _READERS), unless
    `value` or a view of it is written in place anywhere."""
    if any(_mutates(u) for a in _aliases(value) for u in a.users):
        return False
    order = {n: i for i, n in enumerate(graph.nodes)}
    later = [u for u in value.users if u is not mark and order[u] > order[mark]
             and u.op in ("call_function", "call_method") and _name(u.target) in _READERS]
    for u in later:
        u.replace_input_with(value, mark)
    return bool(later)


@register_pass("sharding_annotations", default=True,
               help="eager fx2xla.mark_sharding annotations on inputs/parameters become constraints "
                    "that reach forward and backward graphs")
def sharding_annotations(gm: torch.fx.GraphModule, example_inputs, options) -> PassResult:
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    notes, changed = [], False
    anchor = placeholders[-1] if placeholders else None
    marked = [(n, annotation_of(_real_example(n))) for n in placeholders]
    marked += [(n, annotation_of(_attr(gm, n.target))) for n in graph.nodes if n.op == "get_attr"]
    for node, ann in marked:
        # sharding="auto": an earlier solve's marks (source "auto") are not constraints; it solves
        # afresh (the backend gives the inputs the new plan's specs).
        if ann is None or (options.get("sharding") == "auto" and ann.source == "auto"):
            continue
        if node.op == "get_attr":
            anchor = node
        with graph.inserting_after(anchor):
            mark = graph.call_function(MARK_SHARDING, (node, ann.mesh_id, encode_spec(ann.spec)))
        mark.meta["example_value"] = node.meta.get("example_value")
        anchor = mark
        changed = True
        routed = _constrain_uses(graph, node, mark)
        notes.append(f"{node.name}: {encode_spec(ann.spec)} on mesh {ann.mesh_id}"
                     + ("" if routed else " (written in place: constrained at the input only)"))
    for node in list(graph.nodes):  # constraints inside compiled code whose result was discarded
        if is_mark(node) and not node.users \
                and isinstance(node.args[0], torch.fx.Node) and node.args[0].op != "placeholder":
            changed |= _constrain_uses(graph, node.args[0], node)
    if changed:
        graph.lint()
        gm.recompile()
    return PassResult(gm, changed, notes)


# ---------------------------------------------------------------------------------------------
# Propagation over core-ATen graphs


@dataclass
class Shardings:
    """A graph's mesh and, per value node, its spec and where the spec came from."""

    mesh_id: int
    specs: dict = field(default_factory=dict)  # node -> spec (tuple of axis tuples per dim)
    # node -> "user" (an annotation or constraint), "auto" (sharding="auto" chose it), "forward"
    # (a backward's saved activation, as its forward left it), "propagated", or "default"
    sources: dict = field(default_factory=dict)

    def spec(self, node) -> tuple:
        """The node's spec, replicated where nothing reached it."""
        s = self.specs.get(node)
        if isinstance(s, tuple) and is_spec(s):
            return s
        return tuple(() for _ in range(node_ndim(node)))

    def source(self, node) -> str:
        return self.sources.get(node, "default")


def graph_mesh(gm: torch.fx.GraphModule, annotations) -> int | None:
    """The id of the one mesh a graph's constraints and input annotations use (None: none)."""
    ids = {a.mesh_id for a in annotations if a is not None}
    ids |= {n.args[1] for n in gm.graph.nodes if is_mark(n)}
    if len(ids) > 1:
        raise ShardingError(f"fx2xla: one graph uses several meshes {[repr(mesh_by_id(i)) for i in sorted(ids)]}; "
                            "shard every tensor of a model over one mesh")
    return ids.pop() if ids else None


def propagate(gm: torch.fx.GraphModule, annotations, mesh_id: int, sizes: dict[str, int] | None = None) -> Shardings:
    """Shardings of every value of `gm` (see module doc). `annotations`: per placeholder, an
    Annotation or None. `sizes`: mesh axis sizes (default: the mesh's)."""
    sizes = sizes if sizes is not None else mesh_by_id(mesh_id).shape
    result = Shardings(mesh_id)
    specs, sources = result.specs, result.sources
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, ann in zip(placeholders, annotations):
        if ann is not None and node_ndim(node) == len(ann.spec):
            specs[node], sources[node] = fit_spec(ann.spec, node_shape(node), sizes), ann.source
    for node in placeholders:  # a constraint straight on an input is the input's sharding
        for u in node.users:
            if is_mark(u) and node not in specs:
                specs[node], sources[node] = fit_spec(decode_spec(u.args[2]), node_shape(node), sizes), "user"
    for _ in range(4):  # forward, then backward into unannotated inputs, until nothing changes
        before = dict(specs)
        _forward(gm, specs, sources, sizes)
        _backward_fill(gm, specs, sources, sizes)
        if specs == before:
            break
    return result


def _forward(gm, specs, sources, sizes) -> None:
    for node in gm.graph.nodes:
        if node.op != "call_function" or sources.get(node) == "user":
            continue
        if is_mark(node):
            specs[node], sources[node] = fit_spec(decode_spec(node.args[2]), node_shape(node), sizes), "user"
            continue
        try:
            spec = _rule(node, specs)
        except (TypeError, ValueError, IndexError, KeyError, AttributeError):
            spec = None  # an argument form a rule does not know: no guess
        if spec is None:
            continue
        if isinstance(node_value(node), torch.Tensor):
            spec = fit_spec(spec, node_shape(node), sizes)
        if spec is not None:
            specs[node], sources[node] = spec, "propagated"


def _backward_fill(gm, specs, sources, sizes) -> None:
    """Backward through elementwise ops: an operand of the same shape as a sharded elementwise
    result, which nothing sharded yet, takes that result's spec. So an optimizer state, read
    only by the update that writes its parameter, is sharded like the parameter; so is a
    gradient, a mask next to its activation."""
    for node in reversed(list(gm.graph.nodes)):
        spec = specs.get(node)
        if node.op != "call_function" or not is_sharded(spec) or not is_spec(spec):
            continue
        if not (is_pointwise(node.target) or node.target is aten.copy_.default):
            continue
        for a in node.all_input_nodes:
            if a not in specs and isinstance(node_value(a), torch.Tensor) and node_shape(a) == node_shape(node):
                specs[a], sources[a] = fit_spec(spec, node_shape(a), sizes), "propagated"


def _rule(node, specs):
    """The spec of `node` from its operands' by its op's rule (passes/op_rules.py); None where
    the op has none, or it knows nothing."""
    rule = rule_of(node.target)
    return rule.propagate(node, specs) if rule is not None and rule.propagate is not None else None
