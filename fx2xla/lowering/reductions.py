"""Lowering rules: reductions, scans, sort and topk.

Like torch, bfloat16/float16 inputs accumulate in float32 (sum, mean, prod, var, cumsum) and
the registry rounds the result to torch's output dtype.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torch.ops import aten

from .checks import VALUE
from .elementwise import opmath
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
                  "histc: range of [min, max] of the input is not finite", error=VALUE)
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


def _linspace(lo, hi, steps: int, dtype):
    """torch's CPU linspace in `dtype` from (traced) ends: start + step * i for the first half,
    end - step * (steps - 1 - i) for the rest, so both ends are exact. Eager's compiler fuses
    each multiply-add into one rounding, which XLA has no op for: inner edges may differ from
    eager's by an ulp."""
    lo, hi = lo.astype(dtype), hi.astype(dtype)
    step = (hi - lo) / jnp.asarray(steps - 1, dtype)
    i = jnp.arange(steps)
    head = lo + step * i.astype(dtype)
    tail = hi - step * (steps - 1 - i).astype(dtype)
    return jnp.where(i < steps // 2, head, tail)


def _histogram_counts(x2, edges, weight, density, dtype):
    """Counts (or weights) of the points x2 (M, N) per cell of the N edge sequences: bin i of a
    dim holds [edges[i], edges[i+1]), its last bin also the right edge; points outside and NaNs
    are not counted. density divides by the total and by each cell's volume."""
    n_bins = [e.shape[0] - 1 for e in edges]
    counted = jnp.ones(x2.shape[:1], bool)
    cell = jnp.zeros(x2.shape[:1], jnp.int64)
    for d, (e, n) in enumerate(zip(edges, n_bins)):
        v = x2[:, d]
        counted = counted & (v >= e[0]) & (v <= e[-1])
        pos = jnp.clip(jnp.searchsorted(e, v, side="right") - 1, 0, n - 1)
        cell = cell * n + pos
    acc = jnp.float64 if dtype == jnp.float64 else jnp.float32
    w = jnp.ones(x2.shape[:1], acc) if weight is None else weight.reshape(-1).astype(acc)
    total = math.prod(n_bins)
    hist = jnp.zeros((total,), acc).at[cell].add(jnp.where(counted, w, jnp.zeros((), acc)))
    hist = hist.astype(dtype).reshape(n_bins)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            shape = [1] * len(edges)
            shape[d] = n_bins[d]
            hist = hist / (e[1:] - e[:-1]).reshape(shape)
    return hist


def _float_histogram_input(ctx, x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise RejectedInput(f'"histogram_cpu" not implemented for \'{ctx.arg_meta(0).dtype}\'')


def _points(x):
    """histogramdd's input (..., N) as M points of N coordinates."""
    return x.reshape(-1, x.shape[-1])


def _equal_bin_edges(ctx, x2, bins, range_, dtype):
    """Each dim's len(bins[d]) + 1 equally spaced edges over range_[2d:2d+2], or over the
    points' own [min, max] ([0, 1] without points), widened by 0.5 each way where the two are
    equal; a non-finite data range raises fx2xla.InvalidValueError, as eager raises."""
    n = x2.shape[1]
    for d, b in enumerate(bins):
        if b <= 0:
            raise RejectedInput(f"torch.histogram(): bins must be > 0, but got {b} for dimension {d}")
    if range_ is not None:
        vals = [float(v) for v in range_]
        if len(vals) != 2 * n:
            raise RejectedInput(f"torch.histogramdd: for a {n}-dimensional histogram range should have {2 * n} "
                                f"elements, but got {len(vals)}")
        for d in range(n):
            lo, hi = vals[2 * d], vals[2 * d + 1]
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise RejectedInput(f"torch.histogramdd: dimension {d}'s range [{lo}, {hi}] is not finite")
            if lo > hi:
                raise RejectedInput(f"torch.histogramdd: min should not exceed max, but got min {lo} max {hi} "
                                    f"for dimension {d}")
        lo, hi = jnp.asarray(vals[0::2], jnp.float64), jnp.asarray(vals[1::2], jnp.float64)
    elif x2.shape[0] == 0:
        lo, hi = jnp.zeros((n,), jnp.float64), jnp.ones((n,), jnp.float64)
    else:
        lo, hi = jnp.min(x2, axis=0).astype(jnp.float64), jnp.max(x2, axis=0).astype(jnp.float64)
        ctx.check(~jnp.all(jnp.isfinite(lo) & jnp.isfinite(hi)),
                  "the range [min(input), max(input)] of a dimension is not finite", error=VALUE)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
    return [_linspace(lo[d], hi[d], bins[d] + 1, dtype) for d in range(n)]


@register_lowering(aten.histogram.bin_ct)
def _histogram_bin_ct(ctx, x, bins=100, *, range=None, weight=None, density=False):  # noqa: A002 (aten's name)
    """torch.histogram(x, bins: int): `bins` equal bins over `range`, or over [min(x), max(x)]
    (widened by 0.5 each way where they are equal; [0, 1] for an empty x), edges as torch's
    linspace computes them in x's dtype."""
    _float_histogram_input(ctx, x)
    x2 = x.reshape(-1, 1)
    edges = _equal_bin_edges(ctx, x2, [bins], range, x.dtype)
    return _histogram_counts(x2, edges, weight, density, x.dtype), edges[0]


@register_lowering(aten.histogram.bins_tensor)
def _histogram_bins_tensor(ctx, x, bins, *, weight=None, density=False):
    """torch.histogram(x, bins: Tensor): the given edges (increasing, as eager requires)."""
    _float_histogram_input(ctx, x)
    return _histogram_counts(x.reshape(-1, 1), [bins], weight, density, x.dtype), bins


@register_lowering(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(ctx, x, bins, *, range=None, weight=None, density=False):  # noqa: A002
    _float_histogram_input(ctx, x)
    return _equal_bin_edges(ctx, _points(x), list(bins), range, x.dtype)


@register_lowering(aten._histogramdd_from_bin_cts.default)
def _histogramdd_from_bin_cts(ctx, x, bins, *, range=None, weight=None, density=False):  # noqa: A002
    """torch.histogramdd(x, bins: ints): the cell counts over _histogramdd_bin_edges' edges."""
    _float_histogram_input(ctx, x)
    x2 = _points(x)
    edges = _equal_bin_edges(ctx, x2, list(bins), range, x.dtype)
    return _histogram_counts(x2, edges, weight, density, x.dtype)


@register_lowering(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(ctx, x, bins, *, weight=None, density=False):
    _float_histogram_input(ctx, x)
    return _histogram_counts(_points(x), list(bins), weight, density, x.dtype)


def _hash_bits(x):
    """x's elements as uint64: floats widened to float64 and bool/integers to 64 bits (signed
    ones sign-extended), then the bits reinterpreted."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return lax.bitcast_convert_type(x.astype(jnp.float64), jnp.uint64)
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        return lax.bitcast_convert_type(x.astype(jnp.int64), jnp.uint64)
    return x.astype(jnp.uint64)


@register_lowering(aten.hash_tensor.default)
def _hash_tensor(ctx, x, dim=(), *, keepdim=False, mode=0):
    """torch.hash_tensor (mode 0): the xor of the elements' 64-bit patterns over `dim` (all
    dims by default), as uint64."""
    if mode != 0:
        raise RejectedInput(f"hash_tensor only supports mode=0 (xor reduction), got mode={mode}")
    if jnp.iscomplexobj(x):
        raise RejectedInput("hash_tensor does not support complex inputs")
    axes = _axes(x, list(dim))
    bits = _hash_bits(x)
    out = lax.reduce(bits, jnp.zeros((), jnp.uint64), lax.bitwise_xor, axes) if axes else bits
    return jnp.expand_dims(out, axes) if keepdim and axes else out


# torch.segment_reduce: reductions over consecutive runs ("segments") of data along `axis`, the
# runs given by their lengths or their offsets, one row of them per index of the dims before
# `axis`. Each element gets its segment's id (past the last run: none), and jax's segment ops
# reduce by id.

_SEGMENT_REDUCTIONS = ("sum", "mean", "max", "min", "prod")


def _segments(ctx, data, lengths, offsets, axis, unsafe):
    """(data as [B * N, rest], each element's flat segment id (B * S where it has none), B, S,
    the lengths [B, S]) for data [*lead, N, *rest] with B = prod(lead)."""
    axis = axis % data.ndim
    lead, n, rest = data.shape[:axis], data.shape[axis], data.shape[axis + 1:]
    b = math.prod(lead)
    if lengths is not None:
        lengths = lengths.reshape(b, -1).astype(jnp.int64)
        starts = jnp.concatenate([jnp.zeros((b, 1), jnp.int64), jnp.cumsum(lengths, axis=1)], axis=1)
        if not unsafe:
            ctx.check(jnp.any(lengths < 0), "lengths contains negative value!", error=VALUE)
            ctx.check(jnp.any(starts[:, -1] != n), "Expected all rows of lengths along axis to sum to "
                      f"data.size(lengths.dim()-1) ({n}) when !unsafe.", error=VALUE)
    else:
        starts = offsets.reshape(b, -1).astype(jnp.int64)
        lengths = starts[:, 1:] - starts[:, :-1]
    s = starts.shape[1] - 1
    j = jnp.arange(n, dtype=jnp.int64)
    # [B, N]: how many runs end at or before j (starts never decrease: lengths are >= 0)
    seg = jax.vmap(lambda st: jnp.searchsorted(st[1:], j, side="right"))(starts).astype(jnp.int64)
    valid = (j[None, :] >= starts[:, :1]) & (seg < s)
    ids = jnp.where(valid, jnp.arange(b, dtype=jnp.int64)[:, None] * s + seg, b * s).reshape(-1)
    return data.reshape((b * n,) + rest), ids, b, s, lengths, (lead, rest)


def _check_segment_args(data, reduce, lengths, offsets):
    if reduce not in _SEGMENT_REDUCTIONS:
        raise RejectedInput(f"segment_reduce: reduce must be one of {', '.join(_SEGMENT_REDUCTIONS)}, got {reduce!r}")
    if (lengths is None) == (offsets is None):
        raise RejectedInput("segment_reduce: exactly one of lengths and offsets must be given")
    if not jnp.issubdtype(data.dtype, jnp.floating):
        raise RejectedInput(f'"_segment_reduce_cpu" not implemented for \'{data.dtype}\'')


@register_lowering(aten.segment_reduce.default)
def _segment_reduce(ctx, data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                    initial=None):
    """torch.segment_reduce (sum, mean, max, min, prod): an empty segment gives `initial`, or
    else 0 / NaN / -inf / inf / 1; mean with `initial` is (initial + sum) / length."""
    _check_segment_args(data, reduce, lengths, offsets)
    flat, ids, b, s, lengths, (lead, rest) = _segments(ctx, opmath(data), lengths, offsets, axis, unsafe)
    k = b * s
    if reduce in ("sum", "mean"):
        out = jax.ops.segment_sum(flat, ids, num_segments=k)
    elif reduce == "prod":
        out = jax.ops.segment_prod(flat, ids, num_segments=k)
    else:
        out = (jax.ops.segment_max if reduce == "max" else jax.ops.segment_min)(flat, ids, num_segments=k)
    init = None if initial is None else jnp.asarray(initial, flat.dtype)
    if reduce == "mean":
        count = lengths.reshape((k,) + (1,) * len(rest)).astype(flat.dtype)
        out = out / count if init is None else jnp.where(count == 0, init, (out + init) / count)
    elif init is not None:
        out = {"sum": jnp.add, "prod": jnp.multiply, "max": jnp.maximum, "min": jnp.minimum}[reduce](out, init)
    return out.reshape(lead + (s,) + rest).astype(data.dtype)


@register_lowering(aten._segment_reduce_backward.default)
def _segment_reduce_backward(ctx, grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    """The gradient of segment_reduce for data, as eager's: each element gets its segment's
    gradient (mean: divided by the length); max/min: split equally among the elements equal to
    the result (none where `initial` won); prod: the product of the others (with `initial`), 0
    in a segment with two zeros or more."""
    _check_segment_args(data, reduce, lengths, offsets)
    flat, ids, b, s, lengths, (lead, rest) = _segments(ctx, opmath(data), lengths, offsets, axis, True)
    k = b * s

    def per_element(v, none, inner):
        """Per-segment values (k of shape `inner`) at each element's segment, `none` where it
        has none."""
        v = v.reshape((k,) + inner).astype(flat.dtype)
        return jnp.concatenate([v, jnp.full((1,) + inner, none, flat.dtype)])[ids]

    ge, oe = per_element(opmath(grad), 0, rest), per_element(opmath(output), 0, rest)
    if reduce == "sum":
        dx = ge
    elif reduce == "mean":
        dx = ge / per_element(lengths, 1, (1,) * len(rest))
    elif reduce in ("max", "min"):
        hit = flat == oe
        ties = jax.ops.segment_sum(hit.astype(flat.dtype), ids, num_segments=k + 1)[ids]
        dx = jnp.where(hit, ge / jnp.where(ties == 0, 1, ties), 0)
    else:  # prod
        zero = flat == 0
        zeros = jax.ops.segment_sum(zero.astype(flat.dtype), ids, num_segments=k + 1)[ids]
        others = jax.ops.segment_prod(jnp.where(zero, 1, flat), ids, num_segments=k + 1)[ids]
        if initial is not None:
            others = others * jnp.asarray(initial, flat.dtype)
        safe = jnp.where(zero, 1, flat)
        dx = jnp.where(zeros == 0, ge * oe / safe, jnp.where((zeros == 1) & zero, ge * others, 0))
    return dx.reshape(data.shape).astype(data.dtype)
