"""Lowering rules: grouped matmuls, the products of a mixture-of-experts layer.

A MoE layer sorts its rows by expert and multiplies each expert's rows by that expert's weight.
offs [E] holds the cumulative ends of the experts' ranges: expert e owns [offs[e-1], offs[e]).
Two ops reach fx2xla:
- `torch.ops.transformers.grouped_mm_fallback(input [S, K], weight [E, K, N], offs)`, with its
  backward `grouped_mm_fallback_backward`: transformers (5.x) calls it under torch.compile for
  weights that are not bf16. Rows past offs[E-1] are zero.
- `aten._grouped_mm(a, b, offs)` (torch.nn.functional.grouped_mm): transformers' bf16 path, and
  the products of its backward. 2-D a by 3-D b: a's rows in ranges (rows past the last end:
  unspecified in eager, zero here); 2-D by 2-D: the shared dimension in ranges, one [X, N] result
  per expert (the weight gradient); 3-D by 2-D: b's columns in ranges; 3-D by 3-D (no offs): a
  batched matmul. Bias and another out_dtype are refused, as eager's CPU kernel refuses them.
Without rules these ran eagerly between XLA subgraphs, each MoE layer a split in the graph.

On the CPU, where the kernel library is built (option torch_kernels kind "grouped_matmul"), each
expert's part is one gemm of torch's on exactly its rows, eager's own kernels
(`fx2xla_grouped_matmul`), reading transposed operands in place. Elsewhere (and for 3-D by 2-D)
the rules use a masked dense form: jax's `lax.ragged_dot`, which XLA computes outside TPUs as
every expert's weight against every row, or the same written out: E times the multiply-adds of
the grouped product.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .dtypes import dtype_name
from .linalg import is_transposed, accumulation_dtype
from .registry import RejectedInput, current_platform, register_lowering

_FLOATS = tuple(np.dtype(d) for d in (jnp.float32, jnp.float64, jnp.bfloat16, jnp.float16))
_ROWS, _CONTRACTION = 0, 1  # the library's modes (csrc/torch_kernels.cc, "Grouped matmuls")


def _check_operands(ctx, a, b, offs, name: str) -> None:
    if np.dtype(a.dtype) not in _FLOATS or a.dtype != b.dtype:
        raise RejectedInput(f"{name}: both operands must share one floating dtype, got "
                            f"{dtype_name(ctx.arg_meta(0).dtype)} and {dtype_name(ctx.arg_meta(1).dtype)}")
    if offs is not None and (offs.ndim != 1 or np.dtype(offs.dtype) not in (np.dtype(np.int32), np.dtype(np.int64))):
        raise RejectedInput(f"{name}: offs must be a 1-D int32 or int64 tensor")


def _library(ctx) -> bool:
    """Whether the library's handler computes the product: on one CPU device (under a mesh the
    partitioner would have to split a custom call it cannot see into), where it is built and
    allowed."""
    from .. import torch_kernels

    return current_platform() == "cpu" and not ctx.spmd and torch_kernels.available("grouped_matmul")


def _ends(offs, length: int):
    """offs clamped as the library clamps it: each end into [the previous end, length]."""
    return lax.cummax(jnp.clip(offs.astype(jnp.int64), 0, length), axis=0)


def _masks(offs, length: int):
    """[E, length] booleans: position t lies in expert e's range."""
    ends = _ends(offs, length)
    starts = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends[:-1]])
    t = jnp.arange(length)
    return (t[None, :] >= starts[:, None]) & (t[None, :] < ends[:, None])


def _stored(ctx, x, pos):
    """(x as it is stored, whether that is transposed): where node argument `pos` is a transposed
    buffer (a `W^T` view), x swapped back (XLA cancels the transpose pair) and True."""
    if pos is not None and is_transposed(ctx, pos):
        return jnp.swapaxes(x, -1, -2), True
    return x, False


def _library_call(a, b, offs, mode: int, ta: bool, tb: bool, out_shape):
    """The library's grouped product of a and b as stored (ta / tb: stored transposed)."""
    out = jax.ShapeDtypeStruct(out_shape, a.dtype)
    return jax.ffi.ffi_call("fx2xla_grouped_matmul", out, vmap_method="sequential")(
        a, b, offs, mode=np.int64(mode), transpose_a=np.int64(ta), transpose_b=np.int64(tb))


def _rows(ctx, a, b, offs, a_pos=0, b_pos=1):
    """[M, N]: expert e's rows of a [M, K] times b[e] ([E, K, N]); rows past the last end zero."""
    if _library(ctx):
        (sa, ta), (sb, tb) = _stored(ctx, a, a_pos), _stored(ctx, b, b_pos)
        return _library_call(sa, sb, offs, _ROWS, ta, tb, (a.shape[0], b.shape[2]))
    return _ragged_rows(a, b, offs)


def _ragged_rows(a, b, offs):
    ends = _ends(offs, a.shape[0])
    sizes = jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype)).astype(jnp.int32)
    out = lax.ragged_dot(a, b, sizes, preferred_element_type=accumulation_dtype(a.dtype))
    return out.astype(a.dtype)


def _contraction(ctx, a, b, offs, a_pos=0, b_pos=1):
    """[E, X, N]: a[:, range e] . b[range e, :] (a [X, T], b [T, N]); zero for an empty range."""
    if _library(ctx):
        (sa, ta), (sb, tb) = _stored(ctx, a, a_pos), _stored(ctx, b, b_pos)
        return _library_call(sa, sb, offs, _CONTRACTION, ta, tb, (offs.shape[0], a.shape[0], b.shape[1]))
    return _masked_contraction(a, b, offs)


def _masked_contraction(a, b, offs):
    mask = _masks(offs, a.shape[1]).astype(a.dtype)
    out = jnp.einsum("xt,et,tn->exn", a, mask, b, preferred_element_type=accumulation_dtype(a.dtype))
    return out.astype(a.dtype)


def _columns(a, b, offs):
    """[M, N]: b's columns in expert e's range times a[e] ([E, M, K]; b [K, N])."""
    full = jnp.einsum("emk,kn->emn", a, b, preferred_element_type=accumulation_dtype(a.dtype))
    mask = _masks(offs, b.shape[1])
    return jnp.sum(jnp.where(mask[:, None, :], full, 0), axis=0).astype(a.dtype)


@register_lowering("transformers.grouped_mm_fallback.default")
def _grouped_mm_fallback(ctx, x, w, offs):
    _check_operands(ctx, x, w, offs, "grouped_mm_fallback")
    if x.ndim != 2 or w.ndim != 3 or offs.shape[0] != w.shape[0] or x.shape[1] != w.shape[1]:
        raise RejectedInput(f"grouped_mm_fallback: input [S, K], weight [E, K, N] and offs [E] expected, got "
                            f"{tuple(x.shape)}, {tuple(w.shape)} and {tuple(offs.shape)}")
    return _rows(ctx, x, w, offs)


@register_lowering("transformers.grouped_mm_fallback_backward.default")
def _grouped_mm_fallback_backward(ctx, x, w, offs, g):
    """(grad_input, grad_weight): each expert's rows of g . w[e]^T (zero past the last end), and
    x[rows]^T . g[rows] per expert (zero for an expert with no rows)."""
    _check_operands(ctx, x, w, offs, "grouped_mm_fallback_backward")
    g = g.astype(x.dtype)
    if _library(ctx):  # w^T and x^T read in place: w and x as they are, flagged transposed
        sw, tw = _stored(ctx, w, 1)
        grad_x = _library_call(g, sw, offs, _ROWS, False, not tw, x.shape)
        grad_w = _library_call(x, g, offs, _CONTRACTION, True, False, w.shape)
        return grad_x, grad_w
    return _ragged_rows(g, jnp.swapaxes(w, -1, -2), offs), _masked_contraction(x.T, g, offs)


@register_lowering("aten._grouped_mm.default")
def _grouped_mm(ctx, a, b, offs=None, bias=None, out_dtype=None):
    _check_operands(ctx, a, b, offs, "grouped_mm")
    if bias is not None:
        raise RejectedInput("Bias not supported yet")
    if out_dtype is not None and np.dtype(jnp.dtype(ctx.out_dtype)) != np.dtype(a.dtype):
        raise RejectedInput("Grouped gemm output dtype must match `mat_a` dtype")
    if (a.ndim, b.ndim) == (3, 3):
        if offs is not None:
            raise RejectedInput("offs must not be given when both operands are 3-D")
        out = jnp.einsum("emk,ekn->emn", a, b, preferred_element_type=accumulation_dtype(a.dtype))
        return out.astype(a.dtype)
    if offs is None:
        raise RejectedInput("grouped_mm: offs is required when an operand is 2-D")
    if (a.ndim, b.ndim) == (2, 3):
        return _rows(ctx, a, b, offs)
    if (a.ndim, b.ndim) == (2, 2):
        return _contraction(ctx, a, b, offs)
    if (a.ndim, b.ndim) == (3, 2):
        return _columns(a, b, offs)
    raise RejectedInput(f"grouped_mm: operands must be 2-D or 3-D, got {a.ndim}-D and {b.ndim}-D")
