"""Lowering rules: torch's chunked linear cross-entropy (`F.linear_cross_entropy(...,
options=torch.nn.LinearCrossEntropyOptions(...))`, torch >= 2.13).

torch runs it as two custom ops, registered by name here (older torch has neither):
- `torch_nn._linear_cross_entropy_batch_chunked` (reduction "mean" or "sum"): returns the loss
  and, already in the forward, the gradients for the input, the linear weight and the bias
  (each an empty [0, 0] / [0] tensor where its flag says it is not needed); the backward graph
  only scales them by the loss's gradient.
- `torch_nn._linear_cross_entropy_batch_chunked_no_reduction` (reduction "none"): the
  per-row losses; its backward is torch's Python code, traced into the backward graph.

Both are cross-entropy of `input @ linear_weight.T + bias` without label smoothing (torch takes
this path only then), with optional class weights and ignore_index: eager's F.cross_entropy.
The batch is split into chunks of `batch_chunk_size` rows, as torch does, by a loop in the
executable (`lax.scan`; the last chunk padded with ignored rows), so only one chunk's [rows,
classes] logits live at a time; without a chunk size, one chunk. Half-precision inputs compute
in the options' accumulation dtype (float32 unless it says otherwise).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .dtypes import to_jax_dtype
from .linalg import accumulation_dtype, matmul_precision
from .registry import RejectedInput, register_lowering


def _acc(x, acc_dtype):
    """The dtype the loss is computed in: the options' acc_dtype where it is wider than the
    input's, else the input's own opmath dtype (float32 for bf16/f16)."""
    dt = np.dtype(accumulation_dtype(x.dtype))
    if acc_dtype is not None:
        wanted = np.dtype(to_jax_dtype(acc_dtype))
        if wanted.itemsize > dt.itemsize:
            dt = wanted
    return dt


def _per_row(x, w, b, target, weight, ignore_index, acc):
    """Each row's loss, weighted by its class weight (0 for an ignored row)."""
    x, w = x.astype(acc), w.astype(acc)
    logits = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=matmul_precision(acc))
    if b is not None:
        logits = logits + b.astype(acc)
    t = jnp.where(target != ignore_index, target, 0)
    picked = jnp.take_along_axis(logits, t[:, None], axis=1)[:, 0]
    return (jax.nn.logsumexp(logits, axis=1) - picked) * _row_weights(target, weight, ignore_index, acc)


def _row_weights(target, weight, ignore_index, acc):
    """Each row's class weight (1 without class weights), 0 for an ignored row."""
    valid = target != ignore_index
    t = jnp.where(valid, target, 0)
    cw = jnp.ones(t.shape, acc) if weight is None else weight.astype(acc)[t]
    return jnp.where(valid, cw, jnp.zeros((), acc))


@register_lowering("torch_nn._linear_cross_entropy_batch_chunked.default")
def _linear_cross_entropy_chunked(ctx, x, w, target, b, weight, reduction, ignore_index, label_smoothing,
                                  batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph,
                                  compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad):
    """(loss, grad_input, grad_linear_weight, grad_linear_bias): the loss's gradients for a
    loss gradient of 1, in the input's dtype; mean divides by the summed class weights of the
    rows not ignored (NaN where every row is)."""
    if reduction not in ("mean", "sum"):
        raise RejectedInput(f"linear_cross_entropy does not support reduction={reduction!r}")
    if label_smoothing != 0.0:
        raise RejectedInput("linear_cross_entropy's chunked op takes no label smoothing")
    _check_target(ctx, w, target, ignore_index)
    _check_shapes(x, w, target)
    acc = _acc(x, acc_dtype)
    total, (gx, gw, gb) = _chunked_sum(x, w, b, target, weight, ignore_index, acc, batch_chunk_size)
    if reduction == "mean":  # the summed weights do not depend on x, w or b: scale the sum's gradients
        denom = jnp.sum(_row_weights(target, weight, ignore_index, acc))
        total, gx, gw = total / denom, gx / denom, gw / denom
        gb = None if gb is None else gb / denom
    out = x.dtype
    empty2, empty1 = jnp.zeros((0, 0), out), jnp.zeros((0,), out)
    return (total.astype(out),
            gx.astype(out) if compute_input_grad else empty2,
            gw.astype(out) if compute_linear_weight_grad else empty2,
            gb.astype(out) if compute_linear_bias_grad and gb is not None else empty1)


def _chunks(x, target, ignore_index, chunk):
    """x and target as [chunks, chunk rows, ...], the last chunk padded with ignored rows."""
    n = x.shape[0]
    chunk = max(1, n if not chunk or chunk >= n else int(chunk))
    k = -(-n // chunk)
    pad = k * chunk - n
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(k, chunk, x.shape[1])
    ts = jnp.pad(target, (0, pad), constant_values=ignore_index).reshape(k, chunk)
    return xs, ts, n


def _chunked_sum(x, w, b, target, weight, ignore_index, acc, chunk):
    """(the summed loss, its gradients for x, w and b), one chunk of rows at a time."""
    xs, ts, n = _chunks(x, target, ignore_index, chunk)

    def body(carry, inputs):
        total, gw, gb = carry
        xc, tc = inputs

        def loss_of(xc_, w_, b_):
            return jnp.sum(_per_row(xc_, w_, b_, tc, weight, ignore_index, acc))

        value, pull = jax.vjp(loss_of, xc, w, b)
        gxc, gwc, gbc = pull(jnp.ones((), value.dtype))
        gb = None if gb is None else gb + gbc.astype(acc)
        return (total + value, gw + gwc.astype(acc), gb), gxc

    init = (jnp.zeros((), acc), jnp.zeros(w.shape, acc), None if b is None else jnp.zeros(b.shape, acc))
    (total, gw, gb), gx = jax.lax.scan(body, init, (xs, ts))
    return total, (gx.reshape(-1, x.shape[1])[:n], gw, gb)


@register_lowering("torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default")
def _linear_cross_entropy_chunked_none(ctx, x, w, target, b, weight, ignore_index, batch_chunk_size, acc_policy,
                                       acc_dtype):
    """Each row's loss (0 for an ignored row), in the input's dtype."""
    _check_target(ctx, w, target, ignore_index)
    _check_shapes(x, w, target)
    acc = _acc(x, acc_dtype)
    xs, ts, n = _chunks(x, target, ignore_index, batch_chunk_size)

    def body(_, inputs):
        return None, _per_row(inputs[0], w, b, inputs[1], weight, ignore_index, acc)

    _, losses = jax.lax.scan(body, None, (xs, ts))
    return losses.reshape(-1)[:n].astype(x.dtype)


def _check_shapes(x, w, target):
    if x.ndim != 2 or w.ndim != 2 or target.ndim != 1:
        raise RejectedInput(f"linear_cross_entropy chunked op: input [N, D], linear_weight [C, D] and target [N] "
                            f"expected, got {tuple(x.shape)}, {tuple(w.shape)} and {tuple(target.shape)}")


def _check_target(ctx, w, target, ignore_index):
    """Every target not ignored names a class, as eager checks."""
    ctx.check_index(jnp.where(target == ignore_index, 0, target), w.shape[0], negative=False, what="target")
