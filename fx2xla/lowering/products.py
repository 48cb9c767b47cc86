"""Lowering rules: products and composites eager computes in one kernel — addmv, addbmm,
_trilinear (nn.functional.bilinear), dist, complex, polar — and the functional copies and
scatters of views: narrow_copy, unbind_copy, diagonal_scatter, as_strided_scatter.

Numerics:
- Products are `linalg.dot` (one dot_general each), so they accumulate as torch's matmuls do:
  bf16/f16 in float32 with the platform's precision (`matmul_precision`), integers exactly in
  their own dtype. addbmm contracts the batch dim and the inner dim in the same dot instead of
  summing per-batch products: one accumulation in float32, as torch's CPU kernel (which adds
  the products into a float32 accumulator) does, with no bf16 rounding of partial sums.
- addmv/addbmm follow addmm: `beta * self + alpha * product`, with `self` added in the dot's
  result dtype (float32 for half operands on the CPU), rounded once to torch's dtype. beta == 0
  drops `self` entirely, so NaN/inf there do not propagate, as eager's BLAS path guarantees.
  Integer outputs take beta/alpha converted to the integer dtype (C truncation), as eager's
  `Scalar.to<int64_t>()` does. Eager requires one dtype for all three operands: so does the rule.
- _trilinear is one einsum over the three operands (after broadcasting the dims where one has
  size 1): XLA picks the contraction order, which may differ from eager's pairwise
  `sumproduct_pair` order; float results agree to accumulation rounding.
- dist is `vector_norm(self - other, p)`: the difference in the promoted dtype (rounded there,
  as eager's `sub`), the norm in float32 for bf16/f16 (torch's opmath), `|d|` for complex.
  Empty inputs with p = +-inf have no identity: eager rejects them, and so does the rule.
- complex/polar take two real tensors of one dtype (eager rejects mixed ones) and broadcast.
  polar is `abs*cos(angle) + i*abs*sin(angle)`, eager's formula, so abs = inf with angle = 0
  gives inf + NaN*i there too.
- The view copies and scatters move values only: exact in every dtype. as_strided_scatter
  follows eager's `clone_preserve_strides`: the result is `self`'s view of a copy of its whole
  storage into which `src` was written at the given strides, so an output element takes the
  `src` element written at its storage position (the last one in row-major order where `src`
  overlaps itself), else `self`'s. The positions are static (sizes, strides and offsets are
  known when the graph is lowered): one gather and one select, no scatter.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch.ops import aten

from .dtypes import dtype_name, to_jax_dtype
from .linalg import dot, dot_result_dtype, matmul_precision
from .registry import RejectedInput, concrete_shape, register_lowering
from .shape import canonical_dim

_HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _scalar_for(value, dtype):
    """A Python beta/alpha as eager's kernel reads it for `dtype`: truncated for integers."""
    if jnp.issubdtype(dtype, jnp.integer) or np.dtype(dtype) == np.dtype(jnp.bool_):
        if isinstance(value, complex):
            value = value.real
        return int(value)
    return value


def _times(x, s):
    """x * s, skipping the multiply for s == 1."""
    return x if s == 1 else x * jnp.asarray(s, x.dtype)


def _one_dtype(ctx, op: str, positions) -> None:
    dtypes = [ctx.arg_meta(i).dtype for i in positions]
    if len(set(dtypes)) > 1:
        raise RejectedInput(f"{op} input tensors must have the same dtype, but got "
                            + ", ".join(dtype_name(d) for d in dtypes))


def _add_scaled(ctx, bias, product, beta, alpha):
    """beta * bias + alpha * product in the product's (dot result) dtype, broadcast."""
    out_dtype = ctx.out_dtype
    beta, alpha = _scalar_for(beta, out_dtype), _scalar_for(alpha, out_dtype)
    out = _times(product, alpha)
    if beta == 0:  # eager ignores `self` entirely: NaN/inf there do not propagate
        return out
    bias = _times(bias.astype(out.dtype), beta)
    return out + jnp.broadcast_to(bias, out.shape)


@register_lowering(aten.addmv.default)
def _addmv(ctx, self, mat, vec, *, beta=1, alpha=1):
    _one_dtype(ctx, "addmv", (0, 1, 2))
    return _add_scaled(ctx, self, dot(mat, vec, ((1,), (0,))), beta, alpha)


@register_lowering(aten.addbmm.default)
def _addbmm(ctx, self, batch1, batch2, *, beta=1, alpha=1):
    _one_dtype(ctx, "addbmm", (0, 1, 2))
    # sum_b batch1[b] @ batch2[b]: contract the batch dim and the inner dim at once.
    return _add_scaled(ctx, self, dot(batch1, batch2, ((0, 2), (0, 1))), beta, alpha)


_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@register_lowering(aten._trilinear.default)
def _trilinear(ctx, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """sum over `sumdim` of unsqueeze(i1, expand1) * unsqueeze(i2, expand2) * unsqueeze(i3,
    expand3), as one einsum: the unsqueezed dims are left out of each operand's subscripts."""
    operands, expands = (i1, i2, i3), (expand1, expand2, expand3)
    ndim = i1.ndim + len(expand1)
    dtype = np.result_type(*(x.dtype for x in operands))
    sizes = [1] * ndim
    kept = []
    for x, expand in zip(operands, expands):
        expand = {canonical_dim(int(d), ndim) for d in expand}
        dims = [d for d in range(ndim) if d not in expand]
        kept.append(dims)
        for d, n in zip(dims, x.shape):
            if sizes[d] == 1:  # torch's mul broadcasts a size-1 dim against the others
                sizes[d] = int(n)
    summed = {canonical_dim(int(d), ndim) for d in sumdim}
    args = []
    for x, dims in zip(operands, kept):
        x = x.astype(dtype)
        target = tuple(sizes[d] for d in dims)
        if x.shape != target:
            x = jnp.broadcast_to(x, target)
        args.append(x)
    spec = ",".join("".join(_LETTERS[d] for d in dims) for dims in kept)
    spec += "->" + "".join(_LETTERS[d] for d in range(ndim) if d not in summed)
    out = jnp.einsum(spec, *args, precision=matmul_precision(dtype), preferred_element_type=dot_result_dtype(dtype))
    # summed dims stay in torch's result as size 1
    return lax.reshape(out, ctx.out_shape)


@register_lowering(aten.dist.default)
def _dist(ctx, self, other, p=2):
    common = to_jax_dtype(torch.promote_types(ctx.arg_meta(0).dtype, ctx.arg_meta(1).dtype))
    if not (jnp.issubdtype(common, jnp.inexact)):
        raise RejectedInput("norm(): input dtype should be either floating point or complex. "
                            f"Got {dtype_name(ctx.arg_meta(0).dtype)} instead.")
    d = lax.sub(*jnp.broadcast_arrays(self.astype(common), other.astype(common)))
    a = lax.abs(d)  # complex: the magnitude, in the real dtype
    if a.dtype in _HALF:
        a = a.astype(jnp.float32)
    p = float(p)
    if math.isinf(p):
        if a.size == 0:
            raise RejectedInput(f"linalg.vector_norm cannot compute the {'' if p > 0 else '-'}inf norm on an "
                                "empty tensor because the operation does not have an identity")
        return jnp.max(a) if p > 0 else jnp.min(a)
    if p == 0:
        return jnp.sum((a != 0).astype(a.dtype))
    if p == 1:
        return jnp.sum(a)
    if p == 2:
        return lax.sqrt(jnp.sum(a * a))
    q = jnp.asarray(p, a.dtype)
    return lax.pow(jnp.sum(lax.pow(a, q)), jnp.asarray(1.0 / p, a.dtype))


def _real_pair(ctx, a, b):
    """Two real tensors of one dtype (eager's check), broadcast to the output's shape, in the
    real dtype of the complex output."""
    da, db = ctx.arg_meta(0).dtype, ctx.arg_meta(1).dtype
    if da != db:
        raise RejectedInput(f"Expected object of scalar type {dtype_name(da)} but got scalar type "
                            f"{dtype_name(db)} for second argument")
    real = jnp.finfo(ctx.out_dtype).dtype  # complex64 -> float32, complex128 -> float64
    shape = ctx.out_shape
    return jnp.broadcast_to(a.astype(real), shape), jnp.broadcast_to(b.astype(real), shape)


@register_lowering(aten.complex.default)
def _complex(ctx, real, imag):
    real, imag = _real_pair(ctx, real, imag)
    return lax.complex(real, imag)


@register_lowering(aten.polar.default)
def _polar(ctx, abs, angle):  # noqa: A002 (aten's names)
    r, t = _real_pair(ctx, abs, angle)
    return lax.complex(r * lax.cos(t), r * lax.sin(t))


@register_lowering(aten.narrow_copy.default)
def _narrow_copy(ctx, x, dim, start, length):
    dim = canonical_dim(int(dim), x.ndim)
    n, start, length = x.shape[dim], int(start), int(length)
    if start < 0:
        start += n
    if not (0 <= start and length >= 0 and start + length <= n):
        raise RejectedInput(f"start ({start}) + length ({length}) exceeds dimension size ({n}).")
    return lax.slice_in_dim(x, start, start + length, axis=dim)


@register_lowering(aten.unbind_copy.int)
def _unbind_copy(ctx, x, dim=0):
    dim = canonical_dim(int(dim), x.ndim)
    return [lax.squeeze(lax.slice_in_dim(x, i, i + 1, axis=dim), (dim,)) for i in range(x.shape[dim])]


@register_lowering(aten.diagonal_scatter.default)
def _diagonal_scatter(ctx, x, src, offset=0, dim1=0, dim2=1):
    """x with diagonal(x, offset, dim1, dim2) replaced by src (whose last dim runs along the
    diagonal): a select between x and src spread onto the diagonal by a static gather."""
    d1, d2 = canonical_dim(int(dim1), x.ndim), canonical_dim(int(dim2), x.ndim)
    offset = int(offset)
    src = src.astype(x.dtype)
    rows, cols = x.shape[d1], x.shape[d2]
    length = max(0, min(rows + min(offset, 0), cols - max(offset, 0)))
    if length == 0:
        return x
    # (rows, cols): the diagonal position each element takes, or -1 off the diagonal
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    on = (c - r == offset) & (r + min(offset, 0) < length) & (r >= -min(offset, 0))
    pos = np.where(on, r + min(offset, 0), 0)
    # x with d1, d2 moved last, src broadcast over (rows, cols) by gathering its last dim
    moved = jnp.moveaxis(x, (d1, d2), (-2, -1))
    spread = jnp.take(src, pos.reshape(-1), axis=-1, mode="clip").reshape(src.shape[:-1] + (rows, cols))
    out = lax.select(jnp.broadcast_to(jnp.asarray(on), moved.shape), spread, moved)
    return jnp.moveaxis(out, (-2, -1), (d1, d2))


def _positions(shape, strides, offset) -> np.ndarray:
    """Storage position of each element of a strided view, row-major over `shape`."""
    index = np.full(tuple(shape), int(offset), dtype=np.int64)
    for d, (n, s) in enumerate(zip(shape, strides)):
        along = [-1 if i == d else 1 for i in range(len(shape))]
        index = index + (np.arange(n, dtype=np.int64) * int(s)).reshape(along)
    return index


@register_lowering(aten.as_strided_scatter.default)
def _as_strided_scatter(ctx, x, src, size, stride, storage_offset=None):
    meta = ctx.arg_meta(0)
    x_strides = concrete_shape(meta.stride(), ctx.sizes)
    x_offset = concrete_shape([meta.storage_offset()], ctx.sizes)[0]
    size = [int(s) for s in concrete_shape(size, ctx.sizes)]
    stride = [int(s) for s in concrete_shape(stride, ctx.sizes)]
    offset = x_offset if storage_offset is None else int(concrete_shape([storage_offset], ctx.sizes)[0])
    if tuple(size) != tuple(src.shape):
        raise RejectedInput(f"expected src to have a size equal to the slice of self. src size = {list(src.shape)}, "
                            f"slice size = {size}")
    src = src.astype(x.dtype)
    if x.size == 0 or src.size == 0:
        return x
    x_pos = _positions(x.shape, x_strides, x_offset).reshape(-1)
    src_pos = _positions(size, stride, offset).reshape(-1)
    # storage position -> the last src element (row-major) written there
    writer = np.full(int(max(x_pos.max(), src_pos.max())) + 1, -1, dtype=np.int64)
    np.maximum.at(writer, src_pos, np.arange(src_pos.size, dtype=np.int64))
    which = writer[x_pos]
    if (which < 0).all():
        return x
    if np.array_equal(which, np.arange(x.size)) and src.size == x.size:
        return lax.reshape(src, x.shape)  # src covers self exactly, in order
    picked = jnp.take(src.reshape(-1), np.maximum(which, 0), mode="clip").reshape(x.shape)
    return lax.select(jnp.asarray((which >= 0).reshape(x.shape)), picked, x)
