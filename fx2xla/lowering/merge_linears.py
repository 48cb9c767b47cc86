"""One matmul for the linears that read the same activation (CPU inference graphs).

A transformer layer multiplies one activation by several weights: LLaMA's q, k and v
projections, its MLP's gate and up. At a few rows (decoding, small-batch serving) XLA:CPU's
float32 dot is bound by its per-dot cost, not its arithmetic: one dot against the weights
concatenated takes less time than the dots apart (docs/benchmarks.md, "Linears that read one
activation, as one matmul": 8 rows x 256, LLaMA's q/k/v and gate/up, 0.63-0.78x the time).
So, where a CPU inference graph multiplies one activation by two or more nn.Linear weights
that are resident graph inputs, the graph is rewritten to

    cat([W1, W2, ...], 0)  ->  mm(x, cat.T)  ->  one slice per original product

(`addmm` with the biases concatenated likewise; a product the graph returns, or returns a
view of, is left, so that it reaches the caller with eager's strides). The concatenation of
graph inputs is done in torch once per weight update, not by every call: the plan passes it to
the executable as one input (plan.Concat), and a weight read by nothing else is not passed on
its own. Columns of the merged product are the same dot products as before, so results differ
from the separate matmuls by rounding only (XLA may block the longer dot differently).

Only where it was measured to pay: float32, static shapes, 2 to MAX_ROWS rows (one row takes
XLA's matrix-vector path, as fast either way; at 512 rows the two were within 3%).
Option `merge_linears` (torch.compile; default True) turns it off.
"""
from __future__ import annotations

from collections import defaultdict

import torch

aten = torch.ops.aten

MAX_ROWS = 64  # measured to pay from 2 to 32 rows (0.63-0.88x); neutral at 1 and 512
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# Ops whose result shares its operand's memory in eager: an output reached from a product through
# these alone would be returned as a view of the merged product (plan.build_plan returns views of
# one computed value from torch), with other strides than eager's.
_ALIASING = {
    *_VIEWS, aten.permute.default, aten.t.default, aten.transpose.int, aten.alias.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.slice.Tensor, aten.select.int,
    aten.diagonal.default, aten.expand.default, aten.as_strided.default, aten.unfold.default,
}


def _returned(node) -> bool:
    """Whether the graph returns `node`, or a view of it."""
    todo = [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output":
                return True
            if u.op == "call_function" and u.target in _ALIASING and u.args and u.args[0] is n:
                todo.append(u)
    return False


def _source(node):
    """The value a matmul's left operand reads: the node a 2-D view was taken of (each nn.Linear
    flattens the same activation with a view of its own), or the operand itself."""
    if node.op == "call_function" and node.target in _VIEWS:
        return node.args[0]
    return node


def _weight(rhs, inputs: dict):
    """The graph input `rhs` transposes (nn.Linear's weight read as W.T), if only this reads it."""
    from .linalg import swaps_2d

    if not (swaps_2d(rhs) and len(rhs.users) == 1):
        return None
    w = rhs.args[0]
    return w if w in inputs and len(w.users) == 1 else None


def _operands(node):
    """(bias or None, lhs, rhs) of an `mm` or `addmm` node (no alpha/beta), else None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.mm.default and len(node.args) == 2:
        return (None, *node.args)
    if node.target is aten.addmm.default and len(node.args) == 3:
        return tuple(node.args)
    return None


def _candidate(node, inputs: dict):
    """(group key, weight input, bias input or None) for a matmul that may be merged, else None."""
    operands = _operands(node)
    if operands is None:
        return None
    bias, lhs, rhs = operands
    if bias is not None and not (isinstance(bias, torch.fx.Node) and bias in inputs and len(bias.users) == 1
                                 and inputs[bias].dim() == 1):
        return None
    if not isinstance(lhs, torch.fx.Node) or not isinstance(rhs, torch.fx.Node):
        return None
    w = _weight(rhs, inputs)
    x = lhs.meta.get("val")
    if w is None or not isinstance(x, torch.Tensor) or x.dim() != 2 or _returned(node):
        return None
    ex = inputs[w]
    if any(isinstance(s, torch.SymInt) for s in (*x.shape, *ex.shape)):
        return None
    if not (2 <= x.shape[0] <= MAX_ROWS and ex.dtype == torch.float32 == x.dtype and ex.dim() == 2):
        return None
    if bias is not None and (inputs[bias].dtype != ex.dtype or inputs[bias].shape[0] != ex.shape[0]):
        return None
    key = (_source(lhs), tuple(x.shape), ex.shape[1], bias is not None)
    return key, w, bias


def merge_linears(gm: torch.fx.GraphModule, example_inputs, resident: set[int]) -> int:
    """Rewrites `gm` (a CPU inference graph) so that matmuls of one activation by resident,
    contiguous float32 weights it reads nowhere else are one matmul against their concatenation
    (see above). Returns how many matmuls were merged away."""
    from torch._guards import detect_fake_mode

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # Inputs a concatenation may take: resident dense tensors on the CPU (plan._input_concats
    # computes it in torch then, once per update).
    inputs = {n: ex for i, (n, ex) in enumerate(zip(placeholders, example_inputs))
              if i in resident and isinstance(ex, torch.Tensor) and ex.device.type == "cpu"
              and ex.is_contiguous() and ex.numel() > 0}
    groups: dict = defaultdict(list)
    for node in gm.graph.nodes:
        found = _candidate(node, inputs)
        if found is not None:
            key, w, bias = found
            groups[key].append((node, w, bias))
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return 0
    fake = detect_fake_mode([n.meta.get("val") for n in placeholders])
    if fake is None:
        return 0
    def call(op, *args):  # a new node before the insertion point, its fake value computed
        node = graph.call_function(op, args)
        node.meta["val"] = op(*torch.fx.node.map_arg(args, lambda a: a.meta["val"]))
        return node

    merged = 0
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for members in groups.values():
        first = members[0][0]
        lhs = _operands(first)[1]
        weights = [w for _, w, _ in members]
        biases = [b for _, _, b in members]
        # The merged matmul goes where the first product was: every operand must be defined by
        # then (a partitioned graph may define a later product's weight after it).
        if max(order[n] for n in weights + biases if n is not None) > order[first]:
            continue
        with graph.inserting_before(first), fake:
            rhs = call(aten.permute.default, call(aten.cat.default, weights, 0), [1, 0])
            big = (call(aten.mm.default, lhs, rhs) if biases[0] is None
                   else call(aten.addmm.default, call(aten.cat.default, biases, 0), lhs, rhs))
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in first.meta:
                big.meta[key] = first.meta[key]
        offset = 0
        for node, w, _ in members:
            width = w.meta["val"].shape[0]
            with graph.inserting_before(node), fake:
                part = call(aten.slice.Tensor, big, 1, offset, offset + width)
            part.meta.update({k: node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in node.meta})
            offset += width
            _, old_lhs, old_rhs = _operands(node)
            node.replace_all_uses_with(part)
            graph.erase_node(node)
            graph.erase_node(old_rhs)  # the weight's transpose: this matmul was its one reader
            if old_lhs is not lhs and not old_lhs.users:
                graph.erase_node(old_lhs)
        merged += len(members) - 1
    graph.lint()
    gm.recompile()
    return merged
