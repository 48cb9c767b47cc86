"""Lowering rules: nn — activations, softmax, normalization, convolution, pooling, upsampling,
attention, and the backward ops AOTAutograd leaves undecomposed.

Half-precision inputs are computed in float32 (torch's "opmath" type) and rounded once when
the registry casts the result to torch's output dtype. Window geometry (pool indices, divisors,
interpolation weights) depends only on static shapes, so it is computed with numpy at trace
time and enters the program as constants.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torch.ops import aten

from .linalg import accumulation_dtype, dot, matmul_precision
from .registry import register_lowering
from .shape import canonical_dim


def _opmath(x):
    """`x` in the dtype torch computes it in: float32 for bf16/f16, unchanged otherwise."""
    dt = accumulation_dtype(x.dtype)
    return x if x.dtype == dt else x.astype(dt)


def _vjp(fn, primals, cotangent):
    """Gradients of `fn` (one output) at `primals` for `cotangent`, computed in opmath dtypes."""
    out, pull = jax.vjp(fn, *[_opmath(p) for p in primals])
    return pull(cotangent.astype(out.dtype))


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


def _batch_norm_eval(x, weight, bias, running_mean, running_var, eps):
    x = _opmath(x)
    invstd = lax.rsqrt(_opmath(running_var).astype(x.dtype) + eps)
    out = _batch_norm_apply(x, _opmath(running_mean).astype(x.dtype), invstd, weight, bias)
    empty = jnp.zeros((0,), x.dtype)  # torch returns empty save_mean/save_rstd in eval
    return out, empty, empty


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
    return _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)


@register_lowering(aten._native_batch_norm_legit.default)
def _bn_legit(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        return _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)
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
        out, save_mean, save_rstd = _batch_norm_eval(x, weight, bias, running_mean, running_var, eps)
        return out, save_mean, save_rstd, running_mean, running_var
    out, mean, var, rstd = _batch_norm_train(x, weight, bias, eps)
    n = x.size // x.shape[1]
    unbiased = var * (n / (n - 1)) if n > 1 else var * jnp.nan  # torch divides by n - 1 = 0
    new_mean = (1 - momentum) * _opmath(running_mean) + momentum * mean
    new_var = (1 - momentum) * _opmath(running_var) + momentum * unbiased
    return out, mean, rstd, new_mean, new_var


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
    """torch's convolution (batched, no bias) as one conv_general_dilated, in opmath."""
    nd = w.ndim - 2
    stride, padding, dilation, output_padding = (
        _per_dim(v, nd) for v in (stride, padding, dilation, output_padding))
    spatial = "DHW"[3 - nd:] if nd <= 3 else None
    dims = ("NC" + spatial, "OI" + spatial, "NC" + spatial)
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

    dx, dw = _vjp(fwd, (x, w), grad)
    db = jnp.sum(_opmath(grad), axis=(0,) + tuple(range(2, grad.ndim)))
    return _masked((dx[0] if unbatched else dx, dw, db), output_mask)


# ---------------------------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------------------------

def _pool_args(kernel_size, stride, padding, dilation=1):
    k = _per_dim(kernel_size, 2)
    s = _per_dim(stride, 2) if stride else k  # torch: an empty stride means stride = kernel
    return k, s, _per_dim(padding, 2), _per_dim(dilation, 2)


def _window_pad(out_size, in_size, k, s, p, d=1):
    """(low, high) padding so that every window of every output lies inside the array."""
    return p, max((out_size - 1) * s + (k - 1) * d + 1 - p - in_size, 0)


def _strided_window(xp, i, j, out_hw, s, d):
    """The element at kernel offset (i, j) of every window of the padded input `xp`."""
    lead = xp.ndim - 2
    start = (0,) * lead + (i * d[0], j * d[1])
    limit = xp.shape[:lead] + tuple(st + (o - 1) * ss + 1 for st, o, ss in zip(start[lead:], out_hw, s))
    return lax.slice(xp, start, limit, (1,) * lead + tuple(s))


@register_lowering(aten.max_pool2d_with_indices.default)
def _max_pool2d_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    k, s, p, d = _pool_args(kernel_size, stride, padding, dilation)
    (h, w), (oh, ow) = x.shape[-2:], ctx.out_shape[-2:]
    pads = [_window_pad(o, n, kk, ss, pp, dd) for o, n, kk, ss, pp, dd in zip((oh, ow), (h, w), k, s, p, d)]
    xp = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0)] * (x.ndim - 2) + [(lo, hi, 0) for lo, hi in pads])
    rows0, cols0 = np.arange(oh) * s[0] - p[0], np.arange(ow) * s[1] - p[1]
    # torch scans each window in row-major order from its first in-bounds element (the
    # initial index), taking an element if it is greater than the running max or NaN.
    first_r = np.where(rows0 < 0, rows0 + -(-(-rows0) // d[0]) * d[0], rows0)
    first_c = np.where(cols0 < 0, cols0 + -(-(-cols0) // d[1]) * d[1], cols0)
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    lowest = -jnp.inf if floating else jnp.iinfo(x.dtype).min
    best = jnp.full(ctx.out_shape, lowest, x.dtype)
    best_idx = jnp.broadcast_to(jnp.asarray(first_r[:, None] * w + first_c[None, :]), ctx.out_shape)
    for i in range(k[0]):
        r = rows0 + i * d[0]
        for j in range(k[1]):
            c = cols0 + j * d[1]
            v = _strided_window(xp, i, j, (oh, ow), s, d)
            take = v > best
            if floating:
                take = take | jnp.isnan(v)
            valid = ((r >= 0) & (r < h))[:, None] & ((c >= 0) & (c < w))[None, :]
            if not valid.all():
                take = take & valid
            best = jnp.where(take, v, best)
            best_idx = jnp.where(take, jnp.asarray(r[:, None] * w + c[None, :]), best_idx)
    return best, best_idx


@register_lowering(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_with_indices_backward(ctx, grad, x, kernel_size, stride, padding, dilation,
                                      ceil_mode, indices):
    # Scatter-add each output gradient to the flat (H*W) input position torch recorded.
    planes = math.prod(x.shape[:-2])
    hw = x.shape[-2] * x.shape[-1]
    g = _opmath(grad).reshape(planes, -1)
    idx = indices.reshape(planes, -1)
    rows = jnp.arange(planes, dtype=idx.dtype)[:, None]
    out = jnp.zeros((planes, hw), g.dtype).at[rows, idx].add(g, mode="promise_in_bounds")
    return out.reshape(x.shape)


def _avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, out_hw):
    k, s, p, _ = _pool_args(kernel_size, stride, padding)
    hw = x.shape[-2:]
    y = _opmath(x)
    pads = [_window_pad(o, n, kk, ss, pp) for o, n, kk, ss, pp in zip(out_hw, hw, k, s, p)]
    lead = x.ndim - 2
    total = lax.reduce_window(y, np.zeros((), y.dtype), lax.add, (1,) * lead + tuple(k),
                              (1,) * lead + tuple(s), [(0, 0)] * lead + pads)
    total = total[..., :out_hw[0], :out_hw[1]]
    if divisor_override:
        divisor = np.full(out_hw, divisor_override)
    else:
        # torch: windows are clipped to the padded input; without count_include_pad, also
        # to the input itself.
        def extent(o, n, kk, ss, pp):
            start = np.arange(o) * ss - pp
            end = np.minimum(start + kk, n + pp)
            if count_include_pad:
                return end - start
            return np.minimum(end, n) - np.maximum(start, 0)
        eh, ew = (extent(o, n, kk, ss, pp) for o, n, kk, ss, pp in zip(out_hw, hw, k, s, p))
        divisor = eh[:, None] * ew[None, :]
    divisor = jnp.asarray(divisor, y.dtype)
    if jnp.issubdtype(y.dtype, jnp.integer):
        return lax.div(total, jnp.broadcast_to(divisor, total.shape))  # truncates, like C++
    return total / divisor


@register_lowering(aten.avg_pool2d.default)
def _avg_pool2d_rule(ctx, x, kernel_size, stride=(), padding=0, ceil_mode=False,
                     count_include_pad=True, divisor_override=None):
    return _avg_pool2d(x, kernel_size, stride, padding, ceil_mode, count_include_pad,
                       divisor_override, ctx.out_shape[-2:])


@register_lowering(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(ctx, grad, x, kernel_size, stride, padding, ceil_mode,
                         count_include_pad, divisor_override):
    def fwd(y):
        return _avg_pool2d(y, kernel_size, stride, padding, ceil_mode, count_include_pad,
                           divisor_override, grad.shape[-2:])
    return _vjp(fwd, (x,), grad)[0]


def _adaptive_avg_pool2d(x, out_hw):
    y = _opmath(x)
    for axis, o in zip((y.ndim - 2, y.ndim - 1), out_hw):
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


@register_lowering(aten._adaptive_avg_pool2d.default)
def _adaptive_avg_pool2d_rule(ctx, x, output_size):
    return _adaptive_avg_pool2d(x, ctx.out_shape[-2:])


@register_lowering(aten._adaptive_avg_pool2d_backward.default)
def _adaptive_avg_pool2d_backward(ctx, grad, x):
    return _vjp(lambda y: _adaptive_avg_pool2d(y, grad.shape[-2:]), (x,), grad)[0]


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


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

def _sdpa(q, k, v, attn_mask, is_causal, scale):
    """Attention like ATen's CPU flash kernel, in opmath: returns (out, logsumexp). Rows with
    every key masked give output 0 and logsumexp 0 (the kernel's max -> 0, sum -> 1 rule)."""
    q, k, v = _opmath(q), _opmath(k), _opmath(v)
    if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a group
        k = jnp.repeat(k, q.shape[1] // k.shape[1], axis=1)
        v = jnp.repeat(v, q.shape[1] // v.shape[1], axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = dot(q, k, ((3,), (3,)), ((0, 1), (0, 1))) * jnp.asarray(scale, q.dtype)
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
    out = dot(p, v, ((3,), (2,)), ((0, 1), (0, 1))) / total
    return out, (m + jnp.log(total))[..., 0]


def _check_no_dropout(dropout_p):
    if dropout_p:
        raise NotImplementedError("fx2xla: attention dropout (dropout_p > 0) is not supported")


@register_lowering(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_flash_cpu(ctx, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    _check_no_dropout(dropout_p)
    return _sdpa(q, k, v, attn_mask, is_causal, scale)


@register_lowering(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def _sdpa_flash_cpu_backward(ctx, grad, q, k, v, out, logsumexp, dropout_p, is_causal, *,
                             attn_mask=None, scale=None):
    # Recomputed from q, k, v: AOTAutograd's decomposed forward passes the attention weights
    # where the kernel's logsumexp would be, so `out` and `logsumexp` are not relied on.
    _check_no_dropout(dropout_p)
    return _vjp(lambda q, k, v: _sdpa(q, k, v, attn_mask, is_causal, scale)[0], (q, k, v), grad)
