"""Lowering rules: order statistics and binary search (median, nanmedian, kthvalue, mode,
searchsorted, bucketize).

Values follow torch exactly; so do indices wherever eager's CPU kernel determines them:

- median / nanmedian along a dim: eager partitions with an (value, index) order, so among
  equal values the index is the one a stable sort puts at the median's position; it is that
  sort here (NaN sorts last, -0.0 equals 0.0, as in eager's comparisons). median returns the
  first NaN of a row that has one. A row of nanmedian that is all NaN has no order at all, and
  eager's answer is where libstdc++'s nth_element leaves position 0 when every comparison is
  false: a function of the row's length alone, replayed here in Python when tracing.
- The lower median of an even count: position (n - 1) // 2 of the sorted row (of its non-NaN
  values for nanmedian, position 0 when there are none, as C++'s truncating division gives).
- kthvalue: eager's quickselect is not stable, so among equal values its index is
  unspecified (torch documents none); here it is the stable sort's (NaN last, as in sort).
- mode: eager sorts each row with std::sort on the values alone and takes the first longest
  run of `!=`-separated values (the smallest most frequent value), returning the index of the
  run's last element. For rows of up to 16 elements std::sort is libstdc++'s insertion sort,
  replayed here step by step, so indices match exactly, NaN included (a NaN equals nothing and
  stops the insertion scan, which can split runs). Longer rows use introsort, whose order of
  equal values is unspecified: they use a stable sort (NaN last), giving the last index of the
  mode and the same value whenever the row has no NaN.
- searchsorted / bucketize: eager's own binary search (`!(mid >= v)` moves right; `>` for
  right=True) is replayed for a fixed ceil(log2(n + 1)) steps, so results match even for NaN
  values (they land at the end) or NaNs and unsorted entries in the sequence, where a binary
  search's answer depends on the positions it probes. Both operands are compared in their
  torch.result_type, as eager does.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torch.ops import aten

from .dtypes import to_jax_dtype
from .registry import RejectedInput, register_lowering

_INDEX = np.dtype(jnp.int64)
# libstdc++'s std::sort finishes rows of up to this many elements with an insertion sort alone.
_INSERTION_SORT_MAX = 16


def _isnan(x):
    return jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(x.shape, jnp.bool_)


def _stable_sort_last(x):
    """(values, int64 indices) of a stable ascending sort along the last axis; NaN last,
    -0.0 equal to 0.0 (jax's sort comparator)."""
    iota = lax.broadcasted_iota(_INDEX, x.shape, x.ndim - 1)
    return lax.sort((x, iota), dimension=x.ndim - 1, is_stable=True, num_keys=1)


def _take_last(x, pos):
    """x[..., pos] for `pos` of x's shape without its last axis."""
    return jnp.take_along_axis(x, pos[..., None], axis=-1, mode="clip")[..., 0]


def _reduced_dim(ctx, x, dim, name: str):
    """x with the reduced `dim` moved last (a 0-d x as one element), and a function giving a
    row result torch's shape (keepdim restores the axis)."""
    if x.ndim == 0:
        if dim not in (0, -1):
            raise RejectedInput(f"Dimension out of range (expected to be in range of [-1, 0], but got {dim})")
        return x.reshape(1), lambda r: r.reshape(())
    axis = dim % x.ndim
    if x.shape[axis] == 0:
        raise RejectedInput(f"{name}(): Expected reduction dim {axis} to have non-zero size.")
    return jnp.moveaxis(x, axis, -1), lambda r: r.reshape(ctx.out_shape)


def _allnan_index(n: int) -> int:
    """The index eager's nanmedian returns for a row of n NaNs: position 0 after libstdc++'s
    std::nth_element(first, first, last, comp) when comp is always false (introselect: the
    median-of-three moves the middle element first, each partition swaps the outer pairs;
    the final insertion sort and the depth-limit heap select move nothing then)."""
    idx, first, last = list(range(n)), 0, n
    depth = 2 * (n.bit_length() - 1)
    while last - first > 3 and depth > 0:
        depth -= 1
        mid = first + (last - first) // 2
        idx[first], idx[mid] = idx[mid], idx[first]
        lo, hi = first + 1, last
        while True:
            hi -= 1
            if not lo < hi:
                break
            idx[lo], idx[hi] = idx[hi], idx[lo]
            lo += 1
        last = lo  # the cut lies past position 0: the search continues left of it
    return idx[0]


def _median_rows(x, ignore_nan: bool):
    """(value, index) of the lower median along the last axis of a non-empty x."""
    n = x.shape[-1]
    values, indices = _stable_sort_last(x)
    nan = _isnan(x)
    if ignore_nan:
        count = jnp.sum(~nan, axis=-1, dtype=_INDEX)
        pos = jnp.maximum(count - 1, 0) // 2
        value, index = _take_last(values, pos), _take_last(indices, pos)
        return value, jnp.where(count == 0, jnp.asarray(_allnan_index(n), _INDEX), index)
    pos = (n - 1) // 2
    value, index = values[..., pos], indices[..., pos]
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return value, index
    has_nan = jnp.any(nan, axis=-1)
    first_nan = lax.argmax(nan, nan.ndim - 1, _INDEX)
    return (jnp.where(has_nan, _take_last(x, first_nan), value), jnp.where(has_nan, first_nan, index))


def _check_not_bool(ctx, kernel: str):
    dtype = ctx.arg_meta(0).dtype
    if dtype == torch.bool or dtype.is_complex:
        raise RejectedInput(f"\"{kernel}\" not implemented for '{_torch_type_name(dtype)}'")


def _torch_type_name(dtype: torch.dtype) -> str:
    return {torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}.get(dtype, str(dtype))


def _median_all(ctx, x, ignore_nan: bool):
    _check_not_bool(ctx, "median_cpu" if not ignore_nan else "nanmedian_cpu")
    if x.size == 0:
        # eager: NaN, converted to the dtype as x86 converts it (int32/int64: their minimum)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.asarray(jnp.nan, x.dtype)
        wide = x.dtype in (np.dtype(jnp.int32), np.dtype(jnp.int64))
        return jnp.asarray(jnp.iinfo(x.dtype).min if wide else 0, x.dtype)
    value, _ = _median_rows(x.reshape(-1), ignore_nan)
    if not ignore_nan and jnp.issubdtype(x.dtype, jnp.floating):
        # eager returns a quiet NaN of its own (not the input's NaN payload or sign)
        value = jnp.where(jnp.any(jnp.isnan(x)), jnp.asarray(jnp.nan, x.dtype), value)
    return value


@register_lowering(aten.median.default)
def _median(ctx, x):
    return _median_all(ctx, x, ignore_nan=False)


@register_lowering(aten.nanmedian.default)
def _nanmedian(ctx, x):
    return _median_all(ctx, x, ignore_nan=True)


def _median_dim(ctx, x, dim, keepdim, ignore_nan):
    _check_not_bool(ctx, "median_out")
    rows, shape = _reduced_dim(ctx, x, dim, "median")
    value, index = _median_rows(rows, ignore_nan)
    return shape(value), shape(index)


@register_lowering(aten.median.dim)
def _median_dim_rule(ctx, x, dim, keepdim=False):
    return _median_dim(ctx, x, dim, keepdim, ignore_nan=False)


@register_lowering(aten.nanmedian.dim)
def _nanmedian_dim_rule(ctx, x, dim, keepdim=False):
    return _median_dim(ctx, x, dim, keepdim, ignore_nan=True)


@register_lowering(aten.kthvalue.default)
def _kthvalue(ctx, x, k, dim=-1, keepdim=False):
    _check_not_bool(ctx, "kthvalue_cpu")
    rows, shape = _reduced_dim(ctx, x, dim, "kthvalue")
    if not 0 < k <= rows.shape[-1]:
        raise RejectedInput(f"kthvalue(): selected number k out of range for dimension {dim % max(x.ndim, 1)}")
    values, indices = _stable_sort_last(rows)
    return shape(values[..., k - 1]), shape(indices[..., k - 1])


def _insertion_sort_last(x):
    """libstdc++'s __insertion_sort along the last axis with `<` as the order, replayed step
    by step: (values, int64 indices). With NaNs `<` is no strict weak order, and where they
    end up is what this replays: a NaN never moves, and an element moves left only past
    elements it is less than (or straight to the front when it is less than the first)."""
    n = x.shape[-1]
    idx = lax.broadcasted_iota(_INDEX, x.shape, x.ndim - 1)
    pos_iota = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    for i in range(1, n):
        val, vid = x[..., i:i + 1], idx[..., i:i + 1]
        to_front = val[..., 0] < x[..., 0]
        # the scan back from i-1 stops after the last element val is not less than
        stop = jnp.where((pos_iota < i) & ~(val < x), pos_iota, -1)
        p = jnp.where(to_front, 0, jnp.max(stop, axis=-1) + 1)[..., None]
        shifted_x = jnp.concatenate([x[..., :1], x[..., :-1]], axis=-1)
        shifted_i = jnp.concatenate([idx[..., :1], idx[..., :-1]], axis=-1)
        moved = (pos_iota > p) & (pos_iota <= i)
        x = jnp.where(pos_iota == p, val, jnp.where(moved, shifted_x, x))
        idx = jnp.where(pos_iota == p, vid, jnp.where(moved, shifted_i, idx))
    return x, idx


@register_lowering(aten.mode.default)
def _mode(ctx, x, dim=-1, keepdim=False):
    if jnp.iscomplexobj(x):
        raise RejectedInput(f"\"mode_cpu\" not implemented for '{_torch_type_name(ctx.arg_meta(0).dtype)}'")
    if x.ndim == 0:
        if dim not in (0, -1):
            raise RejectedInput(f"Dimension out of range (expected to be in range of [-1, 0], but got {dim})")
        return x, jnp.zeros((), _INDEX)
    axis = dim % x.ndim
    n = x.shape[axis]
    if n == 0:
        raise RejectedInput(f"mode(): Expected reduction dim {axis} to have non-zero size.")
    rows = jnp.moveaxis(x, axis, -1)
    if rows.dtype == jnp.bool_:
        rows = lax.convert_element_type(rows, jnp.uint8)
    values, indices = _insertion_sort_last(rows) if n <= _INSERTION_SORT_MAX else _stable_sort_last(rows)
    # a run ends where the next value differs (`!=`: a NaN is a run of its own)
    ends = jnp.concatenate([values[..., 1:] != values[..., :-1], jnp.ones(values.shape[:-1] + (1,), jnp.bool_)], -1)
    pos = lax.broadcasted_iota(jnp.int32, values.shape, values.ndim - 1)
    starts = jnp.concatenate([jnp.ones(values.shape[:-1] + (1,), jnp.bool_), ends[..., :-1]], -1)
    run_start = lax.cummax(jnp.where(starts, pos, 0), axis=values.ndim - 1)
    freq = jnp.where(ends, pos - run_start + 1, 0)
    best = lax.argmax(freq, freq.ndim - 1, jnp.int32)  # the first longest run
    value, index = _take_last(values, best), _take_last(indices, best)
    return value.reshape(ctx.out_shape).astype(x.dtype), index.reshape(ctx.out_shape)


# -- searchsorted / bucketize -------------------------------------------------------------------

def _search(ctx, seq, values, seq_meta, value_meta, right: bool, sorter=None):
    """Eager's binary search of each element of `values` in the last axis of `seq` (1-D, or
    with `values`' leading dims): the count of leading elements `!(s >= v)` (`!(s > v)` for
    right), probing the same positions eager does."""
    dtype = torch.result_type(seq_meta, value_meta)
    if dtype == torch.bool or dtype.is_complex:
        raise RejectedInput(f"\"searchsorted_out_cpu\" not implemented for '{_torch_type_name(dtype)}'")
    jdtype = to_jax_dtype(dtype)
    seq = lax.convert_element_type(seq, jdtype)
    values = lax.convert_element_type(jnp.asarray(values), jdtype)
    m = seq.shape[-1] if seq.ndim else 0
    start = jnp.zeros(values.shape, _INDEX)
    if m == 0:
        return start
    end = jnp.full(values.shape, m, _INDEX)
    batched = seq.ndim > 1
    for _ in range(m.bit_length()):
        active = start < end
        mid = start + ((end - start) >> 1)
        probe = jnp.minimum(mid, m - 1)
        if sorter is not None:
            probe = (jnp.take_along_axis(sorter, probe, axis=-1, mode="clip") if batched
                     else jnp.take(sorter, probe, mode="clip"))
        mid_val = jnp.take_along_axis(seq, probe, axis=-1, mode="clip") if batched else jnp.take(seq, probe, mode="clip")
        go_right = ~(mid_val > values) if right else ~(mid_val >= values)
        start = jnp.where(active & go_right, mid + 1, start)
        end = jnp.where(active & ~go_right, mid, end)
    return start


def _searchsorted_checks(ctx, seq_meta, value_meta, right, side, sorter, sorter_meta):
    if side is not None and side not in ("left", "right"):
        raise RejectedInput(f"torch.searchsorted(): side can only be 'left' or 'right' but got {side}")
    if side is not None and right and side == "left":
        raise RejectedInput("torch.searchsorted(): side and right can't be set to opposites, got side of left "
                            "while right was True")
    if seq_meta.dim() == 0:
        raise RejectedInput("torch.searchsorted(): boundaries tensor should have positive dimension, but got 0 "
                            "dimension")
    if sorter_meta is not None:
        if sorter_meta.dtype != torch.int64:
            raise RejectedInput(f"torch.searchsorted(): sorter must be a tensor of long dtype but got dtype "
                                f"{sorter_meta.dtype}")
        if tuple(sorter_meta.shape) != tuple(seq_meta.shape):
            raise RejectedInput(f"torch.searchsorted(): boundary and sorter must have the same size, but got "
                                f"boundary tensor {list(seq_meta.shape)}and got sorter tensor {list(sorter_meta.shape)}")
        if sorter.size:
            ctx.check(jnp.any((sorter < 0) | (sorter >= seq_meta.shape[-1])),
                      "torch.searchsorted(): sorter index out of range")
    if seq_meta.dim() > 1:
        vshape = tuple(value_meta.shape) if isinstance(value_meta, torch.Tensor) else ()
        if len(vshape) != seq_meta.dim() or vshape[:-1] != tuple(seq_meta.shape[:-1]):
            raise RejectedInput(f"torch.searchsorted(): boundaries tensor should be 1 dimension or the first N-1 "
                                f"dimensions of boundaries tensor and input value tensor must match, but we got "
                                f"boundaries tensor {list(seq_meta.shape)} and input value tensor {list(vshape)}")


def _kwarg_meta(ctx, name):
    a = ctx.node.kwargs.get(name)
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


@register_lowering(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def _searchsorted(ctx, seq, values, out_int32=False, right=False, side=None, sorter=None):
    seq_meta, value_meta = ctx.arg_meta(0), ctx.arg_meta(1)
    sorter_meta = _kwarg_meta(ctx, "sorter")
    _searchsorted_checks(ctx, seq_meta, value_meta, right, side, sorter, sorter_meta)
    right = bool(right) or side == "right"
    return _search(ctx, seq, values, seq_meta, value_meta, right, sorter).reshape(ctx.out_shape)


@register_lowering(aten.bucketize.Tensor, aten.bucketize.Scalar)
def _bucketize(ctx, values, boundaries, out_int32=False, right=False):
    value_meta, seq_meta = ctx.arg_meta(0), ctx.arg_meta(1)
    if seq_meta.dim() != 1:
        raise RejectedInput(f"boundaries tensor must be 1 dimension, but got dim({seq_meta.dim()})")
    return _search(ctx, boundaries, values, seq_meta, value_meta, bool(right)).reshape(ctx.out_shape)
