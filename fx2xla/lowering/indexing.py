"""Lowering rules: indexing — advanced indexing, gathers, scatters, embeddings.

Negative indices wrap like torch's (jnp's indexing normalises them). Out-of-range indices,
which torch rejects at run time and XLA would clamp (gathers) or drop (scatters), are checked
at run time (`ctx.check_index`, see checks.py) by every op eager checks; `_unsafe_index*`,
which torch's own decompositions emit with indices known to be in range, are not.
Boolean-mask indexing that selects elements has a data-dependent shape and is rejected;
`nonzero` is not registered for the same reason (`nonzero_static`, whose size is given, is).
"""
from __future__ import annotations


import jax.numpy as jnp
import torch
from jax import lax
from torch.ops import aten

from .dtypes import dtype_name
from .reductions import p_norm
from .registry import RejectedInput, is_array, register_lowering
from .shape import canonical_dim


def _is_mask(index) -> bool:
    return index is not None and index.dtype in (jnp.bool_, jnp.uint8)


def _mask_error(op: str) -> NotImplementedError:
    return NotImplementedError(
        f"{op} with a boolean mask selects a data-dependent number of elements, which XLA's "
        "static shapes cannot express; use torch.where(mask, x, other) instead, or run the "
        "indexing eagerly (torch.compiler.disable)"
    )


def _index_tuple(indices) -> tuple:
    """torch's `indices` list (None = whole dim) as a numpy-style index: numpy places the
    broadcast advanced dims exactly where torch does (in place if adjacent, else first)."""
    return tuple(slice(None) if i is None else i for i in indices)


_UNCHECKED = {aten._unsafe_index.Tensor, aten._unsafe_index.Tensor_hacked_twin,
              aten._unsafe_index_put.default, aten._unsafe_index_put.hacked_twin}


# Ops that decompose to index_put but, unlike x[i] = v, reject negative indices in eager.
_NONNEGATIVE_ORIGINS = {"index_add", "index_add_", "index_copy", "index_copy_"}


def _check_indices(ctx, x, indices) -> None:
    """torch's advanced indexing: index k addresses dim k and may be negative down to -size."""
    if ctx.node.target in _UNCHECKED:
        return
    origin = ctx.node.meta.get("original_aten")
    negative = getattr(origin, "__name__", "").split(".")[0] not in _NONNEGATIVE_ORIGINS
    for d, index in enumerate(indices):
        if index is not None:
            ctx.check_index(index, x.shape[d], negative=negative, dim=d)


@register_lowering(
    aten.index.Tensor, aten.index.Tensor_hacked_twin,
    aten._unsafe_index.Tensor, aten._unsafe_index.Tensor_hacked_twin,
)
def _index(ctx, x, indices):
    if any(_is_mask(i) for i in indices):
        raise _mask_error("indexing")
    _check_indices(ctx, x, indices)
    return x[_index_tuple(indices)]


@register_lowering(
    aten.index_put.default, aten.index_put.hacked_twin,
    aten._unsafe_index_put.default, aten._unsafe_index_put.hacked_twin,
)
def _index_put(ctx, x, indices, values, accumulate=False):
    values = values.astype(x.dtype)
    if any(_is_mask(i) for i in indices):
        return _masked_put(x, indices, values, accumulate)
    _check_indices(ctx, x, indices)
    return _write(x.at[_index_tuple(indices)], values, accumulate)


def _write(ref, values, accumulate: bool):
    """`ref` (jax's `x.at[...]`) set to `values` (duplicate indices: an unspecified winner, as
    in torch), or with accumulate added to it (or-ed for bool)."""
    if not accumulate:
        return ref.set(values)
    return ref.max(values) if values.dtype == jnp.bool_ else ref.add(values)


def _masked_put(x, indices, values, accumulate):
    """`x[..., mask, ...] = values` for values that do not depend on how many elements the
    mask selects (broadcast to every selected element): a select, no scatter."""
    positions = [p for p, i in enumerate(indices) if i is not None]
    if len(positions) != 1:
        raise _mask_error("index_put mixing a mask with other indices")
    p = positions[0]
    mask = indices[p].astype(jnp.bool_)
    tail = x.shape[p + mask.ndim:]
    vshape = values.shape
    if len(vshape) > len(tail):
        # The selected-elements dim of values must be 1: swap it for the mask's dims.
        n_dim = len(vshape) - len(tail) - 1
        if vshape[n_dim] != 1:
            raise _mask_error("index_put with one value per selected element")
        vshape = vshape[:n_dim] + (1,) * mask.ndim + vshape[n_dim + 1:]
    values = jnp.broadcast_to(lax.reshape(values, vshape), x.shape)
    mask = jnp.broadcast_to(lax.reshape(mask, (1,) * p + mask.shape + (1,) * len(tail)), x.shape)
    if not accumulate:
        return lax.select(mask, values, x)
    if x.dtype == jnp.bool_:
        return x | (mask & values)
    return x + lax.select(mask, values, jnp.zeros_like(x))


@register_lowering(aten.index_select.default)
def _index_select(ctx, x, dim, index):
    dim = canonical_dim(dim, x.ndim)
    ctx.check_index(index, x.shape[dim] if x.ndim else 1, negative=False, dim=dim)
    if x.ndim == 0:  # the only valid index is 0: the value, in the index's shape
        return jnp.reshape(jnp.broadcast_to(x, (index.size,)), ctx.out_shape)
    return x[(slice(None),) * dim + (jnp.reshape(index, (-1,)),)]


def _coordinates(index, dim: int) -> tuple:
    """Full coordinates for torch's gather/scatter: `index` along `dim`, the element's own
    position along every other dim."""
    return tuple(
        index if d == dim else lax.broadcasted_iota(index.dtype, index.shape, d)
        for d in range(index.ndim)
    )


def _leading_block(src, shape):
    """src[:shape[0], :shape[1], ...]: torch reads only the index-shaped corner of src."""
    return src if src.shape == tuple(shape) else lax.slice(src, (0,) * src.ndim, tuple(shape))


def _nonempty(a):
    """torch's gather and scatter read a 0-d tensor (input, index or source) as a 1-d one of
    one element (ATen's ensure_nonempty_dim)."""
    return lax.reshape(a, (1,)) if a.ndim == 0 else a


@register_lowering(aten.gather.default)
def _gather(ctx, x, dim, index, sparse_grad=False):
    _check_dim_index(ctx, x, dim, index)
    if index.size == 0:  # eager takes an empty index of any rank
        return jnp.zeros(ctx.out_shape, x.dtype)
    x1, index1 = _nonempty(x), _nonempty(index)
    return jnp.reshape(x1[_coordinates(index1, canonical_dim(dim, x1.ndim))], ctx.out_shape)


def _check_dim_index(ctx, x, dim, index) -> None:
    """gather/scatter: every index addresses `dim` of `x`, from 0 (no negative indices)."""
    dim = canonical_dim(dim, x.ndim)
    ctx.check_index(index, x.shape[dim] if x.ndim else 1, negative=False, dim=dim)


def _scatter(x, dim, index, update):
    """`update(target, index)` on x's elements `index` addresses along `dim` (0-d operands read
    as 1-d: `_nonempty`), where target is jax's `.at[...]` of them: x's new value."""
    if index.size == 0:  # eager takes an empty index of any rank: nothing to write
        return x
    x1, index1 = _nonempty(x), _nonempty(index)
    out = update(x1.at[_coordinates(index1, canonical_dim(dim, x1.ndim))], index1)
    return jnp.reshape(out, x.shape)


def _source(src, index1, dtype):
    """The elements of `src` a scatter reads: the index-shaped corner, in x's dtype."""
    return _leading_block(_nonempty(src), index1.shape).astype(dtype)


@register_lowering(aten.scatter.src)
def _scatter_src(ctx, x, dim, index, src):
    _check_dim_index(ctx, x, dim, index)
    return _scatter(x, dim, index, lambda t, i: t.set(_source(src, i, x.dtype)))


@register_lowering(aten.scatter.value)
def _scatter_value(ctx, x, dim, index, value):
    _check_dim_index(ctx, x, dim, index)
    return _scatter(x, dim, index, lambda t, i: t.set(jnp.asarray(value, x.dtype)))


@register_lowering(aten.scatter.reduce, aten.scatter.value_reduce)
def _scatter_reduce_legacy(ctx, x, dim, index, src, reduce):
    """`scatter(..., reduce="add" | "multiply")` (the older API, with a tensor or a scalar
    source): every addressed element adds or multiplies in its sources, as scatter_reduce with
    include_self."""
    if reduce not in ("add", "multiply"):
        raise RejectedInput(f"reduce argument must be either add or multiply. Got {reduce!r}")
    if not is_array(src):
        src = jnp.full(index.shape, src, x.dtype)
    return _scatter_reduce(ctx, x, dim, index, src, "sum" if reduce == "add" else "prod")


@register_lowering(aten.scatter_add.default)
def _scatter_add(ctx, x, dim, index, src):
    return _scatter_reduce(ctx, x, dim, index, src, "sum")


def _reduction_identity(reduce: str, dtype):
    """The value torch writes into scatter targets before reducing when include_self=False."""
    if reduce in ("sum", "mean"):
        value = 0
    elif reduce == "prod":
        value = 1
    elif dtype == jnp.bool_:
        value = reduce == "amin"
    elif jnp.issubdtype(dtype, jnp.floating):
        value = -jnp.inf if reduce == "amax" else jnp.inf
    else:
        value = jnp.iinfo(dtype).min if reduce == "amax" else jnp.iinfo(dtype).max
    return jnp.asarray(value, dtype)


@register_lowering(aten.scatter_reduce.two)
def _scatter_reduce(ctx, x, dim, index, src, reduce, include_self=True):
    if reduce not in ("sum", "prod", "mean", "amax", "amin"):
        raise ValueError(f"unknown scatter_reduce reduction {reduce!r}")
    _check_dim_index(ctx, x, dim, index)
    if not include_self:
        # torch first overwrites every target with the reduction's identity.
        x = _scatter(x, dim, index, lambda t, i: t.set(_reduction_identity(reduce, x.dtype)))

    def combine(target, index1):
        source = _source(src, index1, x.dtype)
        if reduce in ("sum", "mean"):
            return target.max(source) if x.dtype == jnp.bool_ else target.add(source)
        if reduce == "prod":
            return target.min(source) if x.dtype == jnp.bool_ else target.multiply(source)
        return target.max(source) if reduce == "amax" else target.min(source)

    out = _scatter(x, dim, index, combine)
    if reduce != "mean":
        return out
    count = _scatter(jnp.full(x.shape, 1 if include_self else 0, x.dtype), dim, index,
                     lambda t, i: t.add(jnp.ones(i.shape, x.dtype)))
    count = jnp.where(count == 0, jnp.ones_like(count), count)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return out / count
    return jnp.floor_divide(out, count)  # torch divides integer means with rounding mode floor


_INDEX_REDUCTIONS = ("prod", "mean", "amax", "amin")


@register_lowering(aten.index_reduce.default)
def _index_reduce(ctx, x, dim, index, source, reduce, *, include_self=True):
    """Tensor.index_reduce: source's slice k along `dim` reduced into x's slice index[k] (prod,
    mean, amax, amin; integer means rounded down, as eager's): scatter_reduce with the index
    broadcast over the slices. Indices lie in [0, size), as eager checks."""
    if reduce not in _INDEX_REDUCTIONS:
        raise RejectedInput(f"index_reduce(): Expected reduce to be one of prod, mean, amax or amin but got {reduce}.")
    if x.ndim == 0:
        return _scatter_reduce(ctx, x, 0, index.reshape(()) if index.size == 1 else index, source,
                               reduce, include_self)
    axis = canonical_dim(dim, x.ndim)
    shape = [1] * source.ndim
    shape[axis] = index.shape[0] if index.ndim else 1
    full = jnp.broadcast_to(index.reshape(shape), source.shape)
    return _scatter_reduce(ctx, x, axis, full, source, reduce, include_self)


@register_lowering(aten.put.default)
def _put(ctx, x, index, source, accumulate=False):
    """Tensor.put: x read as 1-d, its elements `index` (negative ones count from the end) set to
    source's elements in order, or with accumulate added to them (repeated indices add up;
    without it which repeated write wins is unspecified, in eager too)."""
    ctx.check_index(index, x.size, negative=True)
    if index.size == 0:
        return x
    flat, idx = x.reshape(-1), index.reshape(-1)
    idx = jnp.where(idx < 0, idx + x.size, idx)
    values = source.reshape(-1)[: idx.size].astype(x.dtype)
    return _write(flat.at[idx], values, accumulate).reshape(x.shape)


@register_lowering(aten.nonzero_static.default)
def _nonzero_static(ctx, x, *, size, fill_value=-1):
    """The coordinates (size, x.ndim) of x's first `size` nonzero elements in row-major order,
    rows past the last one filled with `fill_value`: nonzero with a static number of rows."""
    if size < 0:
        raise RejectedInput(f"nonzero_static: 'size' must be an non-negative integer, but got size {size}")
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    if x.size == 0:  # (jnp.nonzero fills an empty input's rows with 0, not fill_value)
        return jnp.full((size, x.ndim), fill_value, jnp.int64)
    coords = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(coords, axis=1).astype(jnp.int64)


@register_lowering(aten.embedding.default)
def _embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    ctx.check_index(indices, weight.shape[0], negative=False, what="embedding index")
    return weight[indices]


@register_lowering(aten.embedding_renorm.default)
def _embedding_renorm(ctx, weight, indices, max_norm, norm_type):
    """nn.Embedding(max_norm=...)'s renormalization (functional `embedding_renorm_`): each row
    `indices` names whose `norm_type`-norm exceeds max_norm is scaled by max_norm / (norm +
    1e-7), as eager's CPU kernel: the norm in the weight's dtype, the scale in double, rounded
    to the weight's dtype for the product. Indices as eager's row selection takes them
    (negative ones count from the end); out of range raises."""
    rows = weight.shape[0]
    ctx.check_index(indices, rows, negative=True, what="embedding index")
    flat = jnp.reshape(indices, (-1,)).astype(jnp.int64)
    flat = jnp.where(flat < 0, flat + rows, flat)
    named = jnp.zeros((rows,), bool).at[flat].set(True, mode="drop")
    x = weight.astype(jnp.float32) if jnp.dtype(weight.dtype).itemsize < 4 else weight
    norm = p_norm(jnp.abs(x), norm_type, (1,)).astype(weight.dtype).astype(jnp.float64)
    scale = (max_norm / (norm + 1e-7)).astype(weight.dtype)
    shrink = named & (norm > max_norm)
    return jnp.where(shrink[:, None], weight * scale[:, None], weight)


@register_lowering(aten.embedding_dense_backward.default)
def _embedding_dense_backward(ctx, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    """Row sums of `grad` per index (as torch's decomposition: accumulated in float32 for
    16-bit floats; rows of padding_idx get no gradient; optional 1/frequency scaling)."""
    dtype = ctx.out_dtype
    acc = jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype
    grad = grad.astype(acc)
    flat = jnp.reshape(indices, (-1,))
    rows = jnp.reshape(grad, (flat.shape[0],) + grad.shape[indices.ndim:])
    if scale_grad_by_freq:
        counts = jnp.zeros((int(num_weights),), acc).at[flat].add(jnp.ones(flat.shape, acc))
        rows = rows / jnp.expand_dims(counts[flat], tuple(range(1, rows.ndim)))
    keep = jnp.expand_dims(flat != padding_idx, tuple(range(1, rows.ndim)))
    rows = jnp.where(keep, rows, jnp.zeros((), acc))
    out = jnp.zeros((int(num_weights),) + rows.shape[1:], acc).at[flat].add(rows)
    return out.astype(dtype)


@register_lowering(aten.masked_scatter.default)
def _masked_scatter(ctx, x, mask, source):
    """Selected positions take source's elements in order: the k-th True (row-major) reads
    source.flatten()[k], found with a running count of the mask."""
    if ctx.arg_meta(1).dtype != torch.bool:
        raise RejectedInput(f"masked_scatter_ only supports boolean masks, but got mask with dtype "
                            f"{dtype_name(ctx.arg_meta(1).dtype)}")
    shape = ctx.out_shape
    flat_x = jnp.reshape(jnp.broadcast_to(x, shape), (-1,))
    flat_mask = jnp.reshape(jnp.broadcast_to(mask.astype(jnp.bool_), shape), (-1,))
    flat_src = jnp.reshape(source, (-1,)).astype(x.dtype)
    selected = jnp.sum(flat_mask.astype(jnp.int64))
    ctx.check(selected > flat_src.shape[0],
              f"the mask selects more elements than source has ({flat_src.shape[0]})")
    if flat_src.shape[0] == 0 or flat_x.shape[0] == 0:
        return jnp.reshape(flat_x, shape)  # torch requires an all-False mask here
    position = jnp.cumsum(flat_mask.astype(jnp.int64)) - 1
    taken = flat_src[jnp.clip(position, 0, flat_src.shape[0] - 1)]
    return jnp.reshape(lax.select(flat_mask, taken, flat_x), shape)

