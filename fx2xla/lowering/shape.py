"""Lowering rules: shape — views, concatenation, slicing, padding, scatters into slices, sizes.

Views lower to value-producing ops (reshape, transpose, slice): the lowered program is
functional, and torch's meta already says which shape each result has, so rules that only
rearrange dimensions reshape to `ctx.out_shape` instead of re-deriving it (this covers -1
entries and torch's "squeeze only size-1 dims" rule at once).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch.ops import aten

from ..layouts import dense_permutation
from ..sharding import MARK_SHARDING, decode_spec, mesh_by_id
from .checks import VALUE
from .registry import concrete_shape, register_lowering


def canonical_dim(dim: int, ndim: int) -> int:
    """torch's dim wrapping: a 0-d tensor accepts dims -1 and 0."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"dimension {dim} out of range for a {ndim}-d tensor")
    return dim % n


def _meta_int(ctx, v) -> int:
    """A size, stride or offset from torch's meta, with symbols bound to this trace's values."""
    return concrete_shape([v], ctx.sizes)[0]


def slice_bounds(size: int, start, end, step: int) -> tuple[int, int, int]:
    """torch's slice normalisation: None means the whole range, negatives count from the
    end, out-of-range bounds clamp to [0, size], and an empty range is (start, start)."""
    if step <= 0:
        raise ValueError(f"slice step must be positive, got {step}")
    start = 0 if start is None else int(start)
    end = size if end is None else int(end)
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end, int(step)


# Views whose result is the input's elements in row-major order under a new shape.
@register_lowering(
    aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
)
def _reshape(ctx, x, *args):
    return lax.reshape(x, ctx.out_shape)


@register_lowering(aten.view.dtype)
def _view_dtype(ctx, x, dtype):
    """`x.view(dtype)`: the same bytes read as another dtype; torch splits or merges the last
    dim where the item sizes differ (a float32 [n, 4] viewed as uint8 is [n, 16])."""
    return lax.reshape(bitcast(x, np.dtype(ctx.out_dtype)), ctx.out_shape)


def bitcast(x, out):
    """`x`'s bytes as dtype `out`, the last dim scaled by the ratio of the item sizes. bool is
    one byte (torch reads a nonzero byte as True); a complex value is its real and imaginary
    parts side by side."""
    if x.dtype == out:
        return x
    if x.dtype == np.bool_:
        return bitcast(x.astype(jnp.uint8), out)
    if out == np.bool_:
        return bitcast(x, np.dtype(jnp.uint8)) != 0
    if jnp.iscomplexobj(x):
        parts = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
        return bitcast(parts.reshape(*x.shape[:-1], 2 * x.shape[-1]), out)
    if jnp.issubdtype(out, jnp.complexfloating):
        part = bitcast(x, np.dtype(jnp.finfo(out).dtype))
        pairs = part.reshape(*part.shape[:-1], part.shape[-1] // 2, 2)
        return lax.complex(pairs[..., 0], pairs[..., 1])
    size, new = x.dtype.itemsize, out.itemsize
    if size == new:
        return lax.bitcast_convert_type(x, out)
    if size > new:  # each item becomes size // new items along a new last dim
        return lax.bitcast_convert_type(x, out).reshape(*x.shape[:-1], x.shape[-1] * (size // new))
    ratio = new // size
    return lax.bitcast_convert_type(x.reshape(*x.shape[:-1], x.shape[-1] // ratio, ratio), out)


@register_lowering(aten.permute.default)
def _permute(ctx, x, dims):
    return lax.transpose(x, tuple(canonical_dim(d, x.ndim) for d in dims))


@register_lowering(aten.expand.default)
def _expand(ctx, x, size, implicit=False):
    shape = ctx.out_shape  # torch resolved the -1 entries
    return lax.broadcast_in_dim(x, shape, tuple(range(len(shape) - x.ndim, len(shape))))


@register_lowering(aten.cat.default)
def _cat(ctx, tensors, dim=0):
    # torch skips legacy empty 1-d tensors of shape (0,) when concatenating other ranks.
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros(ctx.out_shape, ctx.out_dtype)
    dim = canonical_dim(dim, kept[0].ndim)
    dtype = ctx.out_dtype
    kept = [t if t.dtype == dtype else lax.convert_element_type(t, dtype) for t in kept]
    return lax.concatenate(kept, dim)


@register_lowering(aten.slice.Tensor)
def _slice(ctx, x, dim=0, start=None, end=None, step=1):
    dim = canonical_dim(dim, x.ndim)
    start, end, step = slice_bounds(x.shape[dim], start, end, step)
    return lax.slice_in_dim(x, start, end, step, axis=dim)


def _index_in_dim(index: int, size: int) -> int:
    if not -size <= index < size:
        raise IndexError(f"index {index} out of range for a dimension of size {size}")
    return index % size


@register_lowering(aten.select.int)
def _select(ctx, x, dim, index):
    dim = canonical_dim(dim, x.ndim)
    return lax.index_in_dim(x, _index_in_dim(int(index), x.shape[dim]), axis=dim, keepdims=False)


@register_lowering(aten.split_with_sizes.default)
def _split_with_sizes(ctx, x, split_sizes, dim=0):
    dim = canonical_dim(dim, x.ndim)
    parts, start = [], 0
    for size in split_sizes:
        parts.append(lax.slice_in_dim(x, start, start + int(size), axis=dim))
        start += int(size)
    return parts


@register_lowering(aten.diagonal.default)
def _diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, canonical_dim(dim1, x.ndim), canonical_dim(dim2, x.ndim))


def _reads_a_dense_input(node) -> bool:
    """as_strided's input is dense (or its strides are symbolic, checked when lowered)."""
    meta = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
    if not hasattr(meta, "stride"):
        return True
    shape, strides = tuple(meta.shape), tuple(meta.stride())
    if any(isinstance(v, torch.SymInt) for v in shape + strides):
        return True
    return math.prod(shape) <= 1 or dense_permutation(shape, strides) is not None


@register_lowering(aten.as_strided.default, accepts=_reads_a_dense_input)
def _as_strided(ctx, x, size, stride, storage_offset=None):
    """Gathers from the input's storage at offset + sum(i_d * stride_d).

    The storage is rebuilt from the input's meta strides, which works for a dense input
    (row-major or a permutation of it, counted from its own storage offset). A non-dense
    input (e.g. a strided slice) would read memory outside the view, which the lowered
    program does not hold: such a node runs eagerly (`_reads_a_dense_input`), or, where its
    strides were symbolic, is rejected here.
    """
    meta = ctx.arg_meta(0)
    size = [int(s) for s in size]
    stride = [int(s) for s in stride]
    base_offset = _meta_int(ctx, meta.storage_offset())
    offset = (base_offset if storage_offset is None else int(storage_offset)) - base_offset
    in_strides = concrete_shape(meta.stride(), ctx.sizes)
    numel = math.prod(x.shape)
    perm = dense_permutation(x.shape, in_strides) if numel > 1 else None
    if numel > 1 and perm is None:
        raise NotImplementedError(
            f"as_strided of a non-dense view (strides {in_strides}) reads memory outside the "
            "view; call .contiguous() on it before as_strided"
        )
    storage = lax.reshape(x, (numel,), dimensions=perm)  # row-major over perm = storage order
    index = np.full(size, offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        index = index + (np.arange(n, dtype=np.int64) * s).reshape([-1 if i == d else 1 for i in range(len(size))])
    if index.size and (index.min() < 0 or index.max() >= numel):
        raise IndexError(f"as_strided{tuple(size), tuple(stride), storage_offset} reads outside the input's {numel} elements")
    if index.size == numel and np.array_equal(index.reshape(-1), np.arange(numel)):
        return lax.reshape(storage, tuple(size))  # the whole storage in order: no gather
    return jnp.take(storage, index, mode="clip")  # indices are in range by construction


@register_lowering(aten.flip.default)
def _flip(ctx, x, dims):
    return lax.rev(x, tuple(sorted({canonical_dim(d, x.ndim) for d in dims})))


@register_lowering(aten.repeat.default)
def _repeat(ctx, x, repeats):
    repeats = [int(r) for r in repeats]
    shape = (1,) * (len(repeats) - x.ndim) + tuple(x.shape)
    # Broadcast to (r0, s0, r1, s1, ...) and merge each pair: tile without copies per repeat.
    tiled = lax.broadcast_in_dim(
        lax.reshape(x, shape), tuple(v for pair in zip(repeats, shape) for v in pair),
        tuple(range(1, 2 * len(shape), 2)),
    )
    return lax.reshape(tiled, ctx.out_shape)


def _pad_config(ndim: int, pad) -> list[tuple[int, int, int]]:
    """torch's pad list (last dim first, (before, after) pairs) as lax.pad's per-dim config."""
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) // 2 > ndim:
        raise ValueError(f"padding {pad} does not fit a {ndim}-d tensor")
    config = [(0, 0, 0)] * ndim
    for i in range(len(pad) // 2):
        config[ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return config


@register_lowering(aten.constant_pad_nd.default)
def _constant_pad_nd(ctx, x, pad, value=0):
    # lax.pad crops on negative padding, as torch does.
    return lax.pad(x, jnp.asarray(value, x.dtype), _pad_config(x.ndim, pad))


def _pad_by_index(x, pad, edge_index):
    """Pad the trailing dims by gathering along each with `edge_index(positions, size)`,
    positions running from -before to size + after."""
    for d, (lo, hi, _) in enumerate(_pad_config(x.ndim, pad)):
        if lo == 0 and hi == 0:
            continue
        n = x.shape[d]
        index = edge_index(np.arange(-lo, n + hi, dtype=np.int64), n)
        x = jnp.take(x, index, axis=d, mode="clip")  # indices are in range by construction
    return x


def _reflect(i, n):
    if n == 1:
        return np.zeros_like(i)
    period = 2 * (n - 1)
    i = np.abs(i) % period
    return np.where(i >= n, period - i, i)


@register_lowering(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default)
def _reflection_pad(ctx, x, padding):
    return _pad_by_index(x, padding, _reflect)


@register_lowering(aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)
def _replication_pad(ctx, x, padding):
    return _pad_by_index(x, padding, lambda i, n: np.clip(i, 0, n - 1))


@register_lowering(aten.slice_scatter.default)
def _slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    dim = canonical_dim(dim, x.ndim)
    n = x.shape[dim]
    start, end, step = slice_bounds(n, start, end, step)
    src = src.astype(x.dtype)
    if src.shape[dim] == 0:
        return x
    if step == 1:
        starts = [0] * x.ndim
        starts[dim] = start
        return lax.dynamic_update_slice(x, src, starts)
    # Strided: spread src with interior padding and select it where a mask (padded alike) is set.
    last = start + (src.shape[dim] - 1) * step
    config = [(0, 0, 0)] * x.ndim
    config[dim] = (start, n - 1 - last, step - 1)
    spread = lax.pad(src, jnp.zeros((), x.dtype), config)
    mask = lax.pad(jnp.ones(src.shape, jnp.bool_), jnp.asarray(False), config)
    return lax.select(mask, spread, x)


@register_lowering(aten.select_scatter.default)
def _select_scatter(ctx, x, src, dim, index):
    dim = canonical_dim(dim, x.ndim)
    starts = [0] * x.ndim
    starts[dim] = _index_in_dim(int(index), x.shape[dim])
    return lax.dynamic_update_slice(x, lax.expand_dims(src.astype(x.dtype), (dim,)), starts)


# Sizes: Python ints, fixed for the executable being traced.
@register_lowering(aten.sym_size.int)
def _sym_size(ctx, x, dim):
    return int(x.shape[canonical_dim(dim, x.ndim)])


@register_lowering(aten.sym_numel.default)
def _sym_numel(ctx, x):
    return math.prod(x.shape)


@register_lowering(aten.sym_stride.int)
def _sym_stride(ctx, x, dim):
    # Strides are a property of torch's layout, which the traced values do not carry.
    return _meta_int(ctx, ctx.arg_meta(0).stride(canonical_dim(dim, x.ndim)))


@register_lowering(aten.sym_storage_offset.default)
def _sym_storage_offset(ctx, x):
    return _meta_int(ctx, ctx.arg_meta(0).storage_offset())


@register_lowering(aten.unfold.default)
def _unfold(ctx, x, dim, size, step):
    """Windows of `size` every `step` along `dim`: dim becomes the window count, and a new
    last dim holds each window (a gather of row indices i * step + j)."""
    if x.ndim == 0:
        return jnp.reshape(x, ctx.out_shape)
    dim = canonical_dim(dim, x.ndim)
    n = ctx.out_shape[dim]
    rows = (jnp.arange(n) * step)[:, None] + jnp.arange(size)[None, :]
    windows = jnp.take(x, jnp.reshape(rows, (-1,)), axis=dim)
    windows = jnp.reshape(windows, x.shape[:dim] + (n, size) + x.shape[dim + 1:])
    return jnp.moveaxis(windows, dim + 1, -1)


@register_lowering(aten._assert_tensor_metadata.default)
def _assert_tensor_metadata(ctx, x, size=None, stride=None, dtype=None, *, device=None, layout=None):
    # torch.export's check that a tensor has the traced metadata: the shapes and dtypes the
    # module is lowered for are static, so it holds by construction (nothing to compute).
    return None


@register_lowering(aten._assert_async.default, aten._assert_async.msg)
def _assert_async(ctx, cond, message="Expected Tensor with single nonzero value, but got zero"):
    # torch's asynchronous assertion, which decompositions emit for the values eager checks
    # (F.one_hot's classes in [0, num_classes)): a run-time check like an index check, raised
    # after the call as fx2xla.InvalidValueError with eager's message.
    ctx.check(jnp.reshape(cond, ()) == 0, message, error=VALUE)
    return None


@register_lowering(MARK_SHARDING)
def _mark_sharding(ctx, x, mesh, spec):
    # A sharding constraint (Shardy's sdy.sharding_constraint): the value is laid out as the
    # user asked at this point; XLA's partitioner inserts the collectives around it.
    import jax

    return jax.lax.with_sharding_constraint(x, mesh_by_id(mesh).named_sharding(decode_spec(spec)))
