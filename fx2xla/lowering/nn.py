"""Lowering rules: nn — activations, softmax, normalization, convolution, pooling, upsampling,
attention, and the backward ops AOTAutograd leaves undecomposed.

Half-precision inputs are computed in float32 (torch's "opmath" type) and rounded once when
the registry casts the result to torch's output dtype. Window geometry (pool indices, divisors,
interpolation weights) depends only on static shapes, so it is computed with numpy at trace
time and enters the program as constants.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import torch
import torch.fx
from torch.ops import aten

from .. import torch_kernels
from .linalg import accumulation_dtype, dot, dot_result_dtype, matmul_precision
from .dtypes import to_jax_dtype, to_torch_dtype
from .registry import RejectedInput, base_key, concrete_shape, current_platform, register_lowering
from .shape import canonical_dim


def _opmath(x):
    """`x` in the dtype torch computes it in: float32 for bf16/f16, unchanged otherwise."""
    dt = accumulation_dtype(x.dtype)
    return x if x.dtype == dt else x.astype(dt)


def _vjp(fn, primals, cotangent, opmath: bool = True):
    """Gradients of `fn` (one output) at `primals` for `cotangent`, computed in opmath dtypes;
    `opmath=False`: in the primals' own (half-precision GEMMs on GPUs: see `_half_gemm`)."""
    out, pull = jax.vjp(fn, *[_opmath(p) if opmath else p for p in primals])
    return pull(cotangent.astype(out.dtype))


def _half_gemm(dtype) -> bool:
    """Whether GEMMs and convolutions of `dtype` run in it on the platform being lowered for
    (bf16/f16 on GPUs: float32 accumulation inside the kernel, as torch's), rather than on
    operands upcast to float32 (the CPU; float32 itself): see linalg.dot_result_dtype."""
    dtype = jnp.dtype(dtype)
    return dtype != accumulation_dtype(dtype) and dot_result_dtype(dtype) == dtype


def _channel(v, ndim):
    """A per-channel vector (C,) shaped to broadcast against an (N, C, *spatial) tensor."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _masked(grads, mask):
    """Backward ops return None for the gradients their output_mask does not ask for."""
    return tuple(g if m else None for g, m in zip(grads, mask))


# ---------------------------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------------------------

@register_lowering(aten.relu.default)
def _relu(ctx, x):
    return jnp.maximum(x, jnp.zeros((), x.dtype))  # max propagates NaN, like torch


def _gelu(x, approximate="none"):
    x = _opmath(x)
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + jnp.tanh(inner))
    return x * 0.5 * (1.0 + lax.erf(x * (1.0 / math.sqrt(2.0))))


@register_lowering(aten.gelu.default)
def _gelu_rule(ctx, x, *, approximate="none"):
    return _gelu(x, approximate)


@register_lowering(aten.gelu_backward.default)
def _gelu_backward(ctx, grad, x, *, approximate="none"):
    return _vjp(lambda y: _gelu(y, approximate), (x,), grad)[0]


@register_lowering(aten.elu.default)
def _elu(ctx, x, alpha=1, scale=1, input_scale=1):
    x = _opmath(x)
    return jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * (alpha * scale))


@register_lowering(aten.leaky_relu.default)
def _leaky_relu(ctx, x, negative_slope=0.01):
    x = _opmath(x)
    return jnp.where(x > 0, x, x * negative_slope)


@register_lowering(aten.hardtanh.default)
def _hardtanh(ctx, x, min_val=-1, max_val=1):
    # torch converts the bounds to the tensor's dtype (truncating for integers); NaN passes.
    lo, hi = (jnp.asarray(v, x.dtype) for v in (min_val, max_val))
    return jnp.minimum(jnp.maximum(x, lo), hi)


@register_lowering(aten.threshold_backward.default)
def _threshold_backward(ctx, grad, x, threshold):
    return jnp.where(x <= threshold, jnp.zeros((), grad.dtype), grad)


# ---------------------------------------------------------------------------------------------
# Softmax
# ---------------------------------------------------------------------------------------------

def _softmax_parts(x, dim):
    """(x - max, sum(exp(x - max))) along `dim`, in opmath; 0-d inputs act as 1-element."""
    x = _opmath(x)
    shifted = x - jnp.max(x, axis=dim, keepdims=True, initial=-jnp.inf)
    return shifted, jnp.sum(jnp.exp(shifted), axis=dim, keepdims=True)


def _with_dim(x, dim, fn):
    """Apply `fn(x, dim)` with torch's dim wrapping; a 0-d tensor is treated as shape (1,)."""
    if x.ndim == 0:
        return fn(x.reshape(1), 0).reshape(())
    return fn(x, canonical_dim(dim, x.ndim))


@register_lowering(aten._softmax.default)
def _softmax(ctx, x, dim, half_to_float):
    def fn(x, d):
        shifted, total = _softmax_parts(x, d)
        return jnp.exp(shifted) / total
    return _with_dim(x, dim, fn)


@register_lowering(aten._log_softmax.default)
def _log_softmax(ctx, x, dim, half_to_float):
    def fn(x, d):
        shifted, total = _softmax_parts(x, d)
        return shifted - jnp.log(total)
    return _with_dim(x, dim, fn)


@register_lowering(aten._softmax_backward_data.default)
def _softmax_backward_data(ctx, grad, out, dim, input_dtype):
    def fn(g, d):
        g, y = _opmath(g), _opmath(out.reshape(g.shape))
        return y * (g - jnp.sum(g * y, axis=d, keepdims=True))
    return _with_dim(grad, dim, fn)


@register_lowering(aten._log_softmax_backward_data.default)
def _log_softmax_backward_data(ctx, grad, out, dim, input_dtype):
    def fn(g, d):
        g, y = _opmath(g), _opmath(out.reshape(g.shape))
        return g - jnp.exp(y) * jnp.sum(g, axis=d, keepdims=True)
    return _with_dim(grad, dim, fn)


# ---------------------------------------------------------------------------------------------
# Normalization
# ---------------------------------------------------------------------------------------------

def _moments(x, axes):
    """Mean and biased variance over `axes` (kept), two-pass like torch."""
    mean = jnp.mean(x, axis=axes, keepdims=True)
    return mean, jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)


def _layer_norm(x, normalized_ndim, weight, bias, eps):
    x = _opmath(x)
    axes = tuple(range(x.ndim - normalized_ndim, x.ndim))
    mean, var = _moments(x, axes)
    rstd = lax.rsqrt(var + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * _opmath(weight)
    if bias is not None:
        out = out + _opmath(bias)
    return out, mean, rstd


@register_lowering(aten.native_layer_norm.default)
def _native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    return _layer_norm(x, len(normalized_shape), weight, bias, eps)


def _normalized_input_grad(gw, xhat, rstd, axes):
    """d(loss)/dx of xhat = (x - mean) * rstd, given gw = d(loss)/dxhat, using the saved rstd."""
    mean_gw = jnp.mean(gw, axis=axes, keepdims=True)
    mean_gw_xhat = jnp.mean(gw * xhat, axis=axes, keepdims=True)
    return rstd * (gw - mean_gw - xhat * mean_gw_xhat)


@register_lowering(aten.native_layer_norm_backward.default)
def _native_layer_norm_backward(ctx, grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    # eps is not an argument: the gradient is written in terms of the saved mean and rstd.
    grad, x, mean, rstd = (_opmath(v) for v in (grad, x, mean, rstd))
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    lead = tuple(range(x.ndim - len(normalized_shape)))
    xhat = (x - mean) * rstd
    gw = grad if weight is None else grad * _opmath(weight)
    dx = _normalized_input_grad(gw, xhat, rstd, axes) if output_mask[0] else None
    dw = jnp.sum(grad * xhat, axis=lead) if output_mask[1] else None
    db = jnp.sum(grad, axis=lead) if output_mask[2] else None
    return dx, dw, db


def _batch_norm_apply(x, mean, invstd, weight, bias):
    """(x - mean) * invstd * weight + bias as torch does it: x * alpha + beta per channel."""
    alpha = invstd if weight is None else invstd * _opmath(weight)
    beta = -mean * alpha if bias is None else _opmath(bias) - mean * alpha
    return x * _channel(alpha, x.ndim) + _channel(beta, x.ndim)


def _batch_norm_eval(ctx, x, weight, bias, running_mean, running_var, eps):
    x = _opmath(x)
    mean = _opmath(running_mean).astype(x.dtype)
    invstd = lax.rsqrt(_opmath(running_var).astype(x.dtype) + eps)
    out = _batch_norm_apply(x, mean, invstd, weight, bias)
    # save_mean/save_rstd in eval: empty on the CPU, the running mean and 1/sqrt(var + eps) on
    # accelerators (torch's own kernels differ; its meta value says which this graph has).
    saved = ctx.out[1]
    if saved.numel() == 0:
        empty = jnp.zeros((0,), x.dtype)
        return out, empty, empty
    dtype = to_jax_dtype(saved.dtype)
    return out, mean.astype(dtype), invstd.astype(dtype)


def _batch_norm_train(x, weight, bias, eps):
    """Batch statistics over (N, *spatial): returns out, mean (C,), biased var (C,), rstd (C,)."""
    x = _opmath(x)
    axes = (0,) + tuple(range(2, x.ndim))
    mean, var = _moments(x, axes)
    mean, var = mean.reshape(-1), var.reshape(-1)
    rstd = lax.rsqrt(var + eps)
    return _batch_norm_apply(x, mean, rstd, weight, bias), mean, var, rstd


@register_lowering(aten._native_batch_norm_legit_no_training.default)
def _bn_no_training(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm_eval(ctx, x, weight, bias, running_mean, running_var, eps)


@register_lowering(aten._native_batch_norm_legit.default)
def _bn_legit(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        return _batch_norm_eval(ctx, x, weight, bias, running_mean, running_var, eps)
    # The in-place running-stat update cannot be expressed here; functionalized graphs carry
    # it as _native_batch_norm_legit_functional (below), which returns the new statistics.
    out, mean, _, rstd = _batch_norm_train(x, weight, bias, eps)
    return out, mean, rstd


@register_lowering(aten._native_batch_norm_legit.no_stats)
def _bn_no_stats(ctx, x, weight, bias, training, momentum, eps):
    out, mean, _, rstd = _batch_norm_train(x, weight, bias, eps)
    return out, mean, rstd


@register_lowering(aten._native_batch_norm_legit_functional.default)
def _bn_functional(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        out, save_mean, save_rstd = _batch_norm_eval(ctx, x, weight, bias, running_mean, running_var, eps)
        return out, save_mean, save_rstd, running_mean, running_var
    out, mean, var, rstd = _batch_norm_train(x, weight, bias, eps)
    n = x.size // x.shape[1]
    unbiased = var * (n / (n - 1)) if n > 1 else var * jnp.nan  # torch divides by n - 1 = 0
    new_mean = (1 - momentum) * _opmath(running_mean) + momentum * mean
    new_var = (1 - momentum) * _opmath(running_var) + momentum * unbiased
    return out, mean, rstd, new_mean, new_var


@register_lowering(aten._batch_norm_with_update_functional.default)
def _bn_with_update_functional(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    """Training batch norm as torch.export and pre-dispatch graphs carry it: (out, save_mean,
    save_invstd, reserve, new running mean, new running var); `reserve` is the cuDNN workspace,
    empty on the CPU (its shape and dtype from the op's meta)."""
    out, mean, rstd, new_mean, new_var = _bn_functional(ctx, x, weight, bias, running_mean, running_var, True,
                                                        momentum, eps)
    reserve = ctx.out[3]
    return (out, mean, rstd, jnp.zeros(concrete_shape(reserve.shape, ctx.sizes), to_jax_dtype(reserve.dtype)),
            new_mean, new_var)


def _group_norm(x, weight, bias, n, c, hxw, group, eps):
    x = _opmath(x)
    y = x.reshape(n, group, (c // group) * hxw)
    mean, var = _moments(y, (2,))
    rstd = lax.rsqrt(var + eps)
    out = ((y - mean) * rstd).reshape(x.shape)
    if weight is not None:
        out = out * _channel(_opmath(weight), x.ndim)
    if bias is not None:
        out = out + _channel(_opmath(bias), x.ndim)
    return out, mean.reshape(n, group), rstd.reshape(n, group)


@register_lowering(aten.native_group_norm.default)
def _native_group_norm(ctx, x, weight, bias, n, c, hxw, group, eps):
    return _group_norm(x, weight, bias, n, c, hxw, group, eps)


@register_lowering(aten.native_group_norm_backward.default)
def _native_group_norm_backward(ctx, grad, x, mean, rstd, weight, n, c, hxw, group, output_mask):
    # Written in terms of the saved mean/rstd (eps is not an argument), grouped as (N, G, D).
    shape = x.shape
    grad, x, mean, rstd = (_opmath(v) for v in (grad, x, mean, rstd))
    grouped = (n, group, (c // group) * hxw)
    xhat = (x.reshape(grouped) - mean[..., None]) * rstd[..., None]
    gw = grad if weight is None else grad * _channel(_opmath(weight), grad.ndim)
    dx = _normalized_input_grad(gw.reshape(grouped), xhat, rstd[..., None], (2,)).reshape(shape)
    per_channel = (n, c, hxw)
    dw = jnp.sum((grad.reshape(grouped) * xhat).reshape(per_channel), axis=(0, 2))
    db = jnp.sum(grad.reshape(per_channel), axis=(0, 2))
    return _masked((dx, dw, db), output_mask)


# ---------------------------------------------------------------------------------------------
# Convolution
# ---------------------------------------------------------------------------------------------

def _per_dim(v, nd):
    """A size/stride/padding argument as one int per spatial dim (torch allows a single one)."""
    v = [int(i) for i in (v if isinstance(v, (list, tuple)) else [v])]
    return v * nd if len(v) == 1 else v


def _conv(x, w, stride, padding, dilation, transposed, output_padding, groups):
    """torch's convolution (batched, no bias) as one conv_general_dilated."""
    nd = w.ndim - 2
    stride, padding, dilation, output_padding = (
        _per_dim(v, nd) for v in (stride, padding, dilation, output_padding))
    spatial = "DHW"[3 - nd:] if nd <= 3 else None
    dims = ("NC" + spatial, "OI" + spatial, "NC" + spatial)
    # bf16/f16 convs stay in their dtype on GPUs (cuDNN accumulates in float32 and rounds once
    # as it writes, like torch's); on the CPU they run in float32 (see linalg's module doc).
    if dot_result_dtype(x.dtype) != x.dtype:
        x, w = _opmath(x), _opmath(w)
    common = dict(dimension_numbers=dims, feature_group_count=groups,
                  precision=matmul_precision(x.dtype), preferred_element_type=x.dtype)
    if not transposed:
        return lax.conv_general_dilated(
            x, w, stride, [(p, p) for p in padding], rhs_dilation=dilation, **common)
    # Transposed conv = conv of the stride-dilated input with the flipped kernel whose
    # (in, out/groups) channels are swapped within each group.
    k = w.shape[2:]
    cin, cout_g = w.shape[:2]
    w = w.reshape((groups, cin // groups, cout_g) + k)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + k)
    w = lax.rev(w, tuple(range(2, 2 + nd)))
    pads = [(d * (kk - 1) - p, d * (kk - 1) - p + op)
            for kk, p, d, op in zip(k, padding, dilation, output_padding)]
    return lax.conv_general_dilated(
        x, w, (1,) * nd, pads, lhs_dilation=stride, rhs_dilation=dilation, **common)


@register_lowering(aten.convolution.default)
def _convolution(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    unbatched = x.ndim == w.ndim - 1
    out = _conv(x[None] if unbatched else x, w, stride, padding, dilation, transposed,
                output_padding, groups)
    if bias is not None:
        out = out + _channel(bias.astype(out.dtype), out.ndim)
    return out[0] if unbatched else out


@register_lowering(aten.convolution_backward.default)
def _convolution_backward(ctx, grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                          output_padding, groups, output_mask):
    unbatched = x.ndim == w.ndim - 1
    if unbatched:
        grad, x = grad[None], x[None]

    def fwd(x, w):
        return _conv(x, w, stride, padding, dilation, transposed, output_padding, groups)

    dx, dw = _vjp(fwd, (x, w), grad, opmath=not _half_gemm(x.dtype))  # GPUs: bf16/f16 convs, as forward
    db = jnp.sum(_opmath(grad), axis=(0,) + tuple(range(2, grad.ndim)))
    return _masked((dx[0] if unbatched else dx, dw, db), output_mask)


# torch's convolutions on the CPU (oneDNN) as XLA FFI custom calls (fx2xla/torch_kernels.py):
# XLA:CPU's own are several times slower. Not in programs XLA partitions over a mesh (its
# partitioner cannot split a custom call), nor for empty tensors, nor for dtypes the handlers
# lack. bf16 and float16 convolutions on a CPU without instructions for them are widened
# (torch_kernels.convolution_dtype): the handler computes them in float32, where oneDNN is fast,
# and XLA rounds the result once, as eager's kernel does as it writes.
_TO_LAST, _TO_FIRST = (0, 2, 3, 1), (0, 3, 1, 2)  # NCHW -> NHWC, and back


def _laid(v, last: bool):
    """`v` (an array or a ShapeDtypeStruct) as the handler takes it: NHWC where `last`."""
    if not last:
        return v
    if isinstance(v, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(v.shape[d] for d in _TO_LAST), v.dtype)
    return jnp.transpose(v, _TO_LAST)


def _unlaid(v, last: bool):
    """A handler's result back in torch's NCHW."""
    return jnp.transpose(v, _TO_FIRST) if last else v


def _torch_conv_dtype(ctx, *arrays):
    """The jax dtype torch's kernel computes these arrays' convolution in (theirs, or float32 for
    a widened bf16/float16 one), or None where XLA's convolution computes it."""
    arrays = [a for a in arrays if a is not None]
    if (ctx.spmd or any(a.dtype != arrays[0].dtype for a in arrays) or not all(a.size for a in arrays)
            or not torch_kernels.available("convolution")):
        return None
    compute = torch_kernels.convolution_dtype(to_torch_dtype(arrays[0].dtype))
    return None if compute is None else to_jax_dtype(compute)


def _conv_attrs(w, stride, padding, dilation, transposed, output_padding, groups) -> dict:
    nd = w.ndim - 2
    ints = [np.asarray(_per_dim(v, nd), np.int64) for v in (stride, padding, dilation, output_padding)]
    return dict(stride=ints[0], padding=ints[1], dilation=ints[2], transposed=np.int64(bool(transposed)),
                output_padding=ints[3], groups=np.int64(groups))


@register_lowering(aten.convolution.default, platform="cpu")
def _convolution_cpu(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    compute = _torch_conv_dtype(ctx, x, w, bias)
    if compute is None:
        return _convolution(ctx, x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
    unbatched = x.ndim == w.ndim - 1
    shape = ((1,) if unbatched else ()) + tuple(ctx.out_shape)
    dtype = x.dtype
    # Widened: x and the bias converted here (XLA fuses that with the transpose below); the
    # weight reaches the handler in its own dtype, its own buffer, so that a pinned weight is
    # converted once, as it is packed.
    x = (x[None] if unbatched else x).astype(compute)
    # 2-D convolutions run channels-last, where oneDNN is fastest (Inductor converts them too):
    # XLA transposes in and out, and fuses those transposes with the ops around.
    last = w.ndim == 4
    # The bias is added inside torch's kernel, before its one rounding, as eager adds it.
    has_bias = bias is not None
    out = jax.ffi.ffi_call("fx2xla_torch_convolution", _laid(jax.ShapeDtypeStruct(shape, compute), last),
                           vmap_method="sequential")(
        _laid(x, last), _laid(w, last), bias.astype(compute) if has_bias else jnp.zeros((1,), compute),
        channels_last=np.int64(last), has_bias=np.int64(has_bias),
        **_conv_attrs(w, stride, padding, dilation, transposed, output_padding, groups))
    out = _unlaid(out, last).astype(dtype)
    return out[0] if unbatched else out


@register_lowering(aten.convolution_backward.default, platform="cpu")
def _convolution_backward_cpu(ctx, grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                              output_padding, groups, output_mask):
    compute = _torch_conv_dtype(ctx, grad, x, w)
    if not (output_mask[0] or output_mask[1]) or compute is None:
        return _convolution_backward(ctx, grad, x, w, bias_sizes, stride, padding, dilation, transposed,
                                     output_padding, groups, output_mask)
    unbatched = x.ndim == w.ndim - 1
    if unbatched:
        grad, x = grad[None], x[None]
    # A gradient the mask leaves out is not computed; its buffer is dropped by _masked. 2-D
    # convolutions run channels-last, as the forward does. Widened: every operand converted
    # here, both gradients rounded once below.
    last = w.ndim == 4
    dtype = x.dtype
    results = tuple(_laid(jax.ShapeDtypeStruct(v.shape, compute), last) for v in (x, w))
    dx, dw = jax.ffi.ffi_call("fx2xla_torch_convolution_backward", results, vmap_method="sequential")(
        _laid(grad.astype(compute), last), _laid(x.astype(compute), last), _laid(w.astype(compute), last),
        input_mask=np.int64(bool(output_mask[0])),
        weight_mask=np.int64(bool(output_mask[1])), channels_last=np.int64(last),
        **_conv_attrs(w, stride, padding, dilation, transposed, output_padding, groups))
    dx, dw = _unlaid(dx, last).astype(dtype), _unlaid(dw, last).astype(dtype)
    db = jnp.sum(_opmath(grad), axis=(0,) + tuple(range(2, grad.ndim)))
    return _masked((dx[0] if unbatched else dx, dw, db), output_mask)


# ---------------------------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------------------------

def _spatial_nd(ctx):
    """Spatial dims of a pooling op from its name (max_pool3d_with_indices -> 3)."""
    return 3 if "3d" in ctx.node.target.name() else 2


def _pool_args(kernel_size, stride, padding, dilation=1, nd=2):
    k = _per_dim(kernel_size, nd)
    s = _per_dim(stride, nd) if stride else k  # torch: an empty stride means stride = kernel
    return k, s, _per_dim(padding, nd), _per_dim(dilation, nd)


def _window_pad(out_size, in_size, k, s, p, d=1):
    """(low, high) padding so that every window of every output lies inside the array."""
    return p, max((out_size - 1) * s + (k - 1) * d + 1 - p - in_size, 0)


def _strided_window(xp, offset, out_size, s, d, trail=0):
    """The element at kernel offset `offset` (one int per spatial dim) of every window of the
    padded input `xp`, whose spatial dims are followed by `trail` others (channels-last: 1)."""
    nd = len(offset)
    lead = xp.ndim - nd - trail
    start = (0,) * lead + tuple(o * dd for o, dd in zip(offset, d)) + (0,) * trail
    limit = (xp.shape[:lead] + tuple(st + (o - 1) * ss + 1 for st, o, ss in zip(start[lead:lead + nd], out_size, s))
             + xp.shape[lead + nd:])
    return lax.slice(xp, start, limit, (1,) * lead + tuple(s) + (1,) * trail)


def _outer(vectors, combine, trail=0):
    """Combine one numpy vector per spatial dim over their grid (outer sum, product, and),
    with `trail` dims of 1 after them (channels-last: 1)."""
    nd = len(vectors)
    return functools.reduce(combine, [np.asarray(v).reshape((-1,) + (1,) * (nd - 1 - i + trail))
                                      for i, v in enumerate(vectors)])


def _spatial(ctx, ndim: int, nd: int) -> tuple[int, int]:
    """(dims before, dims after) the `nd` spatial dims of a pooling operand of `ndim` dims: on
    channels-last values (channels_last.py) the channel dim follows them."""
    trail = 1 if ctx.channels_last else 0
    return ndim - nd - trail, trail


@register_lowering(aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default)
def _max_pool_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    nd = _spatial_nd(ctx)
    k, s, p, d = _pool_args(kernel_size, stride, padding, dilation, nd)
    lead, trail = _spatial(ctx, x.ndim, nd)
    size, out = x.shape[lead:lead + nd], ctx.out_shape[lead:lead + nd]
    pads = [_window_pad(o, n, kk, ss, pp, dd) for o, n, kk, ss, pp, dd in zip(out, size, k, s, p, d)]
    xp = lax.pad(x, jnp.zeros((), x.dtype),
                 [(0, 0, 0)] * lead + [(lo, hi, 0) for lo, hi in pads] + [(0, 0, 0)] * trail)
    starts = [np.arange(o) * ss - pp for o, ss, pp in zip(out, s, p)]
    strides = [math.prod(size[i + 1:]) for i in range(nd)]  # indices are flat over spatial dims
    # torch scans each window in row-major order from its first in-bounds element (the
    # initial index), taking an element if it is greater than the running max or NaN.
    firsts = [np.where(st < 0, st + -(-(-st) // dd) * dd, st) for st, dd in zip(starts, d)]
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    lowest = -jnp.inf if floating else jnp.iinfo(x.dtype).min
    best = jnp.full(ctx.out_shape, lowest, x.dtype)
    best_idx = jnp.broadcast_to(
        jnp.asarray(_outer([f * m for f, m in zip(firsts, strides)], np.add, trail)), ctx.out_shape)
    for offset in itertools.product(*(range(kk) for kk in k)):
        pos = [st + o * dd for st, o, dd in zip(starts, offset, d)]
        v = _strided_window(xp, offset, out, s, d, trail)
        take = v > best
        if floating:
            take = take | jnp.isnan(v)
        valid = _outer([(q >= 0) & (q < n) for q, n in zip(pos, size)], np.logical_and, trail)
        if not valid.all():
            take = take & valid
        best = jnp.where(take, v, best)
        flat = _outer([q * m for q, m in zip(pos, strides)], np.add, trail)
        best_idx = jnp.where(take, jnp.asarray(flat), best_idx)
    return best, best_idx


@register_lowering(aten.max_pool2d_with_indices_backward.default,
                   aten.max_pool3d_with_indices_backward.default)
def _max_pool_with_indices_backward(ctx, grad, x, kernel_size, stride, padding, dilation,
                                    ceil_mode, indices):
    # The op's contract: `indices` are the forward's, so each lies in its own output's window.
    # For every kernel offset, an output's gradient goes to the input element at that offset
    # where it is the recorded one; strided padding (interior s-1, edges cropping what lies
    # outside the input) puts it in place. A sum of k elementwise terms that XLA fuses into one
    # loop, instead of a scatter (serial on XLA:CPU) over a materialized zero input and
    # (plane, index) pairs (docs/benchmarks.md: SmallCNN's training step).
    nd = _spatial_nd(ctx)
    k, s, p, d = _pool_args(kernel_size, stride, padding, dilation, nd)
    lead, trail = _spatial(ctx, x.ndim, nd)
    size, out = x.shape[lead:lead + nd], grad.shape[lead:lead + nd]
    g = _opmath(grad)
    strides = [math.prod(size[i + 1:]) for i in range(nd)]  # indices are flat over spatial dims
    if all(kk == ss and dd == 1 for kk, ss, dd in zip(k, s, d)):
        return _tiled_pool_backward(g, indices, k, p, size, strides, trail)
    zero = np.zeros((), g.dtype)
    starts = [np.arange(o) * ss - pp for o, ss, pp in zip(out, s, p)]
    total = None
    for offset in itertools.product(*(range(kk) for kk in k)):
        pos = [st + o * dd for st, o, dd in zip(starts, offset, d)]
        if not all(((q >= 0) & (q < n)).any() for q, n in zip(pos, size)):
            continue  # this offset lies in the padding of every window
        # Out-of-range positions may share a flat value with an in-range one; the padding
        # below crops them, so their terms never land.
        flat = jnp.asarray(_outer([q * m for q, m in zip(pos, strides)], np.add, trail), indices.dtype)
        term = jnp.where(indices == flat, g, zero)
        edges = [(int(q[0]), n - int(q[0]) - (o - 1) * ss - 1, ss - 1)
                 for q, n, o, ss in zip(pos, size, out, s)]
        term = lax.pad(term, zero, [(0, 0, 0)] * lead + edges + [(0, 0, 0)] * trail)
        total = term if total is None else total + term
    return jnp.zeros(x.shape, g.dtype) if total is None else total


def _tiled_pool_backward(g, indices, k, p, size, strides, trail=0):
    """The max-pool backward where windows tile the input (stride = kernel, no dilation): each
    input element belongs to at most one window, so one select per element, reading its
    window's gradient and index, does it. `trail`: dims after the spatial ones (channels-last: 1)."""
    nd = len(k)
    lead = g.ndim - nd - trail

    def spread(a, fill):  # a window's value on each of its elements, cut/padded to the input
        shape = a.shape
        head, spatial, tail = shape[:lead], shape[lead:lead + nd], shape[lead + nd:]
        a = a.reshape(head + tuple(v for o in spatial for v in (o, 1)) + tail)
        a = jnp.broadcast_to(a, head + tuple(v for o, kk in zip(spatial, k) for v in (o, kk)) + tail)
        a = a.reshape(head + tuple(o * kk for o, kk in zip(spatial, k)) + tail)
        edges = [(-pp, n - o * kk + pp, 0) for pp, n, o, kk in zip(p, size, spatial, k)]
        return lax.pad(a, np.asarray(fill, a.dtype), [(0, 0, 0)] * lead + edges + [(0, 0, 0)] * trail)

    flat = jnp.asarray(_outer([np.arange(n) * m for n, m in zip(size, strides)], np.add, trail), indices.dtype)
    return jnp.where(spread(indices, -1) == flat, spread(g, 0), np.zeros((), g.dtype))


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, out_size,
              trail=0):
    """avg_pool over the len(out_size) dims before the last `trail` (channels-last: 1)."""
    nd = len(out_size)
    k, s, p, _ = _pool_args(kernel_size, stride, padding, nd=nd)
    lead = x.ndim - nd - trail
    size = x.shape[lead:lead + nd]
    y = _opmath(x)
    pads = [_window_pad(o, n, kk, ss, pp) for o, n, kk, ss, pp in zip(out_size, size, k, s, p)]
    total = lax.reduce_window(y, np.zeros((), y.dtype), lax.add, (1,) * lead + tuple(k) + (1,) * trail,
                              (1,) * lead + tuple(s) + (1,) * trail, [(0, 0)] * lead + pads + [(0, 0)] * trail)
    total = total[(slice(None),) * lead + tuple(slice(0, o) for o in out_size)]
    if divisor_override:
        divisor = np.full(tuple(out_size) + (1,) * trail, divisor_override)
    else:
        # torch: windows are clipped to the padded input; without count_include_pad, also
        # to the input itself.
        def extent(o, n, kk, ss, pp):
            start = np.arange(o) * ss - pp
            end = np.minimum(start + kk, n + pp)
            if count_include_pad:
                return end - start
            return np.minimum(end, n) - np.maximum(start, 0)
        divisor = _outer([extent(*a) for a in zip(out_size, size, k, s, p)], np.multiply, trail)
    divisor = jnp.asarray(divisor, y.dtype)
    if jnp.issubdtype(y.dtype, jnp.integer):
        return lax.div(total, jnp.broadcast_to(divisor, total.shape))  # truncates, like C++
    return total / divisor


@register_lowering(aten.avg_pool2d.default, aten.avg_pool3d.default)
def _avg_pool_rule(ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False,
                   count_include_pad=True, divisor_override=None):
    nd = _spatial_nd(ctx)
    lead, trail = _spatial(ctx, x.ndim, nd)
    return _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                     divisor_override, ctx.out_shape[lead:lead + nd], trail)


@register_lowering(aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default)
def _avg_pool_backward(ctx, grad, x, kernel_size, stride, padding, ceil_mode,
                       count_include_pad, divisor_override):
    nd = _spatial_nd(ctx)
    lead, trail = _spatial(ctx, x.ndim, nd)

    def fwd(y):
        return _avg_pool(y, kernel_size, stride, padding, ceil_mode, count_include_pad,
                         divisor_override, grad.shape[lead:lead + nd], trail)
    return _vjp(fwd, (x,), grad)[0]


def _adaptive_avg_pool(x, out_size):
    """adaptive_avg_pool over the last len(out_size) dims, one axis at a time."""
    y = _opmath(x)
    for axis, o in zip(range(y.ndim - len(out_size), y.ndim), out_size):
        n = y.shape[axis]
        if n % o == 0:  # equal windows: a reshape and a mean
            y = jnp.mean(y.reshape(y.shape[:axis] + (o, n // o) + y.shape[axis + 1:]), axis=axis + 1)
            continue
        # torch's windows [floor(i*n/o), ceil((i+1)*n/o)) overlap: sum them with a 0/1 matrix.
        i = np.arange(o)
        start, end = (i * n) // o, -(-((i + 1) * n) // o)
        pos = np.arange(n)
        sel = ((pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])).astype(np.float32)
        summed = dot(jnp.moveaxis(y, axis, -1), jnp.asarray(sel.T, y.dtype), ((y.ndim - 1,), (0,)))
        y = jnp.moveaxis(summed, -1, axis) / jnp.asarray(end - start, y.dtype).reshape(
            (o,) + (1,) * (y.ndim - 1 - axis))
    return y


@register_lowering(aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default)
def _adaptive_avg_pool_rule(ctx, x, output_size):
    return _adaptive_avg_pool(x, ctx.out_shape[-_spatial_nd(ctx):])


@register_lowering(aten._adaptive_avg_pool2d_backward.default,
                   aten._adaptive_avg_pool3d_backward.default)
def _adaptive_avg_pool_backward(ctx, grad, x):
    return _vjp(lambda y: _adaptive_avg_pool(y, grad.shape[-_spatial_nd(ctx):]), (x,), grad)[0]


def _adaptive_windows(n: int, o: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's adaptive windows of `o` outputs over `n` inputs: [floor(i*n/o), ceil((i+1)*n/o))
    as (start, length) per output."""
    i = np.arange(o)
    start = (i * n) // o
    return start, -(-((i + 1) * n) // o) - start


def _adaptive_max_pool(x, out_size):
    """(max, flat index) of adaptive max pooling over the last len(out_size) dims, as eager's
    CPU kernel scans each window (row-major from its first element, taking an element greater
    than the running max, or NaN): the first maximum, or the last NaN where a window has any.
    The windows are gathered into one axis of the longest window's length, one spatial axis at
    a time; the slots past a shorter window's end never count."""
    nd = len(out_size)
    lead = x.ndim - nd
    size = x.shape[lead:]
    strides = [math.prod(size[i + 1:]) for i in range(nd)]
    positions, valids = [], []
    y = x
    for d, (n, o) in enumerate(zip(size, out_size)):
        start, length = _adaptive_windows(n, o)
        k = int(length.max())
        pos = start[:, None] + np.arange(k)[None, :]  # [o, k]
        positions.append(np.minimum(pos, n - 1))
        valids.append(np.arange(k)[None, :] < length[:, None])
        y = jnp.take(y, jnp.asarray(positions[-1].reshape(-1)), axis=lead + 2 * d)
        y = y.reshape(y.shape[:lead + 2 * d] + (o, k) + y.shape[lead + 2 * d + 1:])
    y = _windows_last(y, lead, nd)

    def grid(parts, combine):  # per-dim [o, k] arrays -> [o1, o2, ..., k1 * k2 * ...]
        arrays = [p.reshape((1,) * d + (p.shape[0],) + (1,) * (nd - 1 - d) + (1,) * d + (p.shape[1],)
                            + (1,) * (nd - 1 - d)) for d, p in enumerate(parts)]
        out = functools.reduce(combine, arrays)
        return out.reshape(tuple(out_size) + (-1,))

    valid = grid(valids, np.logical_and)
    flat = grid([p * m for p, m in zip(positions, strides)], np.add)
    return _window_max(y, flat, valid)


def _windows_last(y, lead: int, nd: int):
    """Gathered windows [..., o1, k1, o2, k2, ...] (`lead` dims before them) as
    [..., o1, o2, ..., k1 * k2 * ...]: each output's window on the last axis, in row-major
    (scan) order."""
    order = list(range(lead)) + [lead + 2 * d for d in range(nd)] + [lead + 2 * d + 1 for d in range(nd)]
    y = jnp.transpose(y, order)
    return y.reshape(y.shape[:lead + nd] + (-1,))


def _window_max(y, flat, valid=None):
    """(max, flat input index) over the last axis of windows `y` as eager's pooling kernels
    scan them in order: the first maximum, or the last NaN where a window has any. `flat`: each
    slot's input index (broadcast to y); `valid`: the slots that belong to their window."""
    nan = jnp.isnan(y) if valid is None else jnp.isnan(y) & valid
    keep = ~nan if valid is None else valid & ~nan
    clean = jnp.where(keep, y, jnp.asarray(-jnp.inf, y.dtype))
    window = y.shape[-1]
    last_nan = window - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
    has_nan = jnp.any(nan, axis=-1)
    slot = jnp.where(has_nan, last_nan, jnp.argmax(clean, axis=-1))
    value = jnp.where(has_nan, jnp.asarray(jnp.nan, y.dtype), jnp.max(clean, axis=-1))
    index = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), y.shape), slot[..., None], axis=-1)[..., 0]
    return value, index


def _input_dtype(node):
    """The dtype of the op's first (tensor) argument, or None where the graph does not say."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return None if val is None else val.dtype


def _float32_or_64(node) -> bool:
    """The op's input is float32/float64. Antialiased resizing accepts only these and leaves
    other dtypes to eager (eager has no bf16/float16 kernel, and its uint8 one rounds
    fixed-point weights)."""
    return _input_dtype(node) in (torch.float32, torch.float64)


def _floating(node) -> bool:
    """The op's input is a float tensor (fractional pooling: eager has no integer kernel)."""
    dtype = _input_dtype(node)
    return dtype is not None and dtype.is_floating_point


@register_lowering(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default,
                   accepts=_floating)
def _fractional_max_pool(ctx, x, kernel_size, output_size, samples):
    """nn.FractionalMaxPool2d/3d given its random samples (one per spatial dim per (batch,
    plane), drawn by the module): eager's pseudo-random window starts, int((i + u) * alpha) -
    int(u * alpha) with alpha = (in - k) / (out - 1) in the input's type (bf16/float16 rounded at
    each step, as eager's kernel rounds them, so the windows are eager's) and the last window
    ending at the input's end, then each k-window's max and index in eager's scan order. The 2-d
    kernel reads the samples as (width, height), the 3-d one as (time, height, width)."""
    nd = _spatial_nd(ctx)
    k, out = _per_dim(kernel_size, nd), ctx.out_shape[-nd:]
    if x.size == 0:  # an empty batch or no planes: nothing to pool
        shape = tuple(ctx.out_shape)
        return jnp.zeros(shape, x.dtype), jnp.zeros(shape, jnp.int64)
    lead = x.ndim - nd
    size = x.shape[lead:]
    order = (1, 0) if nd == 2 else (0, 1, 2)  # which sample each spatial dim reads
    u = jnp.reshape(samples, x.shape[:lead] + (nd,)).astype(x.dtype)  # [..., C, nd] (batch 1 if unbatched)
    positions = []
    for d, (n, o, kk) in enumerate(zip(size, out, k)):
        s = u[..., order[d]][..., None]
        if o > 1:
            alpha = jnp.asarray(n - kk, x.dtype) / jnp.asarray(o - 1, x.dtype)
            i = jnp.arange(o, dtype=x.dtype)
            start = ((i + s) * alpha).astype(jnp.int32) - (s * alpha).astype(jnp.int32)
            start = jnp.where(jnp.arange(o) == o - 1, n - kk, start)
        else:
            start = jnp.full(s.shape[:-1] + (o,), n - kk, jnp.int32)
        positions.append(start[..., None] + jnp.arange(kk, dtype=jnp.int32))  # [..., C, o, k]
    y = x
    for d in range(nd):  # gather each axis' windows: [..., o_d, k_d] in place of its n_d
        axis = lead + 2 * d
        pos = positions[d]
        shape = pos.shape[:-2] + (1,) * (2 * d) + (pos.shape[-2] * pos.shape[-1],) + (1,) * (nd - d - 1)
        y = jnp.take_along_axis(y, jnp.reshape(pos, shape), axis=axis)
        y = jnp.reshape(y, y.shape[:axis] + pos.shape[-2:] + y.shape[axis + 1:])
    y = _windows_last(y, lead, nd)
    strides = [math.prod(size[i + 1:]) for i in range(nd)]
    flat = 0
    for d in range(nd):  # [..., C, o1.., k1..] grid of flat indices
        p = positions[d]
        shape = p.shape[:-2] + tuple(p.shape[-2] if e == d else 1 for e in range(nd)) \
            + tuple(p.shape[-1] if e == d else 1 for e in range(nd))
        flat = flat + jnp.reshape(p, shape).astype(jnp.int64) * strides[d]
    flat = jnp.reshape(jnp.broadcast_to(flat, x.shape[:lead] + tuple(out) + tuple(k)), y.shape)
    value, index = _window_max(y, flat)
    return value, index.astype(jnp.int64)


@register_lowering(aten.fractional_max_pool2d_backward.default, aten.fractional_max_pool3d_backward.default)
def _fractional_max_pool_backward(ctx, grad, x, kernel_size, output_size, indices):
    return _scatter_pool_grad(ctx, grad, x, indices)


@register_lowering(aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def _adaptive_max_pool_rule(ctx, x, output_size):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        name = ctx.node.target.name().split("::")[-1].split(".")[0]
        raise RejectedInput(f'"{name}" not implemented for \'{to_torch_dtype(x.dtype)}\': eager takes '
                            "floating-point inputs only")
    value, index = _adaptive_max_pool(x, ctx.out_shape[-_spatial_nd(ctx):])
    return value, index.astype(jnp.int64)


@register_lowering(aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default)
def _adaptive_max_pool_backward(ctx, grad, x, indices):
    return _scatter_pool_grad(ctx, grad, x, indices)


def _scatter_pool_grad(ctx, grad, x, indices):
    """Each output's gradient added at its recorded input element (windows may overlap, so
    elements can gather several), summed in float32 for reduced-precision grads."""
    nd = _spatial_nd(ctx)
    lead = x.ndim - nd
    batch = math.prod(x.shape[:lead])
    g = _opmath(grad).reshape(batch, -1)
    idx = indices.reshape(batch, -1)
    total = jnp.zeros((batch, math.prod(x.shape[lead:])), g.dtype).at[jnp.arange(batch)[:, None], idx].add(g)
    return total.reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# Upsampling (index/weight tables computed like ATen's CPU kernels, in float32 for float inputs)
# ---------------------------------------------------------------------------------------------

def _scales(scale_factors):
    return (None, None) if scale_factors is None else tuple(scale_factors)


def _nearest_index(out_size, in_size, scale):
    if out_size == in_size:
        return np.arange(out_size)
    if out_size == 2 * in_size:
        return np.arange(out_size) >> 1
    s = np.float32(1.0 / scale) if scale else np.float32(in_size) / np.float32(out_size)
    src = np.floor(np.arange(out_size, dtype=np.float32) * s).astype(np.int64)
    return np.minimum(src, in_size - 1)


def _upsample_nearest2d(ctx, x, sh, sw):
    (h, w), (oh, ow) = x.shape[-2:], ctx.out_shape[-2:]
    x = jnp.take(x, jnp.asarray(_nearest_index(oh, h, sh)), axis=-2, mode="clip")
    return jnp.take(x, jnp.asarray(_nearest_index(ow, w, sw)), axis=-1, mode="clip")


@register_lowering(aten.upsample_nearest2d.vec)
def _upsample_nearest2d_vec(ctx, x, output_size, scale_factors):
    return _upsample_nearest2d(ctx, x, *_scales(scale_factors))


@register_lowering(aten.upsample_nearest2d.default)
def _upsample_nearest2d_default(ctx, x, output_size, scales_h=None, scales_w=None):
    return _upsample_nearest2d(ctx, x, scales_h, scales_w)


def _linear_taps(out_size, in_size, align_corners, scale, ftype):
    """ATen's area_pixel_compute_source_index: (i0, i1, lambda0, lambda1) per output."""
    f = ftype.type
    if align_corners:
        s = f(in_size - 1) / f(out_size - 1) if out_size > 1 else f(0)
    else:
        s = f(1.0 / scale) if scale else f(in_size) / f(out_size)
    dst = np.arange(out_size).astype(ftype)
    src = s * dst if align_corners else np.maximum(s * (dst + f(0.5)) - f(0.5), f(0))
    i0 = src.astype(np.int64)
    i1 = i0 + (i0 < in_size - 1)
    l1 = src - i0.astype(ftype)
    return i0, i1, f(1) - l1, l1


def _upsample_bilinear2d(ctx, x, align_corners, sh, sw):
    y = _opmath(x)
    ftype = np.dtype(np.float64 if y.dtype == np.float64 else np.float32)
    (h, w), (oh, ow) = x.shape[-2:], ctx.out_shape[-2:]
    h0, h1, hl0, hl1 = _linear_taps(oh, h, align_corners, sh, ftype)
    w0, w1, wl0, wl1 = _linear_taps(ow, w, align_corners, sw, ftype)

    def take(a, idx, axis):
        return jnp.take(a, jnp.asarray(idx), axis=axis, mode="clip")

    def cols(rows):
        return (take(rows, w0, -1) * jnp.asarray(wl0, y.dtype)
                + take(rows, w1, -1) * jnp.asarray(wl1, y.dtype))

    return (cols(take(y, h0, -2)) * jnp.asarray(hl0, y.dtype)[:, None]
            + cols(take(y, h1, -2)) * jnp.asarray(hl1, y.dtype)[:, None])


@register_lowering(aten.upsample_bilinear2d.vec)
def _upsample_bilinear2d_vec(ctx, x, output_size, align_corners, scale_factors):
    return _upsample_bilinear2d(ctx, x, align_corners, *_scales(scale_factors))


@register_lowering(aten.upsample_bilinear2d.default)
def _upsample_bilinear2d_default(ctx, x, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_bilinear2d(ctx, x, align_corners, scales_h, scales_w)


def _keys_near(x, a):
    """Keys' cubic convolution kernel with parameter `a` on |x| <= 1, in ATen's order of
    operations (numpy or jax values; the integer constants are weak, so x's dtype holds)."""
    return ((a + 2) * x - (a + 3)) * x * x + 1


def _keys_far(x, a):
    """The same kernel on 1 < |x| < 2."""
    return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a


def _aa_filter(interp_size: int, x, f):
    """ATen's antialiasing filters: the triangle for bilinear, Keys' cubic with a = -0.5 (PIL's,
    not the -0.75 of plain bicubic) for bicubic; `f` the weights' float type."""
    x = np.abs(x)
    if interp_size == 2:
        return np.where(x < 1, f(1) - x, f(0)).astype(type(f(0)))
    a = f(-0.5)
    return np.where(x < 1, _keys_near(x, a), np.where(x < 2, _keys_far(x, a), f(0))).astype(type(f(0)))


def _aa_weights(out_size, in_size, align_corners, scale, interp_size, ftype) -> np.ndarray:
    """The [out, in] matrix of ATen's antialiased resampling along one axis
    (`_compute_indices_min_size_weights_aa`, in the input's float type as eager computes it):
    output i reads inputs [xmin, xmin + xsize) around center = scale * (i + 0.5), with the filter
    stretched by the scale when downsampling, weights normalized to sum 1."""
    f = ftype.type
    if align_corners:
        s = f(in_size - 1) / f(out_size - 1) if out_size > 1 else f(0)
    else:
        s = f(1.0 / scale) if scale else f(in_size) / f(out_size)
    support = f(interp_size * 0.5) * s if s >= 1 else f(interp_size * 0.5)
    invscale = f(1) / s if s >= 1 else f(1)
    max_size = int(math.ceil(support)) * 2 + 1
    weights = np.zeros((out_size, in_size), ftype)
    for i in range(out_size):
        center = s * f(i + 0.5)
        xmin = max(int(center - support + f(0.5)), 0)
        xsize = min(max(min(int(center + support + f(0.5)), in_size) - xmin, 0), max_size)
        j = np.arange(xsize)
        w = _aa_filter(interp_size, (j.astype(ftype) + f(xmin) - center + f(0.5)) * invscale, f)
        total = w.sum(dtype=ftype)  # eager sums them one by one; equal to rounding
        weights[i, xmin:xmin + xsize] = w / total if total != 0 else w
    return weights


def _upsample_aa(ctx, x, out_hw, align_corners, sh, sw, interp_size):
    """Antialiased bilinear/bicubic resizing (`F.interpolate(..., antialias=True)`,
    torchvision's Resize): each axis whose size changes is one product with its weight matrix,
    the last axis first, as eager's separable kernel; an axis of unchanged size is left alone."""
    y = _opmath(x)
    ftype = np.dtype(np.float64 if y.dtype == np.float64 else np.float32)
    (h, w), (oh, ow) = x.shape[-2:], out_hw
    if ow != w:
        m = jnp.asarray(_aa_weights(ow, w, align_corners, sw, interp_size, ftype), y.dtype)
        y = lax.dot_general(y, m, (((y.ndim - 1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
    if oh != h:
        m = jnp.asarray(_aa_weights(oh, h, align_corners, sh, interp_size, ftype), y.dtype)
        y = jnp.moveaxis(lax.dot_general(y, m, (((y.ndim - 2,), (1,)), ((), ())),
                                         precision=lax.Precision.HIGHEST), -1, -2)
    return y


def _aa_interp_size(ctx) -> int:
    return 4 if "bicubic" in ctx.node.target.name() else 2


@register_lowering(aten._upsample_bilinear2d_aa.default, aten._upsample_bicubic2d_aa.default, accepts=_float32_or_64)
def _upsample_aa_rule(ctx, x, output_size, align_corners, scales_h=None, scales_w=None):
    return _upsample_aa(ctx, x, ctx.out_shape[-2:], align_corners, scales_h, scales_w, _aa_interp_size(ctx))


@register_lowering(aten._upsample_bilinear2d_aa_backward.default, aten._upsample_bicubic2d_aa_backward.default,
                   accepts=_float32_or_64)
def _upsample_aa_backward(ctx, grad, output_size, input_size, align_corners, scales_h=None, scales_w=None):
    shape = concrete_shape(input_size, ctx.sizes)
    interp = _aa_interp_size(ctx)
    return _vjp(lambda y: _upsample_aa(ctx, y, grad.shape[-2:], align_corners, scales_h, scales_w, interp),
                (jnp.zeros(shape, grad.dtype),), grad)[0]


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _half_dot(a, b, contract, batch):
    """A bf16/f16 GEMM with a float32 result (tensor cores, float32 accumulation). Its gradients
    are half-precision GEMMs too: the cotangent is rounded to the operands' dtype first, as
    torch's fused attention backward rounds dS and dO (jax's own transposes would run float32
    GEMMs on upcast operands)."""
    return lax.dot_general(a, b, (contract, batch), precision=matmul_precision(a.dtype),
                           preferred_element_type=jnp.float32)


def _half_dot_fwd(a, b, contract, batch):
    return _half_dot(a, b, contract, batch), (a, b)


def _half_dot_bwd(contract, batch, res, g):
    a, b = res
    _, pull = jax.vjp(lambda a, b: lax.dot_general(a, b, (contract, batch), precision=matmul_precision(a.dtype),
                                                   preferred_element_type=a.dtype), a, b)
    return pull(g.astype(a.dtype))


_half_dot.defvjp(_half_dot_fwd, _half_dot_bwd)


# Decode attention on the CPU whose batch or kv-head count is 1 (a batch-1 decode step, MQA), at
# a few query rows per kv head: products and sums instead of batched dots. XLA:CPU drops a size-1
# batch dim of a dot with a reshape; when K or V was just written in place (a static cache's
# index_copy_, a dynamic-update-slice), XLA fuses that write into the reshape as well as into the
# cache's own result, and copies the cache four times per step to keep both (32 cache copies per
# step for a 4-layer LLaMA). Multiplied and summed, the cache goes to one YNNPACK fusion with no
# copy. A LLaMA 4L batch-1 decode step with a 1024-position static cache: 6.5 against 7.7 ms
# (docs/benchmarks.md, "Decode attention at batch 1 without cache copies").
SUMMED_ATTENTION_ROWS = 8


def _summed_attention(half: bool, batch: int, kv_heads: int, rows: int) -> bool:
    return (not half and (batch == 1 or kv_heads == 1) and rows <= SUMMED_ATTENTION_ROWS
            and current_platform() == "cpu")


def _sdpa(q, k, v, attn_mask, is_causal, scale, keep=None, dropout_p=0.0):
    """Attention like ATen's CPU flash kernel: returns (out, logsumexp). Rows with every key
    masked give output 0 and logsumexp 0 (the kernel's max -> 0, sum -> 1 rule), as eager's
    math attention does. `keep`: the dropout mask over the attention weights (True: kept,
    scaled by 1/(1-p)); the logsumexp is of the weights before dropout, as the fused kernels
    return it. In opmath, except bf16/f16 on GPUs (`_half_gemm`), as flash attention computes:
    QK^T and PV as half-precision GEMMs accumulating in float32, the softmax in float32, P
    rounded to the inputs' dtype for PV."""
    half = _half_gemm(q.dtype)
    if not half:
        q, k, v = _opmath(q), _opmath(k), _opmath(v)
    b, heads, length = q.shape[0], q.shape[1], q.shape[2]
    groups = heads // k.shape[1]  # grouped-query attention: kv head j serves query heads [j*g, (j+1)*g)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mm = _half_dot if half else dot
    # Each kv head's group of query heads as one block of rows [g * L, E] (a free reshape of
    # q's [B, H, L, E]), so every GEMM reads each K and V head once, and no copy of K or V per
    # query head is made. The scores are [B, H, L, S] again after another free reshape.
    rows = groups * length
    summed = _summed_attention(half, b, k.shape[1], rows)
    if summed:
        s = jnp.sum(q.reshape(b, k.shape[1], rows, 1, q.shape[3]) * k[:, :, None], axis=-1)
    else:
        s = mm(q.reshape(b, k.shape[1], rows, q.shape[3]), k, ((3,), (3,)), ((0, 1), (0, 1)))
    s = s.reshape(b, heads, length, k.shape[2]) * jnp.asarray(scale, s.dtype)
    neg_inf = jnp.asarray(-jnp.inf, s.dtype)
    if attn_mask is not None:
        s = jnp.where(attn_mask, s, neg_inf) if attn_mask.dtype == jnp.bool_ else s + _opmath(attn_mask)
    if is_causal:  # top-left aligned lower triangle, like torch
        s = jnp.where(jnp.asarray(np.tri(s.shape[-2], s.shape[-1], dtype=bool)), s, neg_inf)
    m = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    m = jnp.where(m == neg_inf, jnp.zeros((), m.dtype), m)
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1, keepdims=True)
    total = jnp.where(total == 0, jnp.ones((), total.dtype), total)
    lse = (m + jnp.log(total))[..., 0]
    if keep is not None:
        if dropout_p >= 1:  # every weight dropped, as F.dropout(p=1) does
            return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype), lse
        p = jnp.where(keep, p, jnp.zeros((), p.dtype))
        total = total * jnp.asarray(1.0 - dropout_p, total.dtype)
    p = p.astype(v.dtype).reshape(b, v.shape[1], rows, p.shape[3])
    if summed:
        out = jnp.sum(p[..., None] * v[:, :, None], axis=-2).reshape(b, heads, length, v.shape[3])
    else:
        out = mm(p, v, ((3,), (2,)), ((0, 1), (0, 1))).reshape(b, heads, length, v.shape[3])
    return out / total, lse


def _check_no_dropout(dropout_p):
    if dropout_p:
        raise NotImplementedError("fx2xla: attention dropout (dropout_p > 0) is not supported")


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _unrepeated_kv(ctx, k, v):
    """Attention's key and value (node args 1 and 2) without the model's own grouped-query
    repeat, both or neither: (k, v) as given where either is not such a repeat, or where their
    sources' head counts differ. A repeat `x[:, :, None].expand(b, kv, n, s, d).reshape(b, kv * n,
    s, d)` (transformers' repeat_kv; the clone is the reshape's copy) gives each of kv heads n
    query heads in a row, which is how the rules (`_sdpa`) pair query heads with fewer kv heads:
    they then read x once per group instead of a copy of x per query head. They take the group
    size from k's heads, so v must come with as many."""
    k_src, v_src = _unrepeated_node(ctx, 1), _unrepeated_node(ctx, 2)
    if k_src is None or v_src is None:
        return k, v
    k_kv, v_kv = ctx.values[k_src], ctx.values[v_src]
    if k_kv.shape[1] != v_kv.shape[1]:
        return k, v
    return k_kv, v_kv


def _full_slice(node) -> bool:
    """Whether `node` is a slice that keeps all of its input (`x[:, :, None, :, :]` traces one
    over the new dim's neighbour once a size is dynamic)."""
    if not (isinstance(node, torch.fx.Node) and node.target is aten.slice.Tensor and isinstance(node.args[0], torch.fx.Node)):
        return False
    before, after = node.args[0].meta.get("val"), node.meta.get("val")
    step = node.args[4] if len(node.args) > 4 else 1
    return (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and step == 1
            and tuple(map(str, before.shape)) == tuple(map(str, after.shape)))


def _unrepeated_node(ctx, i: int):
    """The node attention's key or value (node arg `i`) repeats for grouped-query attention,
    as `_unrepeated_kv` finds it, or None."""
    node = ctx.node.args[i]
    if ctx.values is None or not isinstance(node, torch.fx.Node) or node.target not in _VIEWS:
        return None
    inner = node.args[0]
    if isinstance(inner, torch.fx.Node) and inner.target is aten.clone.default:
        inner = inner.args[0]
    if not (isinstance(inner, torch.fx.Node) and inner.target is aten.expand.default):
        return None
    unsq = inner.args[0]
    while _full_slice(unsq):
        unsq = unsq.args[0]
    if not (isinstance(unsq, torch.fx.Node) and unsq.target is aten.unsqueeze.default and unsq.args[1] in (2, -3)):
        return None
    src = unsq.args[0]
    shapes = [n.meta.get("val") for n in (src, inner, node)] if isinstance(src, torch.fx.Node) else [None]
    if src not in ctx.values or not all(isinstance(m, torch.Tensor) for m in shapes):
        return None
    kv_shape, expanded, out = (tuple(concrete_shape(m.shape, ctx.sizes)) for m in shapes)
    if len(kv_shape) != 4 or len(expanded) != 5:
        return None
    b, kv, length, d = kv_shape
    if expanded[:2] != (b, kv) or expanded[3:] != (length, d) or out != (b, kv * expanded[2], length, d):
        return None
    return src


# torch's CPU flash-attention kernel as an XLA FFI custom call (fx2xla/torch_kernels.py, csrc
# "Attention"): XLA:CPU's batched dots of one head each run far below its GEMM rate (BERT 4L's
# attention at 4 x 128: 2.1 ms a layer against the kernel's 0.84 ms). The kernel is the one eager
# ran for this op, so results are eager's (bit for bit in the tests). Operands whose node swaps the head and
# sequence dims of a [B, L, H, E] value (a projection's view, transposed) are passed as that value
# and read with strides, and so is the output where every use swaps it back: no transpose is
# materialized on either side. Below TORCH_ATTENTION_ROWS query rows (decode steps) XLA's own
# fused form is faster: the kernel's per-call cost outweighs its rate there (a LLaMA 4L decode
# step at batch 1 took 4.95 ms with the kernel against 4.34 ms without).
TORCH_ATTENTION_ROWS = 32
_HEAD_SWAP = (0, 2, 1, 3)
_TORCH_ATTENTION_DTYPES = frozenset((jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def _swaps_heads(node) -> bool:
    """Whether `node` transposes dims 1 and 2 of a rank-4 tensor (permute or transpose)."""
    if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if node.meta["val"].dim() != 4:
        return False
    if node.target is aten.permute.default:
        return tuple(d % 4 for d in node.args[1]) == _HEAD_SWAP
    return node.target is aten.transpose.int and sorted(d % 4 for d in node.args[1:3]) == [1, 2]


def _head_swapped(ctx, node):
    """The traced [B, L, H, E] value `node` (a rank-4 node) transposes dims 1 and 2 of, or None."""
    src = node.args[0] if _swaps_heads(node) else None
    return ctx.values.get(src) if isinstance(src, torch.fx.Node) else None


def _attention_operand(ctx, i: int, value):
    """(the array the handler reads for attention operand `i`, whether it is sequence-major)."""
    node = _unrepeated_node(ctx, i)
    if node is not None:
        value = ctx.values[node]
    else:
        node = ctx.node.args[i]
    src = _head_swapped(ctx, node)
    if src is not None and tuple(src.shape) == tuple(value.shape[d] for d in _HEAD_SWAP):
        return src, True
    return value, False


def _output_swapped_back(ctx) -> bool:
    """Whether every use of the attention's output transposes its dims 1 and 2."""
    uses = [u for g in ctx.node.users if g.target is operator.getitem and g.args[1] == 0 for u in g.users]
    return bool(uses) and all(_swaps_heads(u) for u in uses)


def _lse_used(ctx) -> bool:
    """Whether anything reads the attention node's logsumexp (its result 1): a handler writes it
    only then, and the rule returns zeros in its place otherwise."""
    return any(g.target is operator.getitem and g.args[1] == 1 and g.users for g in ctx.node.users)


def _torch_attention(ctx, q, k, v, attn_mask, is_causal, scale):
    """(out, logsumexp) from torch's kernel as a custom call, or None where it does not apply:
    not the CPU, the library unavailable or its kind off, a mesh, fewer than
    TORCH_ATTENTION_ROWS query rows, dtypes or shapes the handler does not take (dynamic or
    empty ones)."""
    if ctx.spmd or ctx.platform != "cpu" or ctx.values is None or not torch_kernels.available("attention"):
        return None
    if q.ndim != 4 or not isinstance(q.shape[2], int) or q.shape[2] < TORCH_ATTENTION_ROWS:
        return None
    qa, q_seq = _attention_operand(ctx, 0, q)
    ka, k_seq = _attention_operand(ctx, 1, k)
    va, v_seq = _attention_operand(ctx, 2, v)
    arrays = [qa, ka, va] + ([attn_mask] if attn_mask is not None else [])
    if not all(a.ndim == 4 or a is attn_mask for a in arrays) or (attn_mask is not None and attn_mask.ndim > 4):
        return None
    if not all(isinstance(d, int) and d > 0 for a in arrays for d in a.shape):
        return None
    dtype = qa.dtype
    # float64's logsumexp is float64: not a dtype the handler writes.
    if ka.dtype != dtype or va.dtype != dtype or dtype not in _TORCH_ATTENTION_DTYPES:
        return None
    if attn_mask is not None and attn_mask.dtype not in (dtype, jnp.float32):
        return None
    b, heads, length, _ = q.shape
    kv = ka.shape[2 if k_seq else 1]
    if heads % kv or va.shape[2 if v_seq else 1] != kv or v.shape[-1] != q.shape[-1]:
        return None
    out_seq = _output_swapped_back(ctx)
    out_shape = (b, length, heads, v.shape[3]) if out_seq else (b, heads, length, v.shape[3])
    lse_used = _lse_used(ctx)
    mask = (jnp.zeros((1, 1, 1, 1), dtype) if attn_mask is None
            else attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape)))
    out, lse = jax.ffi.ffi_call(
        "fx2xla_torch_attention",
        (jax.ShapeDtypeStruct(out_shape, dtype),
         jax.ShapeDtypeStruct((b, heads, length) if lse_used else (0,), jnp.float32)),
        vmap_method="sequential")(
        qa, ka, va, mask, q_seq=np.int64(q_seq), k_seq=np.int64(k_seq), v_seq=np.int64(v_seq),
        out_seq=np.int64(out_seq), has_mask=np.int64(attn_mask is not None), is_causal=np.int64(bool(is_causal)),
        scale=np.float64("nan" if scale is None else scale))
    out = jnp.transpose(out, _HEAD_SWAP) if out_seq else out
    return out, (lse if lse_used else jnp.zeros((b, heads, length), jnp.float32))


# A decode step's float32 attention, at most DECODE_ATTENTION_ROWS query rows per kv head (query
# heads per kv head x positions), as the kernel library's fx2xla_decode_attention: XLA:CPU hands
# each of its tiny batched dots to YNNPACK, at 75-180 us a dot in a LLaMA 4L step at batch 8 (2 x
# 47 scores per kv head; 0.48 ms of a 3 ms executable), where the kernel computes a kv head's rows
# straight from the cache (docs/benchmarks.md, "Decode attention in the kernel library").
DECODE_ATTENTION_ROWS = 8


def _decode_attention(ctx, q, k, v, attn_mask, is_causal, scale):
    """(out, logsumexp) from the library's decode attention, or None where it does not apply:
    not the CPU, the library unavailable or its kind off, a mesh, more than
    DECODE_ATTENTION_ROWS rows per kv head, not float32, dynamic or empty shapes, a mask that is
    neither bool nor float32 or does not broadcast to the scores."""
    if ctx.spmd or ctx.platform != "cpu" or not torch_kernels.available("decode_attention"):
        return None
    k, v = _unrepeated_kv(ctx, k, v)
    if any(a.ndim != 4 or a.dtype != jnp.float32 for a in (q, k, v)):
        return None
    if not all(isinstance(d, int) and d > 0 for a in (q, k, v) for d in a.shape):
        return None
    b, heads, length, e = q.shape
    kv, s = k.shape[1], k.shape[2]
    if (heads % kv or k.shape[0] != b or k.shape[3] != e or tuple(v.shape[:3]) != tuple(k.shape[:3])
            or heads // kv * length > DECODE_ATTENTION_ROWS):
        return None
    if attn_mask is None:
        mask = jnp.zeros((1, 1, 1, 1), jnp.float32)
    else:
        if attn_mask.ndim > 4 or attn_mask.dtype not in (jnp.bool_, jnp.float32):
            return None
        mask = attn_mask.reshape((1,) * (4 - attn_mask.ndim) + tuple(attn_mask.shape))
        if any(m not in (1, f) for m, f in zip(mask.shape, (b, heads, length, s))):
            return None
        if mask.dtype == jnp.bool_:  # added after scaling, as _sdpa's where(mask, s, -inf)
            mask = jnp.where(mask, jnp.float32(0), jnp.float32(-jnp.inf))
    lse_used = _lse_used(ctx)
    out, lse = jax.ffi.ffi_call(
        "fx2xla_decode_attention",
        (jax.ShapeDtypeStruct((b, heads, length, v.shape[3]), jnp.float32),
         jax.ShapeDtypeStruct((b, heads, length) if lse_used else (0,), jnp.float32)),
        vmap_method="sequential")(
        q, k, v, mask, has_mask=np.int64(attn_mask is not None), is_causal=np.int64(bool(is_causal)),
        scale=np.float64("nan" if scale is None else scale))
    return out, (lse if lse_used else jnp.zeros((b, heads, length), jnp.float32))


@register_lowering(aten._scaled_dot_product_flash_attention_for_cpu.default, reads_values=True)
def _sdpa_flash_cpu(ctx, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _check_no_dropout(dropout_p)
    done = _torch_attention(ctx, q, k, v, attn_mask, is_causal, scale)
    if done is None:
        done = _decode_attention(ctx, q, k, v, attn_mask, is_causal, scale)
    if done is not None:
        return done
    return _sdpa(q, *_unrepeated_kv(ctx, k, v), attn_mask, is_causal, scale)


@register_lowering(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_flash_cpu_backward(ctx, grad, q, k, v, out, logsumexp, dropout_p, is_causal, *,
                             attn_mask=None, scale=None):
    # Recomputed from q, k, v: AOTAutograd's decomposed forward passes the attention weights
    # where the kernel's logsumexp would be, so `out` and `logsumexp` are not relied on.
    _check_no_dropout(dropout_p)
    return _vjp(lambda q, k, v: _sdpa(q, k, v, attn_mask, is_causal, scale)[0], (q, k, v), grad)


# The fused kernels torch dispatches SDPA to on accelerators (flash, memory-efficient, cuDNN,
# and the "overrideable" one of out-of-tree devices): all lower to the same attention math. With
# dropout, the forward draws a seed from the graph's per-call key and returns it where the
# kernel returns its Philox state; the backward rebuilds the same mask from that seed. Every
# backward recomputes the weights from q, k, v (the saved out/logsumexp are not needed).

def _dropout_keep(seed, dropout_p, q, k):
    """The dropout mask of attention weights [B, H, Lq, Lk], a function of the int64 `seed`."""
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return jax.random.bernoulli(base_key(seed), 1.0 - dropout_p, shape)


def _new_seed(ctx):
    """A fresh int64 seed from this node's per-call key (what the forward hands its backward)."""
    return lax.bitcast_convert_type(jax.random.bits(ctx.rng_key(), (), jnp.uint64), jnp.int64)


def math_attention(q, k, v, bias, is_causal, scale, dropout_p, seed):
    """The math rules' attention forward: (out, logsumexp [B, H, Lq]) of q, k, v [B, H, L, D]
    with an optional `bias` (bool mask or additive), dropping out with the mask `seed` draws."""
    keep = _dropout_keep(seed, dropout_p, q, k) if dropout_p else None
    return _sdpa(q, k, v, bias, is_causal, scale, keep, dropout_p)


def math_attention_grads(grad, q, k, v, bias, is_causal, scale, dropout_p, seed, bias_grad: bool):
    """The math rules' attention backward, recomputed from q, k, v: (dq, dk, dv, dbias), dbias
    None unless `bias_grad` and a bias is given."""
    if bias is not None and bias.ndim < 2:  # the backward's required bias argument, left empty
        bias = None
    keep = _dropout_keep(seed, dropout_p, q, k) if dropout_p else None
    opmath = not _half_gemm(q.dtype)  # GPUs: bf16/f16 GEMMs, as the forward (see _sdpa)
    if bias_grad and bias is not None:
        return _vjp(lambda q, k, v, b: _sdpa(q, k, v, b, is_causal, scale, keep, dropout_p)[0], (q, k, v, bias), grad,
                    opmath)
    grads = _vjp(lambda q, k, v: _sdpa(q, k, v, bias, is_causal, scale, keep, dropout_p)[0], (q, k, v), grad, opmath)
    return (*grads, None)


def _philox(ctx, dropout_p):
    """(seed, offset) int64 scalars: a fresh seed when dropping out, else zeros."""
    seed = _new_seed(ctx) if dropout_p else jnp.zeros((), jnp.int64)
    return seed, jnp.zeros((), jnp.int64)


def _drops(node) -> bool:
    """Whether an attention node draws random bits: only with dropout_p > 0 (a graph of
    dropout-free attention takes no seed, so no per-call draw advances torch's generator)."""
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return not (isinstance(p, (int, float)) and p == 0)
    return True


@register_lowering(aten._scaled_dot_product_flash_attention.default, random=_drops)
def _sdpa_flash(ctx, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    seed, _ = _philox(ctx, dropout_p)
    out, lse = math_attention(q, k, v, None, is_causal, scale, dropout_p, seed)
    rng_state = jnp.stack([lax.bitcast_convert_type(seed, jnp.uint64), jnp.zeros((), jnp.uint64)])
    debug = jnp.zeros(ctx.out[8].shape, out.dtype)
    return out, lse, None, None, q.shape[2], k.shape[2], rng_state, jnp.zeros((), jnp.uint64), debug


@register_lowering(aten._scaled_dot_product_flash_attention_backward.default)
def _sdpa_flash_backward(ctx, grad, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                         dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    seed = lax.bitcast_convert_type(jnp.reshape(philox_seed, (-1,))[0], jnp.int64)
    return math_attention_grads(grad, q, k, v, None, is_causal, scale, dropout_p, seed, False)[:3]


@register_lowering(aten._scaled_dot_product_efficient_attention.default, random=_drops)
def _sdpa_efficient(ctx, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    seed, offset = _philox(ctx, dropout_p)
    out, lse = math_attention(q, k, v, attn_bias, is_causal, scale, dropout_p, seed)
    return out, _fit(lse, ctx.out[1].shape[-1]), seed, offset  # lse padded to 32-row blocks


@register_lowering(aten._scaled_dot_product_efficient_attention_backward.default)
def _sdpa_efficient_backward(ctx, grad, q, k, v, attn_bias, out, logsumexp, philox_seed, philox_offset,
                             dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    grads = math_attention_grads(grad, q, k, v, attn_bias, is_causal, scale, dropout_p, philox_seed,
                             bool(grad_input_mask[3]))
    return _masked(grads, grad_input_mask)


@register_lowering(aten._scaled_dot_product_cudnn_attention.default, random=_drops)
def _sdpa_cudnn(ctx, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
    seed, offset = _philox(ctx, dropout_p)
    out, lse = math_attention(q, k, v, attn_bias, is_causal, scale, dropout_p, seed)
    return out, lse[..., None], None, None, q.shape[2], k.shape[2], seed, offset, None


@register_lowering(aten._scaled_dot_product_cudnn_attention_backward.default)
def _sdpa_cudnn_backward(ctx, grad, q, k, v, out, logsumexp, philox_seed, philox_offset, attn_bias,
                         cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
    return math_attention_grads(grad, q, k, v, attn_bias, is_causal, scale, dropout_p, philox_seed, False)[:3]


@register_lowering(aten.scaled_dot_product_attention.default, random=_drops)
def _sdpa_composite(ctx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    # The composite op itself: torch.export keeps it (AOTAutograd decomposes it to a fused one).
    seed = _new_seed(ctx) if dropout_p else None
    return math_attention(q, k, v, attn_mask, is_causal, scale, dropout_p, seed)[0]


@register_lowering(aten._scaled_dot_product_fused_attention_overrideable.default, random=_drops)
def _sdpa_overrideable(ctx, q, k, v, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                       *, scale=None):
    seed, offset = _philox(ctx, dropout_p)
    out, lse = math_attention(q, k, v, attn_bias, is_causal, scale, dropout_p, seed)
    return out, lse, None, None, q.shape[2], k.shape[2], seed, offset, None


@register_lowering(aten._scaled_dot_product_fused_attention_overrideable_backward.default)
def _sdpa_overrideable_backward(ctx, grad, q, k, v, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                                cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                                *, scale=None):
    grads = math_attention_grads(grad, q, k, v, attn_bias, is_causal, scale, dropout_p, philox_seed,
                             bool(grad_input_mask[3]))
    return _masked(grads, grad_input_mask)


# On CUDA, XLA's cuDNN fused attention (jax.nn.dot_product_attention, implementation "cudnn")
# where cuDNN takes the inputs: bf16/f16 and no dropout. A training forward reads the
# log-sum-exp too: cuDNN gives it (return_residual); the backward ops recompute from q, k, v.
# Every refusal (jax's checks while tracing, or XLA/cuDNN at compile time: see
# `cudnn_attention_disabled`) falls back to the math rules above.

CUDNN_MARKER = "cudnn"  # in a module's text where it holds cuDNN attention (__cudnn$fmha... custom calls)
_cudnn_state = threading.local()


@contextlib.contextmanager
def _thread_flag(name: str):
    """Sets `_cudnn_state.<name>` for this thread inside the block (nests)."""
    old = getattr(_cudnn_state, name, False)
    setattr(_cudnn_state, name, True)
    try:
        yield
    finally:
        setattr(_cudnn_state, name, old)


def cudnn_attention_disabled():
    """Lower attention with the math rules only (a graph whose cuDNN fusion XLA rejected)."""
    return _thread_flag("off")


def fused_attention_module():
    """jax's private module of cuDNN fused attention, where `should_export_dbias` lives (read
    at each trace; raises ImportError where jax moved it)."""
    from jax._src.cudnn import fused_attention_stablehlo  # jax's private module, imported only when needed

    return fused_attention_stablehlo


_dbias_lock = threading.Lock()


def _private_dbias_switch():
    """A context in which this thread's cuDNN attention traces export no dbias (jax's backward
    kernel computes it whenever a bias or mask exists; fx2xla never reads it: a wanted bias
    gradient goes to the math rules): jax's private `should_export_dbias`, wrapped once to
    answer False inside it, as it did for broadcast biases before. None where it moved."""
    try:
        module = fused_attention_module()
        current = module.should_export_dbias
    except (ImportError, AttributeError):
        return None
    if not getattr(current, "_fx2xla", False):
        with _dbias_lock:
            current = module.should_export_dbias
            if not getattr(current, "_fx2xla", False):
                def should_export_dbias(*args, _jax=current, **kwargs):
                    return False if getattr(_cudnn_state, "no_dbias", False) else _jax(*args, **kwargs)

                should_export_dbias._fx2xla = True
                module.should_export_dbias = should_export_dbias
    return _no_dbias


def _no_dbias():
    return _thread_flag("no_dbias")


def _dbias_unexported():
    """`_private_dbias_switch`'s context; public fallback: none (dbias computed, unread)."""
    switch = _private_dbias_switch()
    return switch() if switch is not None else contextlib.nullcontext()


_lse_layouts: dict = {}  # jax.nn.dot_product_attention -> whether its residual is [B, Lq, H]


def _lse_is_blh() -> bool:
    """Whether jax.nn.dot_product_attention returns cuDNN's log-sum-exp as [B, Lq, H] (jax
    0.10's documented layout, in the output's dtype) rather than [B, H, Lq]. A shape cannot
    tell them apart when H == Lq: read once per process from an abstract evaluation with
    Lq != H; raises where cuDNN takes no inputs at all."""
    fn = jax.nn.dot_product_attention
    blh = _lse_layouts.get(fn)
    if blh is None:
        probe = jax.ShapeDtypeStruct((1, 16, 2, 64), jnp.bfloat16)  # [B, L, H, D]
        shape = jax.eval_shape(lambda x: fn(x, x, x, implementation="cudnn", return_residual=True)[1], probe).shape
        if shape not in ((1, 16, 2), (1, 2, 16)):
            raise NotImplementedError(f"cuDNN's residual has shape {shape} for [B, L, H] = [1, 16, 2]")
        blh = _lse_layouts[fn] = shape == (1, 16, 2)
    return blh


# jax's value for masked keys (fused_attention_stablehlo.get_large_negative_number): finite, as
# cuDNN mishandles the difference of two large negative numbers.
_CUDNN_MASKED = {jnp.dtype(jnp.bfloat16): -2.0 ** 41, jnp.dtype(jnp.float16): -2.0 ** 15}


def _cudnn_fused(q, k, v, bias, is_causal, scale, residual=False):
    """cuDNN attention on torch's [B, H, L, D] layout (with the [B, H, Lq] float32 log-sum-exp
    when `residual`); raises where cuDNN does not take these inputs. A row with every key
    masked gives 0 (log-sum-exp 0), as eager's math attention and the math rules do (cuDNN
    would give the mean of v for a bool mask, NaN for a -inf bias)."""
    if getattr(_cudnn_state, "off", False):
        raise NotImplementedError("cuDNN attention disabled for this graph")
    if jnp.dtype(q.dtype) not in _CUDNN_MASKED:
        raise NotImplementedError("cuDNN attention takes bf16/f16 only")
    if (is_causal and q.shape[2] != k.shape[2]) or (bias is not None and bias.ndim < 2):
        raise NotImplementedError("unsupported causal/bias form")
    blh = _lse_is_blh() if residual else None
    mask = kept = None
    if bias is not None:
        # jax broadcasts a 4-D bias itself: only leading unit dims are added here, never the
        # full [B, H, Lq, Lk] (no copy of the mask per head).
        bias = jnp.reshape(bias, (1,) * (4 - bias.ndim) + bias.shape)
        if bias.dtype == jnp.bool_:
            mask, bias, kept = bias, None, bias
        else:
            kept = bias != -jnp.inf
            # -inf would make a fully masked row's max -inf in cuDNN: NaN, in its gradients too.
            bias = jnp.maximum(bias.astype(q.dtype), jnp.asarray(_CUDNN_MASKED[jnp.dtype(q.dtype)], q.dtype))
    if kept is not None:
        if is_causal:  # keys after a row's own position are masked too
            shape = (q.shape[2], k.shape[2])
            kept = kept & (lax.broadcasted_iota(jnp.int32, shape, 0) >= lax.broadcasted_iota(jnp.int32, shape, 1))
        kept = jnp.any(kept, axis=-1, keepdims=True)  # [b, h, Lq, 1]: rows with a key left
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, H, L, D] <-> [B, L, H, D]
    with _dbias_unexported():
        result = jax.nn.dot_product_attention(t(q), t(k), t(v), bias=bias, mask=mask, scale=scale,
                                              is_causal=bool(is_causal), implementation="cudnn",
                                              return_residual=residual)
    out, lse = result if residual else (result, None)
    out = t(out)
    if kept is not None:
        out = jnp.where(kept, out, jnp.zeros((), out.dtype))
    if not residual:
        return out
    lse = t(lse) if blh else lse  # -> [B, H, Lq]
    if lse.shape != q.shape[:3]:
        raise NotImplementedError(f"cuDNN's residual has shape {lse.shape}, not [B, H, Lq] {q.shape[:3]}")
    lse = lse.astype(jnp.float32)  # (jax 0.10 rounds it to the output's dtype; the backward rules never read it)
    if kept is not None:
        lse = jnp.where(kept[..., 0], lse, jnp.zeros((), lse.dtype))
    return out, lse


_CUDNN_REFUSALS = (RuntimeError, ValueError, NotImplementedError, TypeError)


def _cudnn_attention(q, k, v, bias, is_causal, scale, residual=False):
    """_cudnn_fused, or None where cuDNN does not take these inputs."""
    try:
        return _cudnn_fused(q, k, v, bias, is_causal, scale, residual)
    except _CUDNN_REFUSALS:
        return None


def _cudnn_grads(grad, q, k, v, bias, is_causal, scale):
    """(dq, dk, dv) through cuDNN's fused backward, or None where cuDNN does not apply (jax's
    vjp rule refuses some forms the forward takes, e.g. a bias with odd sequence lengths)."""
    try:
        out, pull = jax.vjp(lambda q, k, v: _cudnn_fused(q, k, v, bias, is_causal, scale), q, k, v)
        return pull(grad.astype(out.dtype))
    except _CUDNN_REFUSALS:
        return None


def _only_output_read(node) -> bool:
    """Whether the attention output (item 0) is the only result of `node` anything reads."""
    import operator

    return all(u.target is operator.getitem and u.args[1] == 0 for u in node.users)


def _unread_extras(ctx, out):
    """`out` plus stand-ins for the extra results of a fused-attention node that nothing reads
    (zeros of their shapes, their sizes, None)."""
    extras = []
    for meta in ctx.out[1:]:
        if isinstance(meta, torch.Tensor):
            extras.append(jnp.zeros(concrete_shape(meta.shape, ctx.sizes), to_jax_dtype(meta.dtype)))
        elif isinstance(meta, torch.SymInt):
            extras.append(ctx.sizes(meta))
        else:
            extras.append(meta)
    return (out, *extras)


def _cuda_attention_rule(op, generic, parse):
    """A CUDA rule for fused-attention forward `op`: cuDNN where it applies, else `generic`.
    parse(*args, **kwargs) -> (q, k, v, bias, dropout_p, is_causal, scale)."""
    @register_lowering(op, random=_drops, platform="cuda")
    def rule(ctx, *args, **kwargs):
        q, k, v, bias, dropout_p, is_causal, scale = parse(*args, **kwargs)
        single = not isinstance(ctx.out, (tuple, list))  # the composite op: the output alone
        if not dropout_p:
            if single or _only_output_read(ctx.node):
                out = _cudnn_attention(q, k, v, bias, is_causal, scale)
                if out is not None:
                    return out if single else _unread_extras(ctx, out)
            elif _lse_shape_ok(ctx):  # a training forward: the backward is saved the lse
                fused = _cudnn_attention(q, k, v, bias, is_causal, scale, residual=True)
                if fused is not None:
                    return _with_lse(ctx, *fused)
        return generic(ctx, *args, **kwargs)

    return rule


def _lse_shape_ok(ctx) -> bool:
    """Whether result 1 of this attention node is the [B, H, Lq] log-sum-exp (flash, efficient
    unpadded) or [B, H, Lq, 1] (cuDNN's) that `_with_lse` fills."""
    meta = ctx.out[1] if len(ctx.out) > 1 else None
    return isinstance(meta, torch.Tensor) and meta.dim() in (3, 4) and \
        all(isinstance(s, int) for s in meta.shape)


def _with_lse(ctx, out, lse):
    """The results of a fused-attention node from cuDNN's output and log-sum-exp; the other
    extras (seeds, sizes) as `_unread_extras` makes them."""
    meta = ctx.out[1]
    want = tuple(meta.shape)
    if len(want) == 4:
        lse = lse[..., None]
    lse = _fit(lse, want[-1]) if len(want) == 3 and want[-1] != lse.shape[-1] else lse
    results = list(_unread_extras(ctx, out))
    results[1] = lse.astype(to_jax_dtype(meta.dtype))
    return tuple(results)


def _cuda_attention_backward_rule(op, generic, parse):
    """A CUDA rule for fused-attention backward `op`. parse(*args, **kwargs) -> (grad, q, k, v,
    bias, dropout_p, is_causal, scale, outputs wanted (dq, dk, dv, dbias))."""
    @register_lowering(op, platform="cuda")
    def rule(ctx, *args, **kwargs):
        grad, q, k, v, bias, dropout_p, is_causal, scale, wanted = parse(*args, **kwargs)
        if not dropout_p and (len(wanted) < 4 or not wanted[3]):
            grads = _cudnn_grads(grad, q, k, v, bias, is_causal, scale)
            if grads is not None:
                grads = tuple(g if w else None for g, w in zip(grads, wanted))
                return grads if len(ctx.out) == 3 else (*grads, None)
        return generic(ctx, *args, **kwargs)

    return rule


_cuda_attention_rule(
    aten._scaled_dot_product_flash_attention.default, _sdpa_flash,
    lambda q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None:
        (q, k, v, None, dropout_p, is_causal, scale))
_cuda_attention_rule(
    aten._scaled_dot_product_efficient_attention.default, _sdpa_efficient,
    lambda q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None:
        (q, k, v, attn_bias, dropout_p, is_causal, scale))
_cuda_attention_rule(
    aten._scaled_dot_product_cudnn_attention.default, _sdpa_cudnn,
    lambda q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
    scale=None: (q, k, v, attn_bias, dropout_p, is_causal, scale))
_cuda_attention_rule(
    aten.scaled_dot_product_attention.default, _sdpa_composite,
    lambda q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False:
        (q, k, v, attn_mask, dropout_p, is_causal, scale))
_cuda_attention_backward_rule(
    aten._scaled_dot_product_flash_attention_backward.default, _sdpa_flash_backward,
    lambda grad, q, k, v, out, lse, cq, ck, mq, mk, dropout_p, is_causal, seed, offset, *, scale=None:
        (grad, q, k, v, None, dropout_p, is_causal, scale, [True, True, True]))
_cuda_attention_backward_rule(
    aten._scaled_dot_product_efficient_attention_backward.default, _sdpa_efficient_backward,
    lambda grad, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False, *,
    scale=None: (grad, q, k, v, attn_bias, dropout_p, is_causal, scale, [bool(m) for m in grad_input_mask]))
_cuda_attention_backward_rule(
    aten._scaled_dot_product_cudnn_attention_backward.default, _sdpa_cudnn_backward,
    lambda grad, q, k, v, out, lse, seed, offset, attn_bias, cq, ck, mq, mk, dropout_p, is_causal, *, scale=None:
        (grad, q, k, v, attn_bias, dropout_p, is_causal, scale, [True, True, True]))


# ---------------------------------------------------------------------------------------------
# Distances
# ---------------------------------------------------------------------------------------------

def _p_norm(diff, p):
    """The p-norm of `diff` along its last axis, with torch's special cases p = 0, 1, 2, inf."""
    a = jnp.abs(diff)
    if p == 0:  # counts the nonzero differences
        return jnp.sum((a != 0).astype(a.dtype), axis=-1)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    if math.isinf(p):
        return jnp.max(a, axis=-1, initial=0.0)
    return jnp.sum(a ** p, axis=-1) ** (1.0 / p)


def _euclidean_dist(x1, x2):
    """torch's matmul form of p=2 cdist: [-2 x1, |x1|^2, 1] @ [x2, 1, |x2|^2]^T, clamped at 0."""
    n1, n2 = (jnp.sum(v * v, axis=-1, keepdims=True) for v in (x1, x2))
    a = jnp.concatenate([x1 * -2, n1, jnp.ones_like(n1)], axis=-1)
    b = jnp.concatenate([x2, jnp.ones_like(n2), n2], axis=-1)
    batch = tuple(range(a.ndim - 2))
    d = dot(a, b, ((a.ndim - 1,), (b.ndim - 1,)), (batch, batch))
    return jnp.sqrt(jnp.maximum(d, jnp.zeros((), d.dtype)))


@register_lowering(aten._cdist_forward.default)
def _cdist_forward(ctx, x1, x2, p, compute_mode=None):
    x1, x2 = _opmath(x1), _opmath(x2)
    batch = ctx.out_shape[:-2]
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    mode = compute_mode or 0
    # Like ATen's cdist_impl: p=2 uses the matmul form when asked (1) or, by default (0),
    # when either side has more than 25 rows; 2 always computes the differences.
    if p == 2 and x1.shape[-1] > 0 and (mode == 1 or (mode == 0 and max(x1.shape[-2], x2.shape[-2]) > 25)):
        return _euclidean_dist(x1, x2)
    return _p_norm(x1[..., :, None, :] - x2[..., None, :, :], p)


@register_lowering(aten._pdist_forward.default)
def _pdist_forward(ctx, x, p=2):
    # Distances between rows i < j, in row-major (i, j) order.
    i, j = np.triu_indices(x.shape[0], k=1)
    x = _opmath(x)
    return _p_norm(jnp.take(x, jnp.asarray(i), axis=0) - jnp.take(x, jnp.asarray(j), axis=0), p)


# ---------------------------------------------------------------------------------------------
# Sampling and folding
# ---------------------------------------------------------------------------------------------

# Grid sampling (F.grid_sample): ATen's CPU kernels (GridSamplerKernel.cpp for 2-d, the scalar
# GridSampler.cpp for 3-d). Coordinates follow each kernel's arithmetic; gradients are jax's
# derivatives of the same formulas, which the clip and reflection below are written so that
# they equal ATen's hand-written ones, borders included.

def _unnormalize(coord, size, align_corners, kernel_2d):
    """A grid coordinate in [-1, 1] as a pixel coordinate: the vectorized 2-d kernel's
    `(c + 1) * scale - 0.5`, or the scalar 3-d kernel's `((c + 1) * size - 1) / 2` (and their
    align_corners forms): equal in exact arithmetic, rounded differently."""
    one = jnp.ones((), coord.dtype)
    if kernel_2d:
        if align_corners:
            return (coord + one) * jnp.asarray((size - 1) / 2, coord.dtype)
        return (coord + one) * jnp.asarray(size / 2, coord.dtype) - jnp.asarray(0.5, coord.dtype)
    if align_corners:
        return (coord + one) / 2 * (size - 1)
    return ((coord + one) * size - one) / 2


def _clip(coord, size):
    """Clamp into [0, size - 1], NaN to 0; the derivative is 0 on and beyond both borders
    (ATen: "borders are considered out of bounds" for the gradient)."""
    zero, hi = jnp.zeros((), coord.dtype), jnp.asarray(size - 1, coord.dtype)
    return jnp.where(coord > zero, jnp.where(coord < hi, coord, hi), zero)


def _reflect(coord, size, align_corners, kernel_2d):
    """Reflect into [-0.5, size - 0.5] (align_corners: [0, size - 1]) as ATen's
    reflect_coordinates: the 2-d kernel takes whole double spans off |c - low|, the 3-d one
    counts single-span flips with fmod. The derivative is +-1 by the flips' parity and the sign."""
    if align_corners:
        if size <= 1:
            return jnp.zeros_like(coord)
        low, twice_span = 0.0, 2.0 * (size - 1)
    else:
        low, twice_span = -0.5, 2.0 * size
    low = jnp.asarray(low, coord.dtype)
    a = coord - low
    a = jnp.where(a < 0, -a, a)
    if kernel_2d:
        twice_span = jnp.asarray(twice_span, coord.dtype)
        extra = a - jnp.trunc(a / twice_span) * twice_span
        other = twice_span - extra
        return jnp.where(extra > other, other, extra) + low
    span = jnp.asarray(twice_span / 2, coord.dtype)
    extra = jnp.fmod(a, span)
    odd = jnp.fmod(jnp.floor(a / span), 2) != 0
    return jnp.where(odd, span - extra + low, extra + low)


def _pad_coordinate(coord, size, padding_mode, align_corners, kernel_2d):
    """ATen's compute_coordinates: border clips, reflection reflects then clips, zeros keeps."""
    if padding_mode == 1:
        return _clip(coord, size)
    if padding_mode == 2:
        return _clip(_reflect(coord, size, align_corners, kernel_2d), size)
    return coord


def _cubic_weights(t):
    """The four bicubic convolution weights (A = -0.75, ATen's) of taps -1, 0, 1, 2 at
    fractional offset t."""
    a = jnp.asarray(-0.75, t.dtype)
    return _keys_far(t + 1, a), _keys_near(t, a), _keys_near(1 - t, a), _keys_far(2 - t, a)


def _grid_sample(x, grid, mode, padding_mode, align_corners):
    """F.grid_sample of x (N, C, [D,] H, W) at grid (N, [Do,] Ho, Wo, nd): grid[..., 0] indexes
    W, grid[..., 1] H, grid[..., 2] D. Modes: 0 bilinear/trilinear, 1 nearest, 2 bicubic (2-d).

    Coordinates and weights are computed in the grid's dtype, values in x's, with each kernel's
    formulas and order of operations: ATen's bf16/f16 kernels round every step (coordinates,
    weights, products, sums) to the input dtype, and with the same steps the results are
    eager's, bit for bit. (The backward passes x in float32 and the grid as it is: the
    gradients are those of the very points the forward sampled, summed in float32.)"""
    nd = grid.shape[-1]
    n, c = x.shape[:2]
    sizes = x.shape[2:]
    out_spatial = grid.shape[1:-1]
    kernel_2d = nd == 2
    flat = x.reshape(n, c, -1)
    strides = [math.prod(sizes[k + 1:]) for k in range(nd)]
    index_dtype = jnp.int32 if math.prod(sizes) < 2 ** 31 else jnp.int64
    points = math.prod(out_spatial)
    zeros_mode = padding_mode == 0
    # coordinates per input dim (D, H, W order), in the grid's dtype as ATen computes them
    raw = [grid[..., nd - 1 - k] for k in range(nd)]

    def tap(index):
        """x at integer-valued coordinates `index` (one array per input dim), 0 outside."""
        inside = None
        lin = 0
        for i, size, stride in zip(index, sizes, strides):
            ok = (i > -1) & (i < size)
            inside = ok if inside is None else inside & ok
            lin = lin + jnp.clip(i, 0, size - 1).astype(index_dtype) * stride
        v = jnp.take_along_axis(flat, jnp.broadcast_to(lin.reshape(n, 1, -1), (n, c, points)), axis=2)
        if zeros_mode:
            v = jnp.where(inside.reshape(n, 1, -1), v, jnp.zeros((), v.dtype))
        return v.reshape((n, c) + out_spatial)

    def weighted(w):  # a weight per point, against every channel's values
        return w.astype(x.dtype)[:, None]

    if mode == 2:  # bicubic: padding applies to each tap, not to the sampling point
        pos = [_unnormalize(r, s, align_corners, kernel_2d) for r, s in zip(raw, sizes)]
        base = [jnp.floor(p) for p in pos]
        wy, wx = (_cubic_weights(p - b) for p, b in zip(pos, base))
        ys, xs = ([jnp.trunc(_pad_coordinate(b + (t - 1), size, padding_mode, align_corners, True)) for t in range(4)]
                  for b, size in zip(base, sizes))
        out = 0
        for yy, w_row in zip(ys, wy):
            row = 0
            for xx, w_col in zip(xs, wx):
                row = row + tap([yy, xx]) * weighted(w_col)
            out = out + row * weighted(w_row)
        return out
    pos = [_pad_coordinate(_unnormalize(r, s, align_corners, kernel_2d), s, padding_mode, align_corners, kernel_2d)
           for r, s in zip(raw, sizes)]
    if mode == 1:  # nearest: round half to even, as nearbyint
        return tap([jnp.round(p) for p in pos])
    lo = [jnp.floor(p) for p in pos]
    one = jnp.ones((), grid.dtype)
    # Corner weights: the 2-d kernel's (c - lo, 1 - (c - lo)), products y * x; the 3-d kernel's
    # (c - lo, lo + 1 - c), products x * y * z. Corners in ATen's order (nw, ne, sw, se, ...).
    if kernel_2d:
        near = [p - b for p, b in zip(pos, lo)]
        sides = [(one - f, f) for f in near]
        order = range(nd)
    else:
        sides = [((b + one) - p, p - b) for p, b in zip(pos, lo)]
        order = range(nd - 1, -1, -1)
    out = 0
    for corner in itertools.product((0, 1), repeat=nd):
        weight = None
        for k in order:
            wk = sides[k][corner[k]]
            weight = wk if weight is None else weight * wk
        out = out + tap([b + bit for b, bit in zip(lo, corner)]) * weighted(weight)
    return out


def _grid_sampler_mode(node) -> bool:
    """A known interpolation mode (argument 2 of the forward, 3 of the backward)."""
    at = 3 if "backward" in node.target.name() else 2
    mode = node.args[at] if len(node.args) > at else node.kwargs.get("interpolation_mode")
    return mode in (0, 1, 2)


@register_lowering(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default, accepts=_grid_sampler_mode)
def _grid_sampler(ctx, x, grid, interpolation_mode, padding_mode, align_corners):
    if interpolation_mode == 2 and grid.shape[-1] != 2:
        raise RejectedInput("grid_sampler(): bicubic interpolation only supports 4D input")
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


@register_lowering(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default,
                   accepts=_grid_sampler_mode)
def _grid_sampler_backward(ctx, grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask):
    out, pull = jax.vjp(lambda a, g: _grid_sample(a, g, interpolation_mode, padding_mode, align_corners),
                        _opmath(x), grid)
    dx, dgrid = pull(grad.astype(out.dtype))
    return _masked((dx, dgrid), output_mask)


@register_lowering(aten.col2im.default)
def _col2im(ctx, x, output_size, kernel_size, dilation, padding, stride):
    # Each kernel offset's block of columns is placed on the strided grid of the padded output
    # by one lax.pad (interior padding = stride - 1) and summed; the padding is then cropped.
    unbatched = x.ndim == 2
    y = _opmath(x[None] if unbatched else x)
    (oh, ow), (kh, kw), d, p, s = (
        _per_dim(v, 2) for v in (output_size, kernel_size, dilation, padding, stride))
    lh = (oh + 2 * p[0] - d[0] * (kh - 1) - 1) // s[0] + 1
    lw = (ow + 2 * p[1] - d[1] * (kw - 1) - 1) // s[1] + 1
    n, c = y.shape[0], y.shape[1] // (kh * kw)
    blocks = y.reshape(n, c, kh, kw, lh, lw)
    hp, wp = oh + 2 * p[0], ow + 2 * p[1]
    zero = jnp.zeros((), y.dtype)
    out = jnp.zeros((n, c, hp, wp), y.dtype)
    for i in range(kh):
        for j in range(kw):
            r, q = i * d[0], j * d[1]
            out = out + lax.pad(blocks[:, :, i, j], zero, [
                (0, 0, 0), (0, 0, 0),
                (r, hp - r - (lh - 1) * s[0] - 1, s[0] - 1),
                (q, wp - q - (lw - 1) * s[1] - 1, s[1] - 1)])
    out = out[:, :, p[0]:p[0] + oh, p[1]:p[1] + ow]
    return out[0] if unbatched else out


# ---------------------------------------------------------------------------------------------
# Embedding bag
# ---------------------------------------------------------------------------------------------

def _fit(v, n):
    """`v` cut or zero-padded along its last dim to length n (aux outputs whose lengths follow
    torch's meta: embedding_bag's, the efficient attention kernel's padded logsumexp)."""
    if v.shape[-1] >= n:
        return v[..., :n]
    return jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, n - v.shape[-1])])


@register_lowering(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(ctx, weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    # Returns (output, offset2bag, bag_size, max_indices) with the values ATen's CPU kernel
    # gives: offset2bag is each index's bag (empty on the sum fast path), bag_size counts the
    # non-padding indices of each bag (zeros for sum), max_indices holds the chosen weight row
    # per bag and column for max (0 for empty bags) and a copy of bag_size otherwise.
    out_meta = ctx.out
    num_bags = out_meta[0].shape[0]
    n = indices.shape[0]
    idx_dtype = offsets.dtype
    bag = (jnp.searchsorted(offsets[:num_bags], jnp.arange(n, dtype=offsets.dtype), side="right")
           - 1).astype(idx_dtype)
    keep = indices != padding_idx if padding_idx is not None and padding_idx >= 0 else jnp.ones((n,), bool)
    ctx.check_index(indices, weight.shape[0], negative=False, what="embedding_bag index")
    rows = jnp.take(_opmath(weight), indices, axis=0, mode="clip")
    if per_sample_weights is not None:
        rows = rows * _opmath(per_sample_weights)[:, None]
    count = jax.ops.segment_sum(keep.astype(idx_dtype), bag, num_segments=num_bags)
    zero = jnp.zeros((), rows.dtype)
    if mode == 2:
        masked = jnp.where(keep[:, None], rows, jnp.asarray(-jnp.inf, rows.dtype))
        best = jax.ops.segment_max(masked, bag, num_segments=num_bags)
        hit = keep[:, None] & (masked == jnp.take(best, bag, axis=0))
        pos = jnp.arange(n, dtype=idx_dtype)[:, None]
        first = jax.ops.segment_min(jnp.where(hit, pos, n), bag, num_segments=num_bags)  # ties: first
        empty = (count == 0)[:, None]
        out = jnp.where(empty, zero, best)
        max_indices = jnp.where(empty, jnp.zeros((), idx_dtype),
                                jnp.take(indices.astype(idx_dtype), jnp.minimum(first, n - 1)))
    else:
        out = jax.ops.segment_sum(jnp.where(keep[:, None], rows, zero), bag, num_segments=num_bags)
        if mode == 1:
            out = out / jnp.maximum(count, 1).astype(out.dtype)[:, None]
        else:
            count = jnp.zeros_like(count)
        max_indices = None
    bag_size = _fit(count, out_meta[2].shape[0])
    if max_indices is None:
        max_indices = _fit(count, out_meta[3].shape[0])
    return out, _fit(bag, out_meta[1].shape[0]), bag_size, max_indices
