"""Channels-last values between convolutions, on the CPU.

torch's convolutions run inside XLA:CPU executables on channels-last (NHWC) memory
(torch_kernels.py): on NCHW memory oneDNN is about 3x slower. Lowered op by op, every
convolution then reads a transpose of its NCHW input and writes a transpose back, and batch
norm, ReLU and pooling run on NCHW values in between: in a CNN's training step those layout
changes took as long as the convolutions themselves (docs/benchmarks.md).

`plan_channels_last` decides, from the graph alone and before anything is traced, which values
are computed channels-last: the ops between convolutions that can run on NHWC values as well
(pointwise ops, batch norm, max and average pooling and their backward, reductions,
concatenation and slicing) and read a value that is channels-last already. `run_nodes` lowers
such a node on NHWC operands and transposes its 4-D results back to torch's NCHW; XLA's
algebraic simplifier folds each transpose pair that meets, so only the transposes where a
channels-last value reaches an op that is not here are left.

The plan reads `physical` as well: a forward graph's activations that only the backward reads
leave the executable channels-last (as Inductor leaves them), and the backward takes them so.

FX2XLA_CHANNELS_LAST=0 turns it off; read when a graph is planned.
"""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass

import jax.numpy as jnp
import torch
import torch.fx

from ..layouts import dense_permutation
from .registry import PYTHON_OPS, is_array, lowering_for

aten = torch.ops.aten

TO_LAST, TO_FIRST = (0, 2, 3, 1), (0, 3, 1, 2)  # NCHW -> NHWC, and back
POSITION = (0, 3, 1, 2)  # NCHW dim d sits at POSITION[d] in NHWC

_CONVOLUTIONS = {aten.convolution.default}
_CONVOLUTION_BACKWARDS = {aten.convolution_backward.default}
# Batch norms whose first argument and first result are the (N, C, H, W) activations: lowered on
# NHWC values seen as (N*H*W, C), a batch norm over a 2-D input.
_BATCH_NORMS = {
    aten._native_batch_norm_legit_functional.default, aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_no_training.default, aten._native_batch_norm_legit.no_stats,
    aten.native_batch_norm.default,
}
_POOLS = {aten.max_pool2d_with_indices.default, aten.max_pool2d_with_indices_backward.default,
          aten.avg_pool2d.default, aten.avg_pool2d_backward.default}
# Reductions over a dim list: (position of the dims argument, position of keepdim).
_REDUCTIONS = {aten.sum.dim_IntList: (1, 2), aten.mean.dim: (1, 2), aten.amax.default: (1, 2),
               aten.amin.default: (1, 2)}
# Concatenation of 4-D values (the channels of a UNet's skip connection, an Inception block),
# and slices of one (a concatenation's backward): ops with one dim argument, at position 1.
_CATS = {aten.cat.default}
_SLICES = {aten.slice.Tensor}
# Elementwise ops torch does not tag pointwise.
_IDENTITIES = {aten.alias.default, aten.clone.default, aten.detach.default, aten._to_copy.default}


def enabled() -> bool:
    return os.environ.get("FX2XLA_CHANNELS_LAST", "").strip().lower() not in ("0", "off", "false", "no")


@dataclass(frozen=True)
class ChannelsLast:
    """`nodes`: lowered on NHWC values (run_nodes). `physical`: every node whose value is a
    transpose of an NHWC array in the module (those nodes, the convolutions, the input
    gradients of convolutions, channels-last inputs): one of them may leave the executable
    channels-last at no cost. `weights`: inputs read only as 2-D convolutions' weights."""

    nodes: frozenset = frozenset()
    physical: frozenset = frozenset()
    weights: frozenset = frozenset()


NONE = ChannelsLast()


def _meta(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else None


def _static_4d(v) -> bool:
    return (isinstance(v, torch.Tensor) and v.dim() == 4
            and not any(isinstance(s, torch.SymInt) for s in v.shape))


def _float_conv(node) -> bool:
    """A 2-D convolution over a batch (4-D input and weight) of one floating dtype."""
    x, w = _meta(node.args[0]), _meta(node.args[1])
    return (_static_4d(x) and _static_4d(w) and x.dtype == w.dtype and x.dtype.is_floating_point
            and x.numel() > 0 and w.numel() > 0)


def channels_last_input(v) -> bool:
    """A 4-D example input laid out channels-last: the plan passes it as NHWC (a PERMUTED input
    by the same dense-permutation test)."""
    return _static_4d(v) and v.numel() > 1 and dense_permutation(tuple(v.shape), tuple(v.stride())) == TO_LAST


def plan_channels_last(gm: torch.fx.GraphModule, example_inputs, platform: str, mesh_id) -> ChannelsLast:
    """Which values of `gm` are computed channels-last (the module docstring). Nothing on
    other platforms than the CPU, in programs over a mesh, or with FX2XLA_CHANNELS_LAST=0."""
    if platform != "cpu" or mesh_id is not None or not enabled():
        return NONE
    nodes, physical = set(), set()
    # Multi-result nodes: the positions of their results that are NHWC.
    items: dict[torch.fx.Node, frozenset] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, ex in zip(placeholders, example_inputs):
        if channels_last_input(ex):
            physical.add(node)
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem:
            src, i = node.args
            if i in items.get(src, ()):
                physical.add(node)
            continue
        if target in PYTHON_OPS:
            continue
        if target in _CONVOLUTIONS and _float_conv(node):
            physical.add(node)
            continue
        if target in _CONVOLUTION_BACKWARDS and _float_conv_backward(node):
            items[node] = frozenset({0})
            continue
        if not any(isinstance(a, torch.fx.Node) and a in physical for a in node.all_input_nodes):
            continue
        result = _lowerable(node)
        if result is None:
            continue
        nodes.add(node)
        if result == "tensor":
            physical.add(node)
        else:
            items[node] = result
    weights = frozenset(p for p in placeholders if p.users and all(
        u.target in _CONVOLUTIONS and _float_conv(u) and u.args[1] is p and p not in (u.args[0], *u.args[2:])
        for u in p.users))
    return ChannelsLast(frozenset(nodes), frozenset(physical), weights)


def _float_conv_backward(node) -> bool:
    """convolution_backward(grad, input, weight, ...) of a 2-D convolution that computes the
    input's gradient: that gradient comes out of torch's kernel NHWC."""
    grad, x, w = (_meta(a) for a in node.args[:3])
    mask = node.args[10] if len(node.args) > 10 else (True, True, True)
    return (mask[0] and _static_4d(grad) and _static_4d(x) and _static_4d(w) and x.dtype == w.dtype == grad.dtype
            and x.dtype.is_floating_point and x.numel() > 0 and w.numel() > 0 and grad.numel() > 0)


def _lowerable(node):
    """How `node` runs on NHWC values: "tensor" (one 4-D result, NHWC), a frozenset of the
    positions of its 4-D results (multi-result ops), or None (it reads NCHW values)."""
    target, out = node.target, _meta(node)
    rule = lowering_for(target, "cpu")
    if rule is None or rule.draws(node) or rule.subgraphs is not None:
        return None
    args = [_meta(a) for a in node.all_input_nodes]
    if not all(isinstance(a, torch.Tensor) for a in args):
        return None
    if target in _BATCH_NORMS or target in _POOLS:
        if not _static_4d(_meta(node.args[0])):
            return None
        if isinstance(out, torch.Tensor):
            return "tensor" if _static_4d(out) else None
        if isinstance(out, (tuple, list)):
            return frozenset(i for i, o in enumerate(out) if _static_4d(o)) or None
        return None
    if target in _CATS:
        parts = node.args[0]
        return "tensor" if _static_4d(out) and all(_static_4d(_meta(t)) for t in parts) else None
    if target in _SLICES:
        return "tensor" if _static_4d(out) and _static_4d(_meta(node.args[0])) else None
    if target in _REDUCTIONS:
        if _reduced_dims(node) is None:  # every dim (or none): not worth a layout
            return None
        if not _static_4d(out):
            return frozenset() if _order_kept(node) else None  # the result reads the same either way
        return "tensor" if _keepdim(node) else None
    if not _static_4d(out):
        return None
    pointwise = target in _IDENTITIES or (isinstance(target, torch._ops.OpOverload)
                                          and torch.Tag.pointwise in target.tags)
    # Pointwise: operands of up to 4 dims broadcast against the 4-D result.
    if pointwise and all(a.dim() <= 4 and not any(isinstance(s, torch.SymInt) for s in a.shape) for a in args):
        return "tensor"
    return None


def _reduced_dims(node) -> list[int] | None:
    x = _meta(node.args[0])
    at = _REDUCTIONS[node.target][0]
    dims = node.args[at] if len(node.args) > at else node.kwargs.get("dim")
    if not _static_4d(x) or dims is None:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    return sorted({d % 4 for d in dims}) if dims else None


def _keepdim(node) -> bool:
    at = _REDUCTIONS[node.target][1]
    return bool(node.args[at] if len(node.args) > at else node.kwargs.get("keepdim", False))


def _order_kept(node) -> bool:
    """A reduction without keepdim whose remaining dims come out in the same order from NHWC
    (e.g. the sum over N, H and W that a batch norm's backward takes)."""
    dims = _reduced_dims(node)
    if dims is None or _keepdim(node):
        return False
    left = [d for d in range(4) if d not in dims]
    return [POSITION[d] for d in left] == sorted(POSITION[d] for d in left)


def lower(rule, ctx, args: list, kwargs: dict, prepare):
    """Lower `ctx.node` (one of a plan's `nodes`) on NHWC operands: `args` and `kwargs` hold
    torch's NCHW values, and so does what this returns. `prepare(args, kwargs)`: the rule's
    promotion and broadcasting, applied on the NHWC operands."""
    node = ctx.node
    if node.target in _BATCH_NORMS:
        # The activations as (N*H*W, C): a batch norm over a 2-D input, reshaped for free.
        x = jnp.transpose(args[0], TO_LAST)
        args = [x.reshape(-1, x.shape[-1]), *args[1:]]
        args, kwargs = prepare(args, kwargs)
        out = rule.fn(ctx, *args, **kwargs)
        first = jnp.transpose(out[0].reshape(x.shape), TO_FIRST)
        return (first, *out[1:]) if isinstance(out, (tuple, list)) else first
    if node.target in _REDUCTIONS:
        args, kwargs = _reduction_args(node, [jnp.transpose(args[0], TO_LAST), *args[1:]], kwargs)
    elif node.target in _CATS or node.target in _SLICES:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        first = ([jnp.transpose(t, TO_LAST) for t in args[0]] if node.target in _CATS
                 else jnp.transpose(args[0], TO_LAST))
        args, kwargs = [first, POSITION[dim % 4], *args[2:]], {k: v for k, v in kwargs.items() if k != "dim"}
    else:
        pointwise = node.target not in _POOLS
        args = [_to_last(a, pointwise) for a in args]
        kwargs = {k: _to_last(v, pointwise) for k, v in kwargs.items()}
    args, kwargs = prepare(args, kwargs)
    out = rule.fn(ctx, *args, **kwargs)
    if isinstance(out, (tuple, list)):
        return type(out)(_to_first(o) for o in out)
    return _to_first(out)


def _to_last(a, pointwise: bool):
    """An NCHW operand as NHWC; for pointwise ops, one of fewer dims (broadcast against the
    result) as well, aligned to 4 dims first."""
    if not is_array(a) or a.ndim == 0 or (a.ndim < 4 and not pointwise):
        return a
    if a.ndim < 4:
        a = a.reshape((1,) * (4 - a.ndim) + tuple(a.shape))
    return jnp.transpose(a, TO_LAST)


def _to_first(a):
    return jnp.transpose(a, TO_FIRST) if is_array(a) and a.ndim == 4 else a


def _reduction_args(node, args: list, kwargs: dict):
    """A reduction's arguments with its dims as positions in NHWC."""
    at = _REDUCTIONS[node.target][0]
    dims = [POSITION[d] for d in _reduced_dims(node)]
    if len(args) > at:
        args = [*args[:at], dims, *args[at + 1:]]
    else:
        kwargs = {**kwargs, "dim": dims}
    return args, kwargs


def saved_strides(shape) -> tuple[int, ...]:
    """torch's strides of an (N, C, H, W) tensor whose memory is NHWC, row-major."""
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c)
