"""Lowering rules: reductions, scans, sort and topk.

Like torch, bfloat16/float16 inputs accumulate in float32 (sum, mean, prod, var, cumsum) and
the registry rounds the result to torch's output dtype.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from torch.ops import aten

from .registry import RejectedInput, register_lowering

_F32 = np.dtype(jnp.float32)
_REDUCED = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_INDEX = np.dtype(jnp.int64)


def _axes(x, dim, empty_means_all: bool = True) -> tuple[int, ...]:
    """Normalized reduction axes. None means all; so does [] unless empty_means_all is
    False (any.dims). A 0-d tensor accepts dim 0 / -1 and has nothing to reduce."""
    if isinstance(dim, int):
        dim = [dim]
    if dim is None or (len(dim) == 0 and empty_means_all):
        return tuple(range(x.ndim))
    if x.ndim == 0:
        return ()
    return tuple(sorted({d % x.ndim for d in dim}))


def _accumulate(ctx, x):
    """`x` cast to the output dtype (torch applies `dtype=` before reducing), then to float32
    if that is bf16/f16. A complex `x` whose reduction is real (var, norm) stays complex at the
    output's precision: the rule takes its magnitude itself."""
    dtype = ctx.out_dtype
    if jnp.iscomplexobj(x) and not jnp.issubdtype(dtype, jnp.complexfloating):
        dtype = jnp.result_type(dtype, jnp.complex64)
    x = lax.convert_element_type(x, dtype)
    return lax.convert_element_type(x, _F32) if dtype in _REDUCED else x


def _count(x, axes) -> int:
    return math.prod(x.shape[a] for a in axes)


@register_lowering(aten.sum.dim_IntList, aten.sum.default)
def _sum(ctx, x, dim=None, keepdim=False, dtype=None):
    return jnp.sum(_accumulate(ctx, x), axis=_axes(x, dim), keepdims=keepdim)


@register_lowering(aten.prod.default, aten.prod.dim_int)
def _prod(ctx, x, dim=None, keepdim=False, dtype=None):
    return jnp.prod(_accumulate(ctx, x), axis=_axes(x, dim), keepdims=keepdim)


@register_lowering(aten.mean.default, aten.mean.dim)
def _mean(ctx, x, dim=None, keepdim=False, dtype=None):
    axes = _axes(x, dim)
    total = jnp.sum(_accumulate(ctx, x), axis=axes, keepdims=keepdim)
    return lax.div(total, jnp.asarray(_count(x, axes), total.dtype))  # empty: 0 / 0 = NaN


def _variance(ctx, x, dim, correction, keepdim):
    axes = _axes(x, dim)
    xa = _accumulate(ctx, x)
    n = _count(x, axes)
    mean = lax.div(jnp.sum(xa, axis=axes, keepdims=True), jnp.asarray(n, xa.dtype))
    d = lax.sub(xa, mean)
    sq = lax.mul(d, d) if not jnp.iscomplexobj(d) else lax.add(lax.square(lax.real(d)), lax.square(lax.imag(d)))
    ss = jnp.sum(sq, axis=axes, keepdims=keepdim)  # complex: the mean of |x - mean|^2
    # torch divides by max(N - correction, 0): inf or NaN when there are too few elements.
    denom = max(n - (1 if correction is None else correction), 0)
    return lax.div(ss, jnp.asarray(denom, ss.dtype))


@register_lowering(aten.var.correction)
def _var_correction(ctx, x, dim=None, correction=None, keepdim=False):
    return _variance(ctx, x, dim, correction, keepdim)


@register_lowering(aten.var_mean.correction)
def _var_mean(ctx, x, dim=None, correction=None, keepdim=False):
    return _variance(ctx, x, dim, correction, keepdim), _mean(ctx, x, dim, keepdim)


@register_lowering(aten.var.dim)
def _var_dim(ctx, x, dim=None, unbiased=True, keepdim=False):
    return _variance(ctx, x, dim, 1 if unbiased else 0, keepdim)


@register_lowering(aten.linalg_vector_norm.default)
def _vector_norm(ctx, x, ord=2, dim=None, keepdim=False, dtype=None):  # noqa: A002 (aten's name)
    return p_norm(lax.abs(_accumulate(ctx, x)), ord, _axes(x, dim), keepdim)


def p_norm(a, ord, axes, keepdim=False):  # noqa: A002 (aten's name)
    """The `ord`-norm over `axes` of `a`, already absolute and in the accumulation dtype
    (inf/-inf: max/min, 0: the nonzero count, else (sum a^ord)^(1/ord))."""
    if ord == math.inf:
        return jnp.max(a, axis=axes, keepdims=keepdim)
    if ord == -math.inf:
        return jnp.min(a, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum(lax.convert_element_type(a != 0, a.dtype), axis=axes, keepdims=keepdim)
    if ord == 1:
        return jnp.sum(a, axis=axes, keepdims=keepdim)
    if ord == 2:
        return lax.sqrt(jnp.sum(lax.mul(a, a), axis=axes, keepdims=keepdim))
    p = jnp.asarray(ord, a.dtype)
    return lax.pow(jnp.sum(lax.pow(a, p), axis=axes, keepdims=keepdim), lax.div(jnp.ones((), a.dtype), p))


def _extreme(x, axes, keepdim, largest):
    # XLA's max/min propagate NaN, as torch's amax/amin/max do.
    return (jnp.max if largest else jnp.min)(x, axis=axes, keepdims=keepdim)


@register_lowering(aten.amax.default)
def _amax(ctx, x, dim=(), keepdim=False):
    return _extreme(x, _axes(x, dim), keepdim, largest=True)


@register_lowering(aten.amin.default)
def _amin(ctx, x, dim=(), keepdim=False):
    return _extreme(x, _axes(x, dim), keepdim, largest=False)


@register_lowering(aten.max.default)
def _max_all(ctx, x):
    return _extreme(x, _axes(x, None), False, largest=True)


@register_lowering(aten.min.default)
def _min_all(ctx, x):
    return _extreme(x, _axes(x, None), False, largest=False)


@register_lowering(aten.any.default, aten.any.dim, aten.any.dims)
def _any(ctx, x, dim=None, keepdim=False):
    truthy = x if x.dtype == jnp.bool_ else lax.ne(x, jnp.zeros((), x.dtype))
    return jnp.any(truthy, axis=_axes(x, dim, empty_means_all=False), keepdims=keepdim)


def _arg_extreme(ctx, x, dim, largest):
    """Index of the first max/min along `dim` (NaN counts as the extreme, as in torch);
    dim None means over the flattened tensor. Reshaped to torch's output shape."""
    if dim is None or x.ndim == 0:
        x, axis = x.reshape(-1), 0
    else:
        axis = dim % x.ndim
    if x.dtype == jnp.bool_:
        x = lax.convert_element_type(x, jnp.uint8)
    idx = (lax.argmax if largest else lax.argmin)(x, axis, _INDEX)
    return idx.reshape(ctx.out_shape)


@register_lowering(aten.argmax.default)
def _argmax(ctx, x, dim=None, keepdim=False):
    return _arg_extreme(ctx, x, dim, largest=True)


@register_lowering(aten.argmin.default)
def _argmin(ctx, x, dim=None, keepdim=False):
    return _arg_extreme(ctx, x, dim, largest=False)


def _extreme_with_index(ctx, x, dim, keepdim, largest):
    values = _extreme(x, _axes(x, dim), keepdim, largest)
    return values, _arg_extreme(ctx, x, dim, largest).reshape(values.shape)


@register_lowering(aten.max.dim)
def _max_dim(ctx, x, dim, keepdim=False):
    return _extreme_with_index(ctx, x, dim, keepdim, largest=True)


@register_lowering(aten.min.dim)
def _min_dim(ctx, x, dim, keepdim=False):
    return _extreme_with_index(ctx, x, dim, keepdim, largest=False)


def _scan_axis(x, dim):
    return dim % x.ndim if x.ndim else None


@register_lowering(aten.cumsum.default)
def _cumsum(ctx, x, dim, dtype=None):
    xa = _accumulate(ctx, x)
    axis = _scan_axis(xa, dim)
    return xa if axis is None else lax.cumsum(xa, axis=axis)


@register_lowering(aten.cumprod.default)
def _cumprod(ctx, x, dim, dtype=None):
    xa = _accumulate(ctx, x)
    axis = _scan_axis(xa, dim)
    return xa if axis is None else lax.cumprod(xa, axis=axis)


def _log_add_exp_complex(a, b):
    """log(exp(a) + exp(b)) for complex a, b, as torch's kernel computes it: factored by the
    operand with the larger real part; an operand whose real part is -inf adds nothing."""
    a_big = lax.real(a) >= lax.real(b)
    hi, lo = jnp.where(a_big, a, b), jnp.where(a_big, b, a)
    summed = hi + jnp.log1p(jnp.exp(lo - hi))
    return jnp.where(jnp.isneginf(lax.real(lo)), hi, summed)


@register_lowering(aten.logcumsumexp.default)
def _logcumsumexp(ctx, x, dim):
    xa = _accumulate(ctx, x)
    axis = _scan_axis(xa, dim)
    if axis is None:
        return xa
    if jnp.iscomplexobj(xa):  # cumlogsumexp's max-based rescaling is for real inputs only
        return lax.associative_scan(_log_add_exp_complex, xa, axis=axis)
    return lax.cumlogsumexp(xa, axis=axis)


def _cum_extreme(x, dim, largest):
    """torch's cummax/cummin: running extreme and the index of its latest occurrence; a NaN
    is the extreme from where it appears (the latest NaN's index)."""
    axis = _scan_axis(x, dim)
    if axis is None:
        return x, jnp.zeros((), _INDEX)
    idx = lax.broadcasted_iota(_INDEX, x.shape, axis)

    def combine(left, right):
        (v1, i1), (v2, i2) = left, right
        better = (v2 >= v1) if largest else (v2 <= v1)
        if jnp.issubdtype(x.dtype, jnp.floating):
            better = (v2 != v2) | ((v1 == v1) & better)
        return jnp.where(better, v2, v1), jnp.where(better, i2, i1)

    return lax.associative_scan(combine, (x, idx), axis=axis)


@register_lowering(aten.cummax.default)
def _cummax(ctx, x, dim):
    return _cum_extreme(x, dim, largest=True)


@register_lowering(aten.cummin.default)
def _cummin(ctx, x, dim):
    return _cum_extreme(x, dim, largest=False)


def _stable_sort(x, axis, descending):
    """(values, int64 indices) of a stable sort along `axis`; NaN sorts as the largest value.

    Descending: a stable ascending sort of the reversed input, reversed back, keeps equal
    elements in their original order (torch's stable descending order).
    """
    iota = lax.broadcasted_iota(_INDEX, x.shape, axis)
    if descending:
        x = lax.rev(x, (axis,))
        iota = lax.rev(iota, (axis,))
    values, indices = lax.sort((x, iota), dimension=axis, is_stable=True, num_keys=1)
    if descending:
        values, indices = lax.rev(values, (axis,)), lax.rev(indices, (axis,))
    return values, indices


@register_lowering(aten.sort.default)
def _sort(ctx, x, dim=-1, descending=False):
    if x.ndim == 0:
        return x, jnp.zeros((), _INDEX)
    return _stable_sort(x, dim % x.ndim, descending)


@register_lowering(aten.sort.stable)
def _sort_stable(ctx, x, stable=None, dim=-1, descending=False):
    return _sort(ctx, x, dim, descending)  # the sort above is always stable


@register_lowering(aten.topk.default)
def _topk(ctx, x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (aten's name)
    # Always sorted (torch leaves the order unspecified when sorted=False); ties: lowest index.
    if x.ndim == 0:
        return x, jnp.zeros((), _INDEX)
    axis = dim % x.ndim
    values, indices = _stable_sort(x, axis, descending=largest)
    return lax.slice_in_dim(values, 0, k, axis=axis), lax.slice_in_dim(indices, 0, k, axis=axis)


@register_lowering(aten.histc.default)
def _histc(ctx, x, bins=100, min=0, max=0):
    """torch.histc on the CPU: `bins` equal bins over [min, max] (over the data's own range when
    min == max, widened by 1 each way if that is empty too); elements outside it and NaNs are not
    counted; an element's bin is trunc((x - min) * bins / (max - min)) in x's dtype, the last bin
    closed (torch's linear histogram, without its local search). Counts are exact integers below
    2^24 and come back in x's dtype."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise RejectedInput(f'"histogram_cpu" not implemented for \'{ctx.arg_meta(0).dtype}\'')
    if bins <= 0:
        raise RejectedInput(f"torch.histc(): bins must be > 0, but got {bins} for dimension 0")
    flat = x.reshape(-1)
    if min == max:
        if flat.size == 0:
            lo = hi = jnp.zeros((), x.dtype)
        else:
            lo, hi = jnp.min(flat), jnp.max(flat)
        ctx.check(~(jnp.isfinite(lo) & jnp.isfinite(hi)),
                  "histc: range of [min, max] of the input is not finite")
        same = lo == hi
        lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    else:
        if not (math.isfinite(min) and math.isfinite(max)):
            raise RejectedInput(f"torch.histc(): range of [{min}, {max}] is not finite")
        if not min < max:
            raise RejectedInput("torch.histc(): max must be larger than min")
        lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    counted = (flat >= lo) & (flat <= hi)
    pos = ((jnp.where(counted, flat, lo) - lo) * jnp.asarray(bins, x.dtype) / (hi - lo)).astype(jnp.int32)
    pos = jnp.clip(pos, 0, bins - 1)  # an element equal to max lands in the last bin
    counts = jnp.zeros((bins,), jnp.float32).at[pos].add(counted.astype(jnp.float32))
    return counts.astype(x.dtype)
