"""What the two sharding passes (propagation in sharding.py, the solver in auto_sharding.py) and
their table of per-op rules (op_rules.py) share: a node's value, static shape and tensor
operands, which ops are pointwise or attention, what a spec is, the candidate specs of a shape,
and how a per-dim spec maps through a reshape."""
from __future__ import annotations

import itertools
import math

import torch
from torch.ops import aten


def node_value(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def node_shape(node):
    v = node_value(node)
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def node_ndim(node) -> int:
    v = node_value(node)
    return v.dim() if isinstance(v, torch.Tensor) else 0


def output_shapes(node) -> list:
    """Per output of an op with several, its shape (None for a non-tensor)."""
    return [tuple(int(d) for d in v.shape) if isinstance(v, torch.Tensor) else None for v in node_value(node)]


def tensor_operands(node) -> list:
    return [a for a in node.all_input_nodes if isinstance(node_value(a), torch.Tensor)]


def replicated(node) -> tuple:
    """The spec that keeps every dim of `node` whole."""
    return tuple(() for _ in range(len(node_shape(node) or ())))


def is_spec(s) -> bool:
    """Whether `s` is one spec (a tuple of mesh axes per dim), not a spec per output of an op."""
    return all(isinstance(a, tuple) and all(isinstance(x, str) for x in a) for a in s)


def is_sharded(spec) -> bool:
    return isinstance(spec, tuple) and is_spec(spec) and any(spec)


def shard_count(spec, sizes) -> int:
    """How many pieces `spec` cuts a tensor into over a mesh of `sizes`."""
    return math.prod(sizes[a] for axes in spec for a in axes)


def candidate_specs(shape, sizes: dict[str, int]) -> list[tuple]:
    """Every spec of a `shape` tensor where each mesh axis shards at most one dim it divides."""
    axes = list(sizes)
    options = []
    for a in axes:
        opts = [None] + [d for d, n in enumerate(shape) if n >= sizes[a] and n % sizes[a] == 0]
        options.append(opts)
    specs = []
    for choice in itertools.product(*options):
        dims = [[] for _ in shape]
        for a, d in zip(axes, choice):
            if d is not None:
                dims[d].append(a)
        spec = tuple(tuple(x) for x in dims)
        if all(n % math.prod(sizes[a] for a in s) == 0 for s, n in zip(spec, shape)):
            specs.append(spec)
    return list(dict.fromkeys(specs))


_POINTWISE_EXTRA = {aten._to_copy.default, aten.alias.default, aten.copy.default, aten.copy_.default,
                    aten.fill.Scalar, aten.fill.Tensor, aten.lift_fresh_copy.default, aten.detach.default}


def is_pointwise(target) -> bool:
    return target in _POINTWISE_EXTRA or (isinstance(target, torch._ops.OpOverload)
                                          and torch.Tag.pointwise in target.tags)


def fit_spec(spec, shape, sizes) -> tuple | None:
    """`spec` with axes dropped where they do not divide the dim, or repeat an axis."""
    if spec is None or shape is None or len(spec) != len(shape):
        return None
    used, out = set(), []
    for axes, n in zip(spec, shape):
        keep = []
        for a in axes:
            if a in used or a not in sizes:
                continue
            if n % (math.prod(sizes[x] for x in keep) * sizes[a]):
                break
            keep.append(a)
            used.add(a)
        out.append(tuple(keep))
    return tuple(out)


def normalized_dims(dims, ndim) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims) if dims is not None else list(range(ndim))
    return [d + ndim if d < 0 else d for d in dims] or list(range(ndim))


def reshape_spec(spec, in_shape, out_shape):
    """Map a spec through a reshape: dims grouped where their products meet; a split dim keeps
    its axes on its leading part, merged dims keep the leading dim's axes."""
    out = [() for _ in out_shape]
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(i)
                pi *= in_shape[i]
            else:
                j += 1
                gj.append(j)
                pj *= out_shape[j]
        lead_in = next((d for d in gi if in_shape[d] != 1), gi[0])
        lead_out = next((d for d in gj if out_shape[d] != 1), gj[0])
        if spec[lead_in] and all(not spec[d] for d in gi if d != lead_in):
            out[lead_out] = spec[lead_in]
        i += 1
        j += 1
    return tuple(out)


ATTENTION_OPS = {aten._scaled_dot_product_flash_attention_for_cpu.default}
