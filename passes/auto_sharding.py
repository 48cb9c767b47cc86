"""Auto-sharding: a sharding for every input of a graph over a mesh, with no hints, from an
integer program over the core-ATen graph (the Alpa formulation, section 4.2 of its paper).

- **Strategies.** Every tensor value gets one-hot variables over its candidate specs: each mesh
  axis shards one dim (that it divides) or none. An op's strategy is its output's spec and
  fixes the layouts it needs its operands in. A matmul's strategy also says which mesh axes
  split its contracted dim: those leave partial sums that are all-reduced.
  - Elementwise ops need their operands laid out like their output (broadcast dims whole).
  - Views map specs both ways; reductions, softmax and attention keep their dims whole.
  - Unary elementwise ops and views that keep every layout (transposes, reshapes that split or
    merge whole dims) follow their operand, and the outputs of a multi-output op (attention,
    layer norm, split) share the op's variables: one decision each.
  - `x[i]` (aten.index) keeps the indexed dims whole; the index tensors follow the output.
  - An embedding's table is whole over its rows, or split over mesh axes the output does not
    use (Megatron's vocab-parallel embedding): each device looks up its own rows and the
    partial results are all-reduced, priced like a contracted dim.
  - Repeated layers (a ModuleList's identical blocks, found by `repeated_layers` from the
    module paths Dynamo records) share one set of variables, and their edges one set of pair
    variables, priced for every layer: the program's size stops growing with depth.
  - Ops without a rule are replicated.
  The rules are ours, over the core-ATen set, rather than DTensor's op strategies. They stand
  beside the propagation pass's rules in one table (passes/op_rules.py), in its spec form
  (passes/sharding.py turns the solution into the plan). They price the all-reduce of a
  contracted dim directly. And they need no process group or fake mesh at compile time.
- **Costs** are seconds, in an alpha-beta model per mesh axis:
  - every all-gather, all-to-all or all-reduce on an axis costs alpha + bytes * beta;
  - compute costs flops / parallelism * gamma, so a plan that parallelises nothing is not free;
  - resharding an operand from its producer's layout to the layout an op needs is an edge
    cost over pairs of layouts (the operand's, the one the op needs), linearised with
    continuous pair variables whose marginals are the two one-hot choices (Alpa's formulation;
    much tighter than y >= x_u + x_v - 1).
- **Memory** (Alpa's live-memory constraint). At every peak step of the graph's schedule, the
  bytes per device held then stay under `memory_budget`: the inputs (parameters four times in a
  training step: weights, gradients, AdamW's two moments), the values live at that step (see
  `live_values`), the copies reshards make (from when their source exists: XLA hoists the
  gathers of weights to the start), and attention's scores. The backend then holds the
  executable's own peak (XLA's memory analysis) to the budget: it solves again under a tighter
  one where XLA added more than this estimate and, near the boundary, where the estimate ranks
  plans no better than XLA's figures, lets those decide (the least-memory plan, `solve_least`,
  and plans just over the budget by the estimate are compiled and measured).
  An infeasible budget's error gives the least peak by this estimate, said to be the estimate's,
  proven least (within the gap) or else with a lower bound said to be a bound.
- **Solver.** scipy's `milp` (HiGHS), with a time limit and a relative gap. The report says
  whether the optimum was proven, and gives the gap and the solve time. `solve_cached` keeps
  each solution by its graph, mesh, budget, constraints and cost model, in memory and in the
  disk cache beside the executables: a recompile or a new process does not solve again.

User annotations are constraints: an annotated input keeps its spec. The solution gives each
graph input its spec (handed to the plan and the runtime like a user annotation) and pins every
computed value's layout in the module (`Solution.constraints`), and each operand an op reads in
another layout than its own at that read (`Solution.operand_constraints`), so that XLA's
partitioner realises the plan the solver priced.
"""
from __future__ import annotations

import itertools
import math
import operator
import re
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx

from fx2xla.sharding import ShardingError, decode_spec, is_mark

from .op_rules import MATMULS, SPLITS, Strategy, flops, permutation, rule_of
from .spec_rules import (ATTENTION_OPS, candidate_specs, is_pointwise, node_shape, node_value, normalized_dims,
                         output_shapes, replicated, reshape_spec, shard_count, tensor_operands)

aten = torch.ops.aten


@dataclass(frozen=True)
class CostModel:
    """alpha: seconds per collective; beta: seconds per byte moved per device; gamma: seconds
    per flop on one device; delta: seconds per input byte held per device, a tie-break: of
    two plans that move and compute alike, the one holding less wins (a batch taken as shards
    rather than whole). Defaults: a fast interconnect (1 µs a collective, 50 GB/s) and a ~10
    TFLOP/s device. A larger alpha lets the count of collectives outweigh their bytes: at 5 µs,
    FSDP of the MLP in bench/autoshard.py gathered a 256 KiB activation rather than a 1 KiB bias
    and an all-reduce of 64 KiB (2.5x the hand plan's bytes)."""

    alpha: float = 1e-6
    beta: float = 1 / 50e9
    gamma: float = 1 / 10e12
    delta: float = 1e-3 / 50e9


@dataclass
class Solution:
    """Per placeholder (in graph order), its spec; per value, the chosen strategy's spec; the
    objective (estimated seconds), the collective bytes it predicts, its estimate of the peak
    bytes per device (`memory_bytes`: inputs and the values live at once, see `live_values`)
    and of the inputs' share of it, and how the solve went."""

    input_specs: list
    specs: dict = field(default_factory=dict)
    objective: float = 0.0
    collective_bytes: float = 0.0
    memory_bytes: float = 0.0
    input_bytes: float = 0.0
    # XLA's memory analysis of the executable compiled from it (+ gradients and moments in
    # training): set by the backend, which checks it against the budget.
    xla_peak_bytes: float | None = None
    # node -> {operand node: spec}: where the chosen strategy of an op reads an operand in
    # another layout than the operand's own, that layout, pinned on the op's read of it (so the
    # partitioner reshards the operand there, as priced, rather than choosing its own way: e.g.
    # sharding a bias-add's result and gathering it instead of gathering the bias).
    operand_constraints: dict = field(default_factory=dict)
    cached: str | None = None  # "memory" / "disk": taken from an earlier solve (see solve_cached)
    tied: int = 0  # values that share another layer's variables (see repeated_layers)
    status: str = ""
    gap: float | None = None
    seconds: float = 0.0
    variables: int = 0

    def constraints(self) -> dict:
        """node -> spec of every computed value: the layouts the module pins."""
        return {n: s for n, s in self.specs.items() if n.op == "call_function"}


class InfeasibleBudget(ShardingError):
    """No sharding fits the memory budget on this mesh. `least_estimate`: the least peak per
    device a plan was found to hold by the solver's estimate, `least_bound` a lower bound on
    any plan's, `proven` whether the first is the least (within 0.1%); from the backend,
    `least_compiled`: the compiled peak (XLA's memory analysis) of the least-memory plan it
    found, a budget at which that plan compiles. None where not known."""

    def __init__(self, message: str, *, least_estimate: float | None = None, least_bound: float | None = None,
                 proven: bool = False, least_compiled: float | None = None):
        super().__init__(message)
        self.least_estimate, self.least_bound, self.proven = least_estimate, least_bound, proven
        self.least_compiled = least_compiled


def _axis_dim(spec, axis):
    return next((d for d, axes in enumerate(spec) if axis in axes), None)


def reshard_cost(src, dst, shape, itemsize: int, sizes, model: CostModel) -> tuple[float, float]:
    """(seconds, bytes per device) to turn a value laid out as `src` into `dst`: per mesh axis,
    an all-gather where `dst` drops a shard, an all-to-all where the axis moves to another dim,
    nothing where `dst` only slices what every device already holds."""
    if src == dst:
        return 0.0, 0.0
    local = math.prod(shape) * itemsize / max(1, shard_count(src, sizes))
    seconds = moved = 0.0
    for a, n in sizes.items():
        ds, dd = _axis_dim(src, a), _axis_dim(dst, a)
        if ds is None or ds == dd:
            continue
        nbytes = local * (n - 1) if dd is None else local * (n - 1) / n
        seconds += model.alpha + nbytes * model.beta
        moved += nbytes
        if dd is None:
            local *= n
    return seconds, moved


def _producer(node):
    """For `getitem(op, i)` of an op with several outputs (attention, layer norm, split): the op."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
            and _multi_output(node.args[0]):
        return node.args[0]
    return None


def _multi_output(node) -> bool:
    v = node_value(node)
    return node.op == "call_function" and isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v)


def _table_strategies(node, sizes, model):
    rule = rule_of(node.target)
    return rule.strategies(node, sizes, model) if rule is not None and rule.strategies is not None else None


def _multi_output_strategies(node, sizes, model) -> list[Strategy]:
    """Strategies of an op with several outputs (attention, layer norm, split): its op's rule
    (passes/op_rules.py), else whole operands into whole outputs. Each strategy's `out` holds a
    spec per output (None for a non-tensor). Its outputs (getitem nodes) share its variables, so
    a layout it needs is paid once, however many of its outputs are read."""
    found = _table_strategies(node, sizes, model)
    if found is not None:
        return found
    whole = tuple(None if sh is None else tuple(() for _ in sh) for sh in output_shapes(node))
    return [Strategy(whole, [replicated(a) for a in tensor_operands(node)])]


def strategies_of(node, sizes, model) -> list[Strategy]:
    """The strategies of one graph node (placeholders included): its op's rule
    (passes/op_rules.py), else whole operands into a whole output."""
    shape = node_shape(node)
    if shape is None:
        return []
    if node.op == "placeholder":
        return [Strategy(s, []) for s in candidate_specs(shape, sizes)]
    if is_mark(node):  # the user's constraint inside the graph: that layout, whatever it costs
        spec = decode_spec(node.args[2])
        return [Strategy(spec, [spec])]
    found = _table_strategies(node, sizes, model)
    if found is not None:
        return found
    return [Strategy(replicated(node), [replicated(a) for a in tensor_operands(node)])]


def _follows(node, strategies, sizes):
    """(the operand a node shares its variables with, its spec under each of the operand's
    strategies), or None for a node of its own (Alpa's "follow"): a unary elementwise op of its
    operand's shape, or a view that maps every layout of its operand to one of its own and back
    (a transpose, a reshape that splits or merges dims whole, an unsqueeze). A view that would
    lose a layout (a sharded dim merged behind another) keeps its own variables."""
    if node.op != "call_function" or node.target is aten.copy_.default:
        return None
    ops = tensor_operands(node)
    if len(ops) != 1 or ops[0] not in strategies or _multi_output(ops[0]):
        return None
    lead, t = ops[0], node.target
    specs = [st.out for st in strategies[lead]]
    in_shape, shape = node_shape(lead), node_shape(node)
    if is_pointwise(t):
        return (lead, specs) if in_shape == shape else None
    if t in (aten.permute.default, aten.t.default, aten.transpose.int):
        perm = permutation(node, len(shape))
        return lead, [tuple(s[perm[d]] for d in range(len(shape))) for s in specs]
    if t is aten.unsqueeze.default:
        d = normalized_dims(node.args[1], len(shape))[0]
        return lead, [s[:d] + ((),) + s[d:] for s in specs]
    if t in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        out = [reshape_spec(s, in_shape, shape) for s in specs]
        if all(reshape_spec(o, shape, in_shape) == s
               and all(n % shard_count((axes,), sizes) == 0 for n, axes in zip(shape, o)) for o, s in zip(out, specs)):
            return lead, out
    return None


# The first numbered component of a module path or parameter name: "h[0]", "['0']", ".0".
_NUMBERED = re.compile(r"(?:\[\'?(\d+)\'?\]|\.(\d+))(?=[.\[]|$)")


def _layer_of(path: str):
    """(the path before its first numbered component, that number, the rest), or None."""
    m = _NUMBERED.search(path)
    if m is None:
        return None
    return path[:m.start()], int(m.group(1) or m.group(2)), path[m.end():]


def repeated_layers(gm: torch.fx.GraphModule, input_names=None) -> dict:
    """node -> the node it corresponds to in the first of a run of identical layers (a
    ModuleList's blocks): the same op on the same shapes at the same place in its layer, by
    the module path Dynamo records on each node. Inputs are matched by their names
    (`input_names`, per placeholder: "h.3.attn.c_attn.weight" -> "h.0.attn.c_attn.weight").
    Layers that differ anywhere are left alone. `solve(ties=...)` gives each such group one
    set of variables: Alpa's shared variables for repeated layers."""
    groups: dict = {}
    for n in gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") if n.op == "call_function" else None
        if not stack:
            continue
        where = _layer_of(list(stack.values())[-1][0])
        if where is not None:
            groups.setdefault(where[0], {}).setdefault(where[1], []).append(n)

    def signature(n):
        v = node_value(n)
        meta = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
        return n.target, meta, len(n.args)

    ties = {}
    for layers in groups.values():
        if len(layers) < 2:
            continue
        order = sorted(layers)
        first = layers[order[0]]
        shape = [signature(n) for n in first]
        for i in order[1:]:
            if [signature(n) for n in layers[i]] == shape:
                ties.update(zip(layers[i], first))
    if input_names:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        firsts: dict = {}
        for n, name in sorted(zip(placeholders, input_names), key=lambda t: _layer_of(t[1] or "") or ("", -1, "")):
            where = _layer_of(name or "")
            v = node_value(n)
            if where is None or not isinstance(v, torch.Tensor):
                continue
            key = (where[0], where[2], tuple(v.shape), v.dtype)
            if key in firsts:
                ties[n] = firsts[key]
            else:
                firsts[key] = n
    return ties


# Ops whose result is a view of their first operand: no memory of their own; they keep their
# base alive until their own last use. (XLA may copy a transpose, but fuses it into its reader.)
# A sharding constraint (fx2xla::mark_sharding, as the sharding_annotations pass puts after every
# annotated input) is one too: a no-op where its operand is laid out as it says, and otherwise a
# reshard, whose copy the edge into it counts. Counted as a value of its own, every annotated
# parameter was held twice from the start of the graph to its last reader, and a budget its
# plan fitted was refused ("the least any plan holds" then overstated).
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
          aten.t.default, aten.transpose.int, aten.expand.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor, aten.select.int,
          aten.alias.default, aten.copy_.default, torch.ops.fx2xla.mark_sharding.default}


def _base(node) -> torch.fx.Node:
    """The value whose memory `node` is: through views and a split's pieces."""
    while node.op == "call_function":
        src = _producer(node)
        if node.target in _VIEWS and node.args and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
        elif src is not None and src.target in SPLITS and isinstance(src.args[0], torch.fx.Node):
            node = src.args[0]
        else:
            break
    return node


def live_values(gm: torch.fx.GraphModule, values) -> list[tuple[torch.fx.Node, int, int]]:
    """The schedule of the computed values that hold memory, as (value, first step, last step)
    in graph order: a value lives from its op to its last reader (through its views), a graph
    output to the end. Not counted: views (their base is), and elementwise or matmul results
    read only by elementwise ops (XLA fuses the chain, a matmul's as its epilogue; its last link
    is counted, from the chain's first op). `values`: the nodes the program has variables for."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    end = len(order)
    base = {n: b for n in gm.graph.nodes if n.op == "call_function" and (b := _base(n)) is not n}
    last: dict = {}
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            b = base.get(a, a)
            last[b] = end if n.op == "output" else max(last.get(b, 0), order[n])

    def elementwise(n) -> bool:
        return n.op == "call_function" and is_pointwise(n.target) and n.target is not aten.copy_.default

    def fused(n) -> bool:
        users = list(n.users)
        return (elementwise(n) or n.target in MATMULS) and bool(users) and all(elementwise(u) for u in users)

    # A fused chain's first op is where its memory starts: its last link is counted from there.
    start = {n: order[n] for n in gm.graph.nodes}
    out = []
    for n in gm.graph.nodes:
        if n.op != "call_function" or n not in values or n in base or _multi_output(n):
            continue
        if fused(n):
            for u in n.users:
                start[u] = min(start[u], start[n])
            continue
        out.append((n, start[n], last.get(n, order[n])))
    return out


def _last_read(node, order) -> int:
    """The step of `node`'s last reader, through its views; its own step if not a view."""
    if node.target not in _VIEWS:
        return order[node]
    return max([order[node]] + [_last_read(u, order) if u.op == "call_function" else len(order) for u in node.users])


def _peak_steps(schedule) -> list[int]:
    """The steps of a `schedule` ((first step, last step, ...) per value) where the set of live
    values is largest among its neighbours: a value dies after it, and one was born since the
    last such step (the maximal cliques of the intervals). The memory at any other step is at
    most that at one of these."""
    ends = sorted({t[1] for t in schedule})
    starts = sorted(t[0] for t in schedule)
    steps, prev, i = [], -1, 0
    for e in ends:
        while i < len(starts) and starts[i] <= e:
            i += 1
        if i and starts[i - 1] > prev:
            steps.append(e)
            prev = e
    return steps


def solve(gm: torch.fx.GraphModule, sizes: dict[str, int], *, memory_budget: float | None = None,
          fixed: list | None = None, parameters: set[int] = frozenset(), training: bool = False,
          model: CostModel | None = None, time_limit: float = 10.0, gap: float = 1e-3,
          ties: dict | None = None) -> Solution:
    """The cheapest sharding of `gm`'s values over a mesh of `sizes` (see module doc).
    `fixed`: per placeholder, a spec it must keep (a user annotation) or None. `parameters`:
    placeholder positions holding parameters; with `training` they count four times in the
    budget (weights, gradients, two AdamW moments). `ties`: node -> an earlier node whose
    variables it shares (the same value in another of a run of identical layers, see
    `repeated_layers`): one decision per layer position, priced for every layer.

    Variables: one binary per (value, strategy); a unary elementwise value shares its
    operand's. Per edge (operand u of v), continuous e[s, t] >= 0 with sum_t e[s, t] = x_u[s]
    and sum_s e[s, t] = x_v[t]: the pair chosen, priced by the resharding it needs. This is
    Alpa's linearisation, much tighter than one product variable per costly pair."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    model = model or CostModel()
    t0 = time.perf_counter()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fixed = list(fixed) if fixed is not None else [None] * len(placeholders)
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")
             and ((isinstance(node_value(n), torch.Tensor) and node_shape(n) is not None) or _multi_output(n))]
    strategies: dict = {}
    root: dict = {}  # node -> the node whose variables it uses
    tied: set = set()  # nodes with their own strategies on another node's variables (ties)
    for n in nodes:
        if _multi_output(n):
            strategies[n], root[n] = _multi_output_strategies(n, sizes, model), n
            continue
        producer = _producer(n)
        if producer is not None:  # one output of a multi-output op: the op's variables
            root[n] = producer
            strategies[n] = [Strategy(st.out[n.args[1]] or replicated(n), []) for st in strategies[producer]]
            continue
        follow = _follows(n, strategies, sizes)
        if follow is not None:
            leader, specs = follow
            root[n] = root[leader]
            strategies[n] = [Strategy(out, [st.out]) for out, st in zip(specs, strategies[leader])]
            continue
        st = strategies_of(n, sizes, model)
        if n.op == "placeholder":
            want = fixed[placeholders.index(n)]
            if want is not None:
                st = [x for x in st if x.out == want] or [Strategy(want, [])]
        rep = ties.get(n) if ties else None
        if rep is not None and rep in strategies and root[rep] is rep \
                and [x.out for x in strategies[rep]] == [x.out for x in st]:
            strategies[n], root[n] = st, rep
            tied.add(n)
            continue
        strategies[n], root[n] = st, n
    index: dict = {}  # (root node, k) -> variable
    cost: list[float] = []
    for n in nodes:
        if root[n] is not n:
            continue
        whole = math.prod(node_shape(n)) * node_value(n).element_size() if n.op == "placeholder" else 0
        for k, st in enumerate(strategies[n]):
            index[(n, k)] = len(cost)
            cost.append(st.seconds + (whole / max(1, shard_count(st.out, sizes)) * model.delta if whole else 0.0))
    for n in (n for n in nodes if n in tied):  # (graph order: every process sums alike)
        # A tied node's own cost (collectives inside, compute, inputs held) is its root's too.
        whole = math.prod(node_shape(n)) * node_value(n).element_size() if n.op == "placeholder" else 0
        for k, st in enumerate(strategies[n]):
            cost[index[(root[n], k)]] += st.seconds + (whole / max(1, shard_count(st.out, sizes)) * model.delta
                                                       if whole else 0.0)
    for n in nodes:  # an elementwise follower's own compute lands on its leader's variables
        if root[n] is not n and n not in tied and is_pointwise(n.target):
            work = flops(n) * model.gamma
            for k, st in enumerate(strategies[n]):
                cost[index[(root[n], k)]] += work / max(1, shard_count(st.out, sizes))
    integer = [1] * len(cost)
    r_idx: list[int] = []
    c_idx: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(coeffs, low: float, high: float):
        i = len(lo)
        for j, c in coeffs:
            r_idx.append(i)
            c_idx.append(j)
            vals.append(c)
        lo.append(low)
        hi.append(high)

    for n in nodes:  # one strategy per value
        if root[n] is n:
            row([(index[(n, k)], 1.0) for k in range(len(strategies[n]))], 1.0, 1.0)
    edge_moved: dict = {}
    # (first step, last step, {variable: bytes per device}): copies and temporaries, held for a
    # span of the schedule.
    scratch: list = []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # Per edge (operand u of v), the cost depends only on u's layout and the layout v needs u
    # in: the pair variables are over those two (classes of u's and v's strategies), not over
    # every pair of strategies. A matmul's strategies that differ only in how they split the
    # other operand share one class.
    pairs: dict = {}  # (root of u, root of v, u's classes, v's classes) -> its pair variables
    for v in nodes:
        if (root[v] is not v and v not in tied) or v.op == "placeholder":
            continue
        rv = root[v]
        for slot, u in enumerate(tensor_operands(v)):
            if u not in strategies:
                continue
            ru, itemsize = root[u], node_value(u).element_size()
            whole = math.prod(node_shape(u)) * itemsize
            have = tuple(su.out for su in strategies[u])
            needs = tuple(sv.needs[slot] if slot < len(sv.needs) else None for sv in strategies[v])
            cu, cv = list(dict.fromkeys(have)), list(dict.fromkeys(needs))
            prices, copies = {}, {}
            for a_ in cu:
                for b_ in cv:
                    prices[(a_, b_)] = (0.0, 0.0) if b_ is None else reshard_cost(a_, b_, node_shape(u), itemsize, sizes, model)
                    if prices[(a_, b_)][1] > 0:  # the operand's copy in the layout v reads
                        copies[(a_, b_)] = whole / max(1, shard_count(b_, sizes))
            if all(p[0] <= 0 for p in prices.values()):
                continue  # free whatever both choose: no edge variables needed
            key = (ru, rv, have, needs)
            new = key not in pairs
            if not new:  # the same two decisions (tied layers): their pair, priced once more
                e = pairs[key]
                for pair, (seconds, moved) in prices.items():
                    cost[e[pair]] += seconds
                    edge_moved[e[pair]] += moved
            else:
                e = pairs[key] = {}
                for pair, (seconds, moved) in prices.items():
                    e[pair] = len(cost)
                    cost.append(seconds)
                    integer.append(0)
                    edge_moved[e[pair]] = moved
            if copies:
                # The copy exists from when u does (XLA schedules a reshard of an input at the
                # start: every gathered weight of a stack is live at once) to v; made for a
                # view, as long as the view's readers.
                b = _base(u)
                first = 0 if b.op == "placeholder" else order[b]
                scratch.append((first, _last_read(v, order), {e[pair]: nbytes for pair, nbytes in copies.items()}))
            if not new:
                continue
            for a_ in cu:
                row([(e[(a_, b_)], 1.0) for b_ in cv] + [(index[(ru, k)], -1.0) for k, h in enumerate(have) if h == a_],
                    0.0, 0.0)
            for b_ in cv:
                row([(e[(a_, b_)], 1.0) for a_ in cu] + [(index[(rv, k)], -1.0) for k, n in enumerate(needs) if n == b_],
                    0.0, 0.0)
    # Memory per device: the inputs, held throughout (parameters four times in a training
    # step: their gradients and AdamW moments are held beside them), plus at each peak step of
    # the schedule the values live then. One row per peak step, over the variables of the values
    # in it (Alpa's live-memory constraint).
    held: dict = {}
    for i, p in enumerate(placeholders):
        if p not in strategies or (root[p] is not p and p not in tied):
            continue
        factor = 4.0 if training and i in parameters else 1.0
        whole = math.prod(node_shape(p)) * node_value(p).element_size() * factor
        for k, st in enumerate(strategies[p]):
            j = index[(root[p], k)]
            held[j] = held.get(j, 0.0) + whole / max(1, shard_count(st.out, sizes))
    for v in nodes:  # attention's scores, [batch, heads, queries, keys], while it runs
        if _multi_output(v) and v.target in ATTENTION_OPS and (root[v] is v or v in tied) \
                and len(node_shape(tensor_operands(v)[0])) == 4 and len(tensor_operands(v)) >= 3:
            (b, h, sq, _), sk = node_shape(tensor_operands(v)[0]), node_shape(tensor_operands(v)[1])[2]
            scores = {}
            for k, st in enumerate(strategies[v]):
                j = index[(root[v], k)]
                scores[j] = scores.get(j, 0.0) + b * h * sq * sk * 4 / max(1, shard_count(st.out[0][:2], sizes))
            scratch.append((order[v], order[v], scores))
    intervals = []  # (first step, last step, {variable: bytes per device})
    for v, first, last in live_values(gm, strategies):
        whole = math.prod(node_shape(v)) * node_value(v).element_size()
        coeffs: dict = {}
        for k, st in enumerate(strategies[v]):
            j = index[(root[v], k)]
            coeffs[j] = coeffs.get(j, 0.0) + whole / max(1, shard_count(st.out, sizes))
        intervals.append((first, last, coeffs))
    intervals += scratch
    steps = [[c for first, last, c in intervals if first <= step <= last] for step in _peak_steps(intervals)]
    memory_rows = []  # per peak step: {variable: bytes}, to report the solution's peak
    for live in steps or [[]]:
        coeffs = dict(held)
        for c in live:
            for j, nbytes in c.items():
                coeffs[j] = coeffs.get(j, 0.0) + nbytes
        memory_rows.append(coeffs)
    unbounded: list[int] = []
    budget_rows: list[int] = []
    if memory_budget is not None:
        # Each value's bytes (and the inputs') as one continuous variable, defined once: a row
        # per peak step then holds one coefficient per live value rather than one per strategy
        # (or pair) of it, and tied layers' identical values share theirs. (Written out, the rows
        # held 90% of the program's nonzeros for a 12-layer GPT-2 on a 2-D mesh.)
        defined: dict = {}

        def term(coeffs: dict) -> tuple:
            key = tuple(sorted(coeffs.items()))
            if len(key) <= 2:
                return key
            if key not in defined:
                defined[key] = len(cost)
                cost.append(0.0)
                integer.append(0)
                unbounded.append(len(cost) - 1)
                row(list(key) + [(len(cost) - 1, -1.0)], 0.0, 0.0)
            return ((defined[key], 1.0),)

        seen = set()
        for live in steps or [[]]:
            acc: dict = {}
            for j, c in itertools.chain(term(held), *(term(c) for c in live)):
                acc[j] = acc.get(j, 0.0) + c
            key = tuple(sorted(acc.items()))
            if key not in seen:
                seen.add(key)
                budget_rows.append(len(lo))
                row(list(key), -np.inf, float(memory_budget))
    n_vars = len(cost)
    upper = np.ones(n_vars)
    upper[unbounded] = np.inf
    a = coo_array((vals, (r_idx, c_idx)), shape=(len(lo), n_vars)).tocsr()
    # In microseconds: HiGHS's absolute gap tolerance (1e-6) would call any plan within a
    # microsecond of the best optimal, were the objective in seconds.
    res = milp(np.array(cost) * 1e6, constraints=LinearConstraint(a, lo, hi), integrality=np.array(integer),
               bounds=Bounds(np.zeros(n_vars), upper),
               options={"time_limit": time_limit, "mip_rel_gap": gap, "disp": False})
    seconds = time.perf_counter() - t0
    if res.x is None:
        if memory_budget is not None and res.status == 2:
            least, bound, proven = _least_peak(a, lo, hi, integer, upper, budget_rows, time_limit)
            if least is None:
                said = "no plan was found within the time limit to say how little any holds"
            elif proven:
                said = (f"the least any plan holds is about {least:,.0f} bytes by this estimate (proven within "
                        f"0.1%; the solver's estimate, not a compiled executable's peak)")
            else:
                said = (f"the least plan found holds {least:,.0f} bytes by this estimate; the solver stopped at its "
                        f"time limit, and the least any plan holds is bounded below by {bound:,.0f} bytes (a bound)")
            raise InfeasibleBudget(f"fx2xla auto-sharding: no sharding of this graph fits {memory_budget:,.0f} "
                                   f"bytes per device on a mesh {sizes} (its inputs, and the values live at "
                                   f"once at its peak, checked at {len(memory_rows)} steps); " + said,
                                   least_estimate=least, least_bound=bound, proven=proven)
        raise RuntimeError(f"fx2xla auto-sharding: the solver stopped without a solution ({res.message})")
    x = res.x
    pick = {n: max(range(len(strategies[n])), key=lambda k: x[index[(n, k)]]) for n in nodes if root[n] is n}
    chosen = {n: strategies[n][pick[root[n]]] for n in nodes if not _multi_output(n)}
    sol = Solution([chosen[p].out if p in chosen else None for p in placeholders])
    sol.specs = {n: st.out for n, st in chosen.items()}
    for v in nodes:
        if (root[v] is not v and v not in tied) or v.op == "placeholder":
            continue
        st = strategies[v][pick[root[v]]]
        reads = {}
        for slot, u in enumerate(tensor_operands(v)):
            need = st.needs[slot] if slot < len(st.needs) else None
            if need is not None and u in sol.specs and sol.specs[u] != need:
                reads[u] = need
        if reads:
            sol.operand_constraints[v] = reads
    sol.objective = float(res.fun) * 1e-6
    sol.collective_bytes = float(sum(st.moved for n, st in chosen.items() if root[n] is n or n in tied)
                                 + sum(b for y, b in edge_moved.items() if x[y] > 0.5))
    sol.input_bytes = float(sum(c for j, c in held.items() if x[j] > 0.5))
    sol.memory_bytes = max(float(sum(c for j, c in r.items() if x[j] > 0.5)) for r in memory_rows)
    sol.status = "optimal" if res.status == 0 else f"stopped ({res.message})"
    sol.gap = getattr(res, "mip_gap", None)
    sol.seconds = seconds
    sol.variables = n_vars
    sol.tied = len(tied)
    return sol


def _least_peak(a, lo, hi, integer, upper, budget_rows, time_limit) -> tuple:
    """(the smallest peak a plan found holds, a lower bound on the peak of any plan, whether the
    first is proven least within 0.1%), by the program's own estimate: its rows with the peak
    steps' bound replaced by one more variable, minimised. (None, bound, False) if the solver
    stops before it finds a plan."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array, hstack

    n = a.shape[1]
    col = coo_array((-np.ones(len(budget_rows)), (budget_rows, np.zeros(len(budget_rows), dtype=int))),
                    shape=(a.shape[0], 1))
    hi = np.array(hi, dtype=float)
    hi[budget_rows] = 0.0
    cost = np.zeros(n + 1)
    cost[n] = 1.0
    res = milp(cost, constraints=LinearConstraint(hstack([a, col]).tocsr(), lo, hi),
               integrality=np.array(list(integer) + [0]), bounds=Bounds(np.zeros(n + 1), np.append(upper, np.inf)),
               options={"time_limit": time_limit, "mip_rel_gap": 1e-3, "disp": False})
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(bound) if bound is not None and np.isfinite(bound) else 0.0
    if res.x is None:
        return None, bound, False
    return float(res.x[n]), min(bound, float(res.x[n])), res.status == 0


# Solutions by key, in this process; on disk beside the executables (FX2XLA_CACHE_DIR), so a
# new process (a restart, another rank) takes the same plan without solving again.
_solutions: dict = {}
_FORMAT = "fx2xla-auto-sharding-3"  # bumped when the formulation changes what a key's solution is


def clear_solutions() -> None:
    """Forgets the solutions kept in this process, as a new process starts (the disk cache
    stays): the next `solve_cached` of a graph takes it from `store` or solves it."""
    _solutions.clear()


def graph_key(gm: torch.fx.GraphModule) -> str:
    """The graph as the solver sees it: every node's op, target, arguments, shape and dtype."""
    lines = []
    for n in gm.graph.nodes:
        v = node_value(n)
        meta = (tuple(v.shape), str(v.dtype)) if isinstance(v, torch.Tensor) else \
            tuple((tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else repr(x) for x in v) \
            if isinstance(v, (tuple, list)) else repr(v)
        lines.append(f"{n.name} {n.op} {n.target} {n.args} {n.kwargs} {meta}")
    return "\n".join(lines)


def solve_cached(gm: torch.fx.GraphModule, sizes: dict[str, int], store=None, share=None, **kwargs) -> Solution:
    """`solve`, or the solution an earlier solve of the same graph, mesh, budget, constraints
    and cost model left in this process or in `store` (`Solution.cached` says which).

    `store`: where solutions persist across processes (`get(key) -> bytes | None`,
    `put(key, bytes)`; the backend lends the disk cache's), or None. `share`: over several
    processes, every process must run the same plan, and a solve stopped by its time limit may
    differ from one process to another: process 0 decides (from its caches or by solving) and
    `share(key, text)` hands its text to every process (the others pass None and get it: "process
    0"); None in a single process. The backend lends fx2xla.distributed's."""
    import hashlib
    import json

    args = {k: kwargs.get(k) for k in ("memory_budget", "fixed", "training", "time_limit", "gap")}
    args["model"] = kwargs.get("model") or CostModel()  # (the defaults' values: a new default re-solves)
    args["parameters"] = sorted(kwargs.get("parameters") or ())
    args["ties"] = sorted((a.name, b.name) for a, b in (kwargs.get("ties") or {}).items())
    key = (_FORMAT, graph_key(gm), repr(sorted(sizes.items())), repr(args))
    nodes = {n.name: n for n in gm.graph.nodes}
    hit = _solutions.get(key)
    if hit is not None:
        return solution_from_record(hit, nodes, "memory")
    kv_key = "fx2xla/auto-sharding/" + hashlib.sha256("\x00".join(key).encode()).hexdigest()
    if share is not None and not share.decides:
        record = json.loads(share(kv_key, None))
        _solutions[key] = record
        return solution_from_record(record, nodes, "process 0")
    blob = None if store is None else store.get(key)
    if blob is not None:
        record, sol = json.loads(blob), None
        where = "disk"
    else:
        sol = solve(gm, sizes, **kwargs)
        record, where = solution_record(sol), None
        if store is not None:
            store.put(key, json.dumps(record).encode())
    _solutions[key] = record
    if share is not None:  # process 0: what every other process runs
        share(kv_key, json.dumps(record))
    return sol if sol is not None else solution_from_record(record, nodes, where)


def least_memory(gm: torch.fx.GraphModule, sizes: dict[str, int], **kwargs) -> tuple:
    """(the least peak per device a plan was found to hold by the estimate, a lower bound on any
    plan's, whether the first is proven least within 0.1%) for `solve`'s program (its other
    arguments as `solve`'s; a budget given is ignored). Kept per program in this process."""
    args = {k: v for k, v in kwargs.items() if k != "memory_budget"}
    key = (graph_key(gm), repr(sorted(sizes.items())), repr(sorted((k, repr(v)) for k, v in args.items()
                                                                   if k not in ("ties", "parameters"))),
           repr(sorted(args.get("parameters") or ())),
           repr(sorted((a.name, b.name) for a, b in (args.get("ties") or {}).items())))
    hit = _least.get(key)
    if hit is not None:
        return hit
    try:  # every coefficient of a memory row is >= 0: presolve refuses this budget at once
        sol = solve(gm, sizes, memory_budget=-1.0, **args)
    except InfeasibleBudget as e:
        hit = (e.least_estimate, e.least_bound, e.proven)
    else:  # (a graph holding nothing)
        hit = (sol.memory_bytes, sol.memory_bytes, True)
    _least[key] = hit
    return hit


def solve_least(gm: torch.fx.GraphModule, sizes: dict[str, int], store=None, share=None,
                **kwargs) -> Solution | None:
    """The cheapest plan among those that hold the least memory by the estimate (`least_memory`),
    by `solve_cached` under that budget (rounded up to a KiB, so that every process asks for
    the same one); None where the solver found no plan in its time limit."""
    least, _, _ = least_memory(gm, sizes, **kwargs)
    if least is None:
        return None
    budget = math.ceil((least * (1 + 1e-6) + 64) / 1024) * 1024
    return solve_cached(gm, sizes, store, share, **{**kwargs, "memory_budget": float(budget)})


_least: dict = {}


def solution_record(sol: Solution) -> dict:
    """`sol` as JSON-able data (what the caches and process 0 keep and hand on)."""
    return {"input_specs": sol.input_specs, "specs": {n.name: s for n, s in sol.specs.items()},
            "needs": {v.name: {u.name: s for u, s in reads.items()} for v, reads in sol.operand_constraints.items()},
            "objective": sol.objective, "collective_bytes": sol.collective_bytes, "memory_bytes": sol.memory_bytes,
            "input_bytes": sol.input_bytes,
            "status": sol.status, "gap": sol.gap, "seconds": sol.seconds, "variables": sol.variables}


def _spec(s) -> tuple | None:
    return None if s is None else tuple(tuple(axes) for axes in s)


def solution_from_record(r: dict, nodes: dict, where: str) -> Solution:
    """The Solution `solution_record` made `r` from, over the graph whose nodes by name are
    `nodes`; `where` it came from (`Solution.cached`)."""
    sol = Solution([_spec(s) for s in r["input_specs"]])
    sol.specs = {nodes[k]: _spec(s) for k, s in r["specs"].items()}
    sol.operand_constraints = {nodes[v]: {nodes[u]: _spec(s) for u, s in reads.items()}
                               for v, reads in r["needs"].items()}
    sol.objective, sol.collective_bytes, sol.memory_bytes = r["objective"], r["collective_bytes"], r["memory_bytes"]
    sol.input_bytes = r["input_bytes"]
    sol.status, sol.gap, sol.seconds, sol.variables = r["status"], r["gap"], r["seconds"], r["variables"]
    sol.cached = where
    return sol
