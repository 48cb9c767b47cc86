"""Eager fallback: split a graph into XLA subgraphs and eager islands for ops with no rule.

Nodes with a lowering rule are grouped into maximal connected subgraphs (torch.fx's
CapabilityBasedPartitioner), each compiled as its own CompiledGraph; the ops between them run
eagerly, in the order of the original graph. One warning per op kind names what fell back.
"""
from __future__ import annotations

import operator
import warnings

import torch
import torch.fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from .errors import node_op, user_source_line
from .lowering.registry import PYTHON_OPS
from .lowering.registry import data_dependent, lowering_for, lowering_for_node
from .metrics import counters

# The (op, data-dependent?) pairs the eager-fallback warning has named in this process (each is
# named once). Public: a test starts it afresh to see the warning.
warned_ops: set = set()


def _lowerable(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:  # of a multi-output op: goes where its source goes
        src = node.args[0]
        return isinstance(src, torch.fx.Node) and _lowerable(src)
    if data_dependent(node):
        return False
    return node.target in PYTHON_OPS or lowering_for_node(node) is not None


def drop_unused_scalars(gm: torch.fx.GraphModule) -> int:
    """Remove scalar reads of device values (`aten._local_scalar_dense`, `.item()`) that nothing
    but a tautology reads, with the symbolic arithmetic and checks on them; return how many
    reads went. Library code computes such values for branches tracing did not take
    (nn.TransformerEncoder's `torch.equal(mask, causal)`, read only by its slow path), and
    AOTAutograd keeps them with range checks on them (`u0 >= 0` for a bool read as 0 or 1);
    each would otherwise split the graph around an eager read of a device value.

    A read goes when its value reaches no tensor op and no output, and every check on it holds
    whatever the value: a read nothing reads, or a bool read whose checks hold both when True
    and when False. A check that could fail (the user's `torch._check(n.item() > 0)`) keeps it."""
    dropped = 0
    for root in [n for n in gm.graph.nodes if n.target is torch.ops.aten._local_scalar_dense.default]:
        chain = _scalar_readers(root)
        if chain is None:
            continue
        values = (True, False) if isinstance(root.meta.get("val"), torch.SymBool) else ()
        if any(n.target is torch.ops.aten._assert_scalar.default for n in chain) and not values:
            continue
        if not all(_checks_hold(root, chain, v) for v in values):
            continue
        for node in reversed([root, *chain]):
            gm.graph.erase_node(node)
        dropped += 1
    if dropped:  # tensors only they read are left to XLA, which drops dead values itself
        gm.recompile()
    return dropped


def _scalar_readers(root: torch.fx.Node) -> list[torch.fx.Node] | None:
    """Every node reading `root`'s value, directly or through symbolic arithmetic, in graph
    order, when all of them are symbolic arithmetic or checks reading nothing else from the
    graph; None when the value reaches anything else."""
    seen, stack = set(), [root]
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            if user.op != "call_function" or not (user.target in PYTHON_OPS or user.target is torch.sym_ite
                                                  or user.target is torch.ops.aten._assert_scalar.default):
                return None
            seen.add(user)
            stack.append(user)
    if any(a is not root and a not in seen for n in seen for a in n.all_input_nodes):
        return None
    return [n for n in root.graph.nodes if n in seen]


def _checks_hold(root: torch.fx.Node, chain: list[torch.fx.Node], value) -> bool:
    """Whether every check in `chain` passes when `root` reads `value`."""
    env = {root: value}
    for node in chain:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
        if node.target is torch.ops.aten._assert_scalar.default:
            if not args[0]:
                return False
            continue
        env[node] = (args[1] if args[0] else args[2]) if node.target is torch.sym_ite else node.target(*args, **kwargs)
    return True


def unsupported_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n for n in gm.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem and not _lowerable(n)
    ]


class _Lowerable(OperatorSupportBase):
    def is_node_supported(self, submodules, node: torch.fx.Node) -> bool:
        return _lowerable(node)


class XlaIsland(torch.nn.Module):
    """One XLA subgraph inside a partitioned graph, called with Dynamo's unboxed convention."""

    def __init__(self, compiled, single_output: bool):
        super().__init__()
        self.compiled = compiled
        self.single_output = single_output

    def forward(self, *args):
        outs = self.compiled(list(args))
        return outs[0] if self.single_output else tuple(outs)


def _warn_fallback(nodes) -> None:
    for n in nodes:
        dependent = data_dependent(n)
        if (dependent and (n.target in PYTHON_OPS or isinstance(n.meta.get("val"), (torch.SymInt, torch.SymBool)))) \
                or (n.target is torch.ops.aten._assert_scalar.default and any(map(data_dependent, n.all_input_nodes))):
            continue  # size arithmetic and checks on a data-dependent size: no op of the user's
        key = str(node_op(n))
        if (key, dependent) in warned_ops:
            continue
        warned_ops.add((key, dependent))
        why = ("has a result whose size depends on the input's values (an executable's result sizes are "
               "fixed when it is compiled)" if dependent
               else "has no lowering rule for these arguments" if lowering_for(n.target) is not None
               else "has no lowering rule")
        warnings.warn(
            f"fx2xla: {key} {why} and runs eagerly between XLA subgraphs "
            f"(first seen at {user_source_line(n)}). options={{'fallback': 'error'}} makes "
            "this an error.",
            stacklevel=2,
        )


def partitioned_graph(gm: torch.fx.GraphModule, compile_subgraph, resident: set[int] | None = None):
    """A boxed callable running `gm` as XLA subgraphs (built by `compile_subgraph(sub_gm,
    example_inputs, name, resident_inputs)`) with eager islands between them. `resident`: the
    positions of `gm`'s inputs that are parameters/buffers; a subgraph keeps device buffers
    across calls for those of its inputs alone, never for intermediates (new every call)."""
    eager = unsupported_nodes(gm)
    counters.fallback_ops += len(eager)
    _warn_fallback(eager)
    partitioner = CapabilityBasedPartitioner(gm, _Lowerable(), allows_single_node_partition=True)
    partitions = [
        p for p in partitioner.propose_partitions()
        # A partition of nothing but size arithmetic is cheaper in Python.
        if any(n.target not in PYTHON_OPS for n in p.nodes)
    ]
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    static = {name for i, name in enumerate(placeholders) if i in (resident or ())}
    fused = partitioner.fuse_partitions(partitions, prefix="xla_")
    for node in list(fused.graph.nodes):
        if node.op != "call_module" or not node.target.startswith("xla_"):
            continue
        sub = getattr(fused, node.target)
        examples = [a.meta["val"] for a in node.args]
        out_node = next(n for n in sub.graph.nodes if n.op == "output")
        single = not isinstance(out_node.args[0], (tuple, list))
        # (fuse_partitions copies the graph: its placeholders are known by name.)
        sub_resident = {i for i, a in enumerate(node.args) if a.op == "placeholder" and a.name in static}
        compiled = compile_subgraph(sub, examples, node.target, sub_resident)
        delattr(fused, node.target)
        fused.add_module(node.target, XlaIsland(compiled, single))
    fused.recompile()

    def run(args):
        outs = fused(*args)
        args.clear()
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]

    run._boxed_call = True
    run.graph_module = fused
    return run
