"""The per-op sharding rules, one table read by both sharding passes.

`RULES` maps an op (an aten OpOverload; also `operator.getitem`) to an `OpRule` holding its two
directions side by side:
- `propagate(node, specs)`: the node's spec from its operands' (`specs`: node -> spec), for
  propagation (passes/sharding.py).
- `strategies(node, sizes, model)`: the node's candidate `Strategy`s (an output spec, the spec
  the op needs each tensor operand in, and what the op costs), for the auto-sharding solver
  (passes/auto_sharding.py; `sizes`: mesh axis sizes, `model`: its CostModel). For an op with
  several outputs, each strategy's `out` holds one spec per output (None for a non-tensor).

`rule_of(op)` looks an op up: its own entry, else the pointwise family (`POINTWISE`: every op
`is_pointwise` accepts), else None. A direction that is None, or that returns None for the
form a node takes, leaves the node to its pass's generic fallback: propagation leaves the value
unknown (replicated, unless the backward fill reaches it), the solver runs the op on whole
operands into a whole output. A sharding constraint (fx2xla::mark_sharding) is no rule: both
passes take its layout as given before they look here.

Entries (P: propagation, S: strategies):
- pointwise family (P, S): operands aligned from the right (broadcast dims whole), laid out like
  the output. `copy_` (P, S) has an entry of its own: a written input keeps one layout.
- mm, addmm, bmm (P, S): rows from the first operand, columns from the second; a strategy may
  split the contracted dim, whose partial sums are all-reduced.
- embedding (P, S): the ids' layout, then the table's embedding dim; a strategy may split the
  vocabulary (partial lookups, all-reduced).
- permute, t, transpose (P, S); unsqueeze (P, S); view, _unsafe_view, reshape (P, S); expand
  (P, S); slice (P, S: the sliced dim whole); select (P, S).
- _softmax, _log_softmax (P, S), sum.dim_IntList, mean.dim, amax (P, S): the reduced dims whole.
- attention (ATTENTION_OPS) (P, S): the outputs follow q; a strategy splits q over batch and
  heads only, k and v alike.
- native_layer_norm (P, S): the normalised dims whole.
- Propagation only (`PROPAGATION_ONLY`): getitem (the solver gives each output of a
  multi-output op its producer's variables); squeeze, cumsum, amin, prod, var, any, argmax,
  argmin (the solver has no rule for them: it runs them whole).
- Strategies only (`STRATEGIES_ONLY`): cat, split, split_with_sizes, unbind, chunk, index
  (propagation has no rule for them: their results stay unknown).
tests/passes/test_op_rules.py holds the table to these two sets, so that an op does not get
one direction silently.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx
from torch.ops import aten

from .spec_rules import (ATTENTION_OPS, candidate_specs, is_pointwise, is_sharded, is_spec, node_ndim, node_shape,
                         node_value, normalized_dims, output_shapes, replicated, reshape_spec, shard_count,
                         tensor_operands)


@dataclass(frozen=True)
class OpRule:
    """One op's (or op family's) sharding rules, both directions (see the module doc)."""

    propagate: Callable | None = None  # (node, specs) -> the node's spec, or None
    strategies: Callable | None = None  # (node, sizes, model) -> [Strategy], or None


@dataclass
class Strategy:
    out: tuple  # the output's spec
    needs: list  # per tensor operand: the spec the op needs it in (None: any, no cost)
    seconds: float = 0.0  # collectives inside the op (partial sums) and compute
    moved: float = 0.0  # bytes per device those collectives move


MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default}
SPLITS = {aten.split_with_sizes.default, aten.split.Tensor, aten.unbind.int, aten.chunk.default}
_PERMUTES = (aten.permute.default, aten.t.default, aten.transpose.int)
_RESHAPES = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SQUEEZES = (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
_SOFTMAXES = (aten._softmax.default, aten._log_softmax.default)
_REDUCTIONS = (aten.sum.dim_IntList, aten.mean.dim, aten.amax.default)
_OTHER_REDUCTIONS = (aten.amin.default, aten.prod.dim_int, aten.var.correction, aten.any.dim, aten.argmax.default,
                     aten.argmin.default)


def flops(node) -> float:
    """The node's work: a matmul's multiply-adds, one per output element otherwise."""
    t = node.target
    if t in MATMULS:
        a = node.args[1] if t is aten.addmm.default else node.args[0]
        sa, out = node_shape(a), node_shape(node)
        return 2.0 * math.prod(out) * sa[-1]
    shape = node_shape(node)
    return float(math.prod(shape)) if shape else 0.0


def permutation(node, nd) -> list[int]:
    """For a permute, t or transpose of `nd` dims: output dim d is its operand's dim perm[d]."""
    if node.target is aten.t.default:
        return list(reversed(range(nd)))
    if node.target is aten.permute.default:
        return normalized_dims(node.args[1], nd)
    a, b = normalized_dims([node.args[1], node.args[2]], nd)
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return perm


def _merge(out_shape, operand_specs) -> tuple:
    """Pointwise: operands aligned from the right (broadcast); per output dim the first
    operand's axes that are not already taken."""
    n = len(out_shape)
    out, used = [], set()
    for d in range(n):
        chosen = ()
        for spec, shape in operand_specs:
            k = d - (n - len(spec))
            if k < 0 or shape[k] == 1 or not spec[k] or used & set(spec[k]):
                continue
            chosen = spec[k]
            break
        used |= set(chosen)
        out.append(chosen)
    return tuple(out)


def _aligned(out_spec, shape, out_shape) -> tuple:
    """The spec an operand of `shape` broadcast to `out_shape` takes from the output's."""
    lead = len(out_shape) - len(shape)
    return tuple(() if shape[d] == 1 and out_shape[lead + d] != 1 else out_spec[lead + d] for d in range(len(shape)))


def _operand_specs(node, specs):
    out = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, torch.fx.Node) and isinstance(node_value(a), torch.Tensor) and is_sharded(specs.get(a)):
            out.append((specs[a], node_shape(a)))
    return out


def _input_spec(node, specs):
    x = node.args[0] if node.args else None
    return specs.get(x) if isinstance(x, torch.fx.Node) else None


def _maps_input(fn):
    """A propagation rule that maps its first operand's spec, `fn(node, spec)`: nothing to map
    where that operand has none."""
    @functools.wraps(fn)
    def rule(node, specs):
        xs = _input_spec(node, specs)
        return None if xs is None or not is_spec(xs) else fn(node, xs)
    return rule


# ---------------------------------------------------------------------------------------------
# Propagation: (node, specs) -> the node's spec (None: nothing known)


def _pointwise(node, specs):
    ops = _operand_specs(node, specs)
    return _merge(node_shape(node), ops) if ops else None


def _copy(node, specs):  # a written input keeps its own sharding
    return specs.get(node.args[0]) or specs.get(node.args[1])


def _getitem(node, specs):  # one output of a multi-output op: the op's spec for it
    src = specs.get(node.args[0])
    return src[node.args[1]] if isinstance(src, (tuple, list)) and not is_spec(src) else None


def _matmul(node, specs):
    t, args = node.target, node.args
    a, b = (args[1], args[2]) if t is aten.addmm.default else (args[0], args[1])
    sa, sb = specs.get(a), specs.get(b)
    if not (is_sharded(sa) or is_sharded(sb)):
        return None
    sa = sa or tuple(() for _ in range(node_ndim(a)))
    sb = sb or tuple(() for _ in range(node_ndim(b)))
    if t is aten.bmm.default:
        batch = sa[0] or sb[0]
        rows, cols = sa[1], sb[2]
        return (batch, rows if not set(rows) & set(batch) else (), cols if not set(cols) & set(batch) | set(rows) else ())
    return (sa[0], sb[1] if not set(sb[1]) & set(sa[0]) else ())


def _embedding(node, specs):  # weight [V, D], ids [...] -> [..., D]
    ids = specs.get(node.args[1]) or tuple(() for _ in range(node_ndim(node.args[1])))
    weight = _input_spec(node, specs) or ((), ())
    return tuple(ids) + (weight[1],) if is_sharded(tuple(ids) + (weight[1],)) else None


@_maps_input
def _permuted(node, xs):
    return tuple(xs[p] for p in permutation(node, len(xs)))


@_maps_input
def _unsqueezed(node, xs):
    d = node.args[1] + len(xs) + 1 if node.args[1] < 0 else node.args[1]
    return xs[:d] + ((),) + xs[d:]


@_maps_input
def _squeezed(node, xs):
    shape = node_shape(node.args[0])
    dims = normalized_dims(node.args[1], len(xs)) if len(node.args) > 1 else [d for d, n in enumerate(shape) if n == 1]
    return tuple(s for d, s in enumerate(xs) if not (d in dims and shape[d] == 1))


@_maps_input
def _reshaped(node, xs):
    return reshape_spec(xs, node_shape(node.args[0]), node_shape(node))


@_maps_input
def _expanded(node, xs):
    out_shape, in_shape = node_shape(node), node_shape(node.args[0])
    lead = len(out_shape) - len(xs)
    return tuple(() for _ in range(lead)) + tuple(
        s if in_shape[d] == out_shape[lead + d] else () for d, s in enumerate(xs))


@_maps_input
def _sliced(node, xs):
    d = normalized_dims(node.args[1] if len(node.args) > 1 else 0, len(xs))[0]
    return tuple(() if i == d and node_shape(node)[d] != node_shape(node.args[0])[d] else s for i, s in enumerate(xs))


@_maps_input
def _selected(node, xs):
    d = normalized_dims(node.args[1], len(xs))[0]
    return xs[:d] + xs[d + 1:]


@_maps_input
def _whole_along(node, xs):  # softmax, cumsum: the dim they run along whole
    d = normalized_dims(node.args[1], len(xs))[0]
    return tuple(() if i == d else s for i, s in enumerate(xs))


@_maps_input
def _reduced(node, xs):
    args = node.args
    dims = normalized_dims(args[1] if len(args) > 1 else node.kwargs.get("dim"), len(xs))
    keep = node.kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
    return tuple(() if d in dims else s for d, s in enumerate(xs)) if keep else \
        tuple(s for d, s in enumerate(xs) if d not in dims)


@_maps_input
def _attention(node, xs):  # (out [b, h, s, d], logsumexp [b, h, s], ...): sharded like q
    return (xs, xs[:3]) if len(xs) == 4 else None


@_maps_input
def _layer_norm(node, xs):
    nd, k = len(xs), len(node.args[1])
    out = xs[:nd - k] + tuple(() for _ in range(k))
    stats = xs[:nd - k] + tuple(() for _ in range(k))
    return (out, stats, stats)


# ---------------------------------------------------------------------------------------------
# Strategies: (node, sizes, model) -> [Strategy] (None: no rule for this form of the op)


def _pointwise_strategies(node, sizes, model):
    shape = node_shape(node)
    if shape is None:  # several outputs (frexp): no rule
        return None
    work = flops(node) * model.gamma
    out = []
    for s in candidate_specs(shape, sizes):
        needs = [_aligned(s, node_shape(a), shape) if len(node_shape(a)) <= len(shape) else None
                 for a in tensor_operands(node)]
        out.append(Strategy(s, needs, work / max(1, shard_count(s, sizes))))
    return out


def _copy_strategies(node, sizes, model):  # a written input keeps one layout, old and new
    if len(tensor_operands(node)) != 2:
        return None
    return [Strategy(s, [s, s]) for s in candidate_specs(node_shape(node), sizes)]


def _matmul_strategies(node, sizes, model):
    t = node.target
    a, b = (node.args[1], node.args[2]) if t is aten.addmm.default else (node.args[0], node.args[1])
    batched = t is aten.bmm.default
    dims = ("B", "M", "N", "K", None) if batched else ("M", "N", "K", None)
    out_shape = node_shape(node)
    k = node_shape(a)[-1]
    extent = dict(zip(("B", "M", "N") if batched else ("M", "N"), out_shape)) | {"K": k}
    itemsize = node_value(node).element_size()
    strategies = []
    for choice in itertools.product(dims, repeat=len(sizes)):
        by = {d: [a_ for a_, c in zip(sizes, choice) if c == d] for d in ("B", "M", "N", "K")}
        if any(extent[d] % math.prod(sizes[x] for x in axes) for d, axes in by.items() if axes and d in extent):
            continue
        B, M, N, K = (tuple(by[d]) for d in ("B", "M", "N", "K"))
        out = (B, M, N) if batched else (M, N)
        need_a = (B, M, K) if batched else (M, K)
        need_b = (B, K, N) if batched else (K, N)
        parts = math.prod(sizes[ax] for ax, c in zip(sizes, choice) if c is not None)
        seconds = flops(node) / parts * model.gamma
        moved = 0.0
        if K:  # partial sums over the contracted dim: all-reduced (a ring: 2 (n-1)/n of the bytes)
            local = math.prod(out_shape) * itemsize / max(1, shard_count(out, sizes))
            for x in K:
                n = sizes[x]
                moved += 2 * local * (n - 1) / n
                seconds += model.alpha + 2 * local * (n - 1) / n * model.beta
        needs = [need_a, need_b]
        if t is aten.addmm.default:
            bias = node.args[0]
            needs = [_aligned(out, node_shape(bias), out_shape)] + needs
        strategies.append(Strategy(out, needs, seconds, moved))
    return strategies


def _embedding_strategies(node, sizes, model):
    """weight [V, D], ids [...] -> [..., D]. The ids are laid out like the output's leading
    dims, the weight's D like the output's last. V is whole, or split over mesh axes the output
    does not use (Megatron's vocab-parallel embedding): each device looks up the rows it holds
    (zeros for the others) and the partial results are all-reduced over those axes, as for a
    matmul's contracted dim; XLA's partitioner does exactly that for a gather whose operand is
    split on the gathered dim. Without it, a weight split by vocab had to be gathered (or
    moved to split D) before the lookup: a copy XLA holds twice during an all-to-all."""
    if len(tensor_operands(node)) != 2:
        return None
    weight = node.args[0]
    vocab = node_shape(weight)[0]
    shape = node_shape(node)
    itemsize = node_value(node).element_size()
    out = []
    for s in candidate_specs(shape, sizes):
        used = {a for axes in s for a in axes}
        free = [a for a in sizes if a not in used]
        for r in range(len(free) + 1):
            for split in itertools.combinations(free, r):
                if vocab % math.prod(sizes[a] for a in split):
                    continue
                seconds = moved = 0.0
                local = math.prod(shape) * itemsize / max(1, shard_count(s, sizes))
                for a in split:  # the partial lookups' all-reduce (a ring: 2 (n-1)/n of the bytes)
                    n = sizes[a]
                    moved += 2 * local * (n - 1) / n
                    seconds += model.alpha + 2 * local * (n - 1) / n * model.beta
                out.append(Strategy(s, [(tuple(split), s[-1]), s[:-1]], seconds, moved))
    return out


def _reshape_strategies(node, sizes, model):  # the layouts that map through the reshape and back
    ops = tensor_operands(node)
    if not ops:
        return None
    shape, in_shape = node_shape(node), node_shape(ops[0])
    out = []
    for s in candidate_specs(shape, sizes):
        need = reshape_spec(s, shape, in_shape)
        if reshape_spec(need, in_shape, shape) == s:
            out.append(Strategy(s, [need]))
    return out or None


def _permute_strategies(node, sizes, model):
    if not tensor_operands(node):
        return None
    shape = node_shape(node)
    nd = len(shape)
    perm = permutation(node, nd)
    inv = [perm.index(d) for d in range(nd)]
    return [Strategy(s, [tuple(s[inv[d]] for d in range(nd))]) for s in candidate_specs(shape, sizes)]


def _reduction_strategies(node, sizes, model):  # reductions and softmax: the reduced dims whole
    ops = tensor_operands(node)
    if not ops:
        return None
    shape, in_shape = node_shape(node), node_shape(ops[0])
    dims = normalized_dims(node.args[1], len(in_shape))
    keep = node.target in _SOFTMAXES or (len(node.args) > 2 and node.args[2]) or node.kwargs.get("keepdim", False)
    work = flops(node) * model.gamma
    out = []
    for s in candidate_specs(shape, sizes):
        if keep:
            need = tuple(() if d in dims else s[d] for d in range(len(in_shape)))
            if need != s and len(shape) == len(in_shape) and any(s[d] for d in dims):
                continue
        else:
            it = iter(s)
            need = tuple(() if d in dims else next(it) for d in range(len(in_shape)))
        out.append(Strategy(s, [need], work / max(1, shard_count(s, sizes))))
    return out


def _slice_strategies(node, sizes, model):  # the sliced dim whole (unless the slice takes all of it)
    ops = tensor_operands(node)
    if not ops:
        return None
    shape = node_shape(node)
    d = normalized_dims(node.args[1] if len(node.args) > 1 else 0, len(shape))[0]
    full = node_shape(ops[0])[d] == shape[d]
    return [Strategy(s, [s]) for s in candidate_specs(shape, sizes) if full or not s[d]]


def _select_strategies(node, sizes, model):  # the selected dim whole
    if not tensor_operands(node):
        return None
    shape = node_shape(node)
    d = normalized_dims(node.args[1], len(shape) + 1)[0]
    return [Strategy(s, [s[:d] + ((),) + s[d:]]) for s in candidate_specs(shape, sizes)]


def _cat_strategies(node, sizes, model):  # the concatenated dim whole, every piece alike
    ops = tensor_operands(node)
    if not ops:
        return None
    shape = node_shape(node)
    d = normalized_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), len(shape))[0]
    return [Strategy(s, [s if len(node_shape(a)) == len(shape) else None for a in ops])
            for s in candidate_specs(shape, sizes) if not s[d]]


def _unsqueeze_strategies(node, sizes, model):
    if not tensor_operands(node):
        return None
    shape = node_shape(node)
    d = normalized_dims(node.args[1], len(shape))[0]
    return [Strategy(s, [s[:d] + s[d + 1:]]) for s in candidate_specs(shape, sizes) if not s[d]]


def _expand_strategies(node, sizes, model):  # broadcast dims whole in the operand
    ops = tensor_operands(node)
    if not ops:
        return None
    shape, in_shape = node_shape(node), node_shape(ops[0])
    return [Strategy(s, [_aligned(s, in_shape, shape)]) for s in candidate_specs(shape, sizes)]


def _index_strategies(node, sizes, model):
    """`x[i, j]` (aten.index): the indexed dims of x whole, its other dims laid out like the
    output's; the index tensors (broadcast together) laid out like the output's dims they make.
    Those dims stand where the indexed dims were when these are adjacent, else first."""
    if not tensor_operands(node):
        return None
    x, indices = node.args[0], list(node.args[1])
    x_shape, shape = node_shape(x), node_shape(node)
    at = [d for d, i in enumerate(indices) if i is not None]
    if not at or not all(isinstance(indices[d], torch.fx.Node) and node_shape(indices[d]) is not None for d in at):
        return None
    k = len(shape) - (len(x_shape) - len(at))  # the dims the broadcast index makes
    lead = at[0] if at == list(range(at[0], at[-1] + 1)) else 0
    rest = [d for d in range(len(x_shape)) if d not in at]
    work = flops(node) * model.gamma
    out = []
    for s in candidate_specs(shape, sizes):
        made, kept = s[lead:lead + k], s[:lead] + s[lead + k:]
        need_x = [()] * len(x_shape)
        for d, spec in zip(rest, kept):
            need_x[d] = spec
        needs = {x: tuple(need_x)}
        for d in at:
            needs.setdefault(indices[d], _aligned(made, node_shape(indices[d]), tuple(shape[lead:lead + k])))
        out.append(Strategy(s, [needs.get(a) for a in tensor_operands(node)], work / max(1, shard_count(s, sizes))))
    return out


def _attention_strategies(node, sizes, model):
    """Follows q over batch and heads; the sequence and head dims whole (k and v are read whole
    over them)."""
    shapes, ops = output_shapes(node), tensor_operands(node)
    first = shapes[0]
    if first is None or len(first) != 4 or len(ops) < 3:
        return None
    return [Strategy((s,) + tuple(None if sh is None else s[:len(sh)] for sh in shapes[1:]),
                     [s, (s[0], s[1], (), ()), (s[0], s[1], (), ())] + [None] * (len(ops) - 3))
            for s in candidate_specs(first, sizes) if not s[2] and not s[3]]


def _layer_norm_strategies(node, sizes, model):
    """The normalised dims whole; the statistics follow the rest; weight and bias whole."""
    shapes, ops = output_shapes(node), tensor_operands(node)
    first = shapes[0]
    if first is None:
        return None
    k, nd = len(node.args[1]), len(first)
    return [Strategy((s,) + tuple(None if sh is None else s[:nd - k] + ((),) * (len(sh) - nd + k) for sh in shapes[1:]),
                     [s] + [replicated(a) for a in ops[1:]])
            for s in candidate_specs(first, sizes) if not any(s[nd - k:])]


def _split_strategies(node, sizes, model):  # the pieces laid out alike, the split dim whole
    shapes, ops = output_shapes(node), tensor_operands(node)
    first = shapes[0]
    if not ops or first is None:
        return None
    in_shape = node_shape(ops[0])
    if node.target is aten.unbind.int:
        d = normalized_dims(node.args[1] if len(node.args) > 1 else 0, len(in_shape))[0]
        return [Strategy(tuple(s for _ in shapes), [s[:d] + ((),) + s[d:]]) for s in candidate_specs(first, sizes)]
    d = normalized_dims(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), len(in_shape))[0]
    return [Strategy(tuple(s for _ in shapes), [s]) for s in candidate_specs(first, sizes)
            if not s[d] and all(sh is None or all(n % shard_count((axes,), sizes) == 0 for n, axes in zip(sh, s))
                                for sh in shapes)]


# ---------------------------------------------------------------------------------------------
# The table (see the module doc)


POINTWISE = OpRule(_pointwise, _pointwise_strategies)

RULES: dict = {
    aten.copy_.default: OpRule(_copy, _copy_strategies),
    **dict.fromkeys(MATMULS, OpRule(_matmul, _matmul_strategies)),
    aten.embedding.default: OpRule(_embedding, _embedding_strategies),
    **dict.fromkeys(_PERMUTES, OpRule(_permuted, _permute_strategies)),
    aten.unsqueeze.default: OpRule(_unsqueezed, _unsqueeze_strategies),
    **dict.fromkeys(_RESHAPES, OpRule(_reshaped, _reshape_strategies)),
    aten.expand.default: OpRule(_expanded, _expand_strategies),
    aten.slice.Tensor: OpRule(_sliced, _slice_strategies),
    aten.select.int: OpRule(_selected, _select_strategies),
    **dict.fromkeys(_SOFTMAXES, OpRule(_whole_along, _reduction_strategies)),
    **dict.fromkeys(_REDUCTIONS, OpRule(_reduced, _reduction_strategies)),
    **dict.fromkeys(ATTENTION_OPS, OpRule(_attention, _attention_strategies)),
    aten.native_layer_norm.default: OpRule(_layer_norm, _layer_norm_strategies),
    # propagation only
    operator.getitem: OpRule(_getitem),
    **dict.fromkeys(_SQUEEZES, OpRule(_squeezed)),
    aten.cumsum.default: OpRule(_whole_along),
    **dict.fromkeys(_OTHER_REDUCTIONS, OpRule(_reduced)),
    # strategies only
    aten.cat.default: OpRule(strategies=_cat_strategies),
    **dict.fromkeys(SPLITS, OpRule(strategies=_split_strategies)),
    aten.index.Tensor: OpRule(strategies=_index_strategies),
}

# The entries with one direction only (see the module doc for why each).
PROPAGATION_ONLY = frozenset({operator.getitem, *_SQUEEZES, aten.cumsum.default, *_OTHER_REDUCTIONS})
STRATEGIES_ONLY = frozenset({aten.cat.default, *SPLITS, aten.index.Tensor})


def rule_of(target) -> OpRule | None:
    """The rules of an op: its own entry, else the pointwise family's, else None."""
    rule = RULES.get(target)
    if rule is None and is_pointwise(target):
        return POINTWISE
    return rule
