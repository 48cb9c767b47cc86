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
