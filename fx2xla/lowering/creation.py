"""Lowering rules: tensor creation (full, arange, scalar_tensor, empty).

Only ops that survive the core-ATen decomposition table have rules: zeros, ones, new_* and
*_like arrive as full, full_like or empty_permuted. Shapes and dtypes come from torch's meta
(`ctx.out_shape`, `ctx.out_dtype`), which already applied torch's defaults (e.g.
`full((2,), 1)` is int64, `arange(0, 1, 0.1)` is float32).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from torch.ops import aten

from .checks import VALUE
from .registry import register_lowering


def _filled(ctx, value):
    # numpy's cast matches torch's for out-of-range scalars (-1 as uint8 is 255, 2.7 as int is 2).
    return lax.full(ctx.out_shape, np.asarray(value).astype(ctx.out_dtype), ctx.out_dtype)


@register_lowering(aten.full.default)
def _full(ctx, size, fill_value, **kwargs):
    return _filled(ctx, fill_value)


@register_lowering(aten.full_like.default)
def _full_like(ctx, x, fill_value, **kwargs):
    return _filled(ctx, fill_value)


# Uninitialised memory in torch: any value is correct, zeros are deterministic. (The layout
# an empty_strided/empty_permuted asks for is the graph's output plan, from torch's meta.)
@register_lowering(aten.empty.memory_format, aten.empty_strided.default, aten.empty_permuted.default,
                   aten.new_empty_strided.default)
def _empty(ctx, *args, **kwargs):
    return _filled(ctx, 0)


@register_lowering(aten.scalar_tensor.default)
def _scalar_tensor(ctx, s, **kwargs):
    return _filled(ctx, s)


@register_lowering(aten.arange.start_step)
def _arange(ctx, start, end, step=1, **kwargs):
    """start + i * step, computed like torch's CPU kernel: integer dtypes in int64 (on the
    truncated bounds), float32/64 in float64, and 16-bit floats in float32."""
    (n,) = ctx.out_shape
    dtype = ctx.out_dtype
    if jnp.issubdtype(dtype, jnp.integer):
        acc, start, step = jnp.int64, int(start), int(step)
    elif jnp.dtype(dtype).itemsize <= 2:
        acc = jnp.float32
    else:
        acc = jnp.float64
    values = lax.iota(acc, n) * jnp.asarray(step, acc) + jnp.asarray(start, acc)
    return lax.convert_element_type(values, dtype)


@register_lowering(aten.tril_indices.default, aten.triu_indices.default)
def _tri_indices(ctx, row, col, offset=0, **kwargs):
    """The [2, N] coordinates of a row x col matrix's lower (tril) or upper (triu) triangle from
    diagonal `offset`, row by row as torch lists them: a constant."""
    upper = "triu" in ctx.node.target.name()
    mask = np.triu(np.ones((row, col), bool), offset) if upper else np.tril(np.ones((row, col), bool), offset)
    return jnp.asarray(np.stack(np.nonzero(mask)).reshape(2, -1), ctx.out_dtype)


def _static_output_size(node) -> bool:
    """repeat_interleave(repeats) with an output_size: a result of known size."""
    return node.kwargs.get("output_size") is not None or (len(node.args) > 1 and node.args[1] is not None)


@register_lowering(aten.repeat_interleave.Tensor, accepts=_static_output_size)
def _repeat_interleave(ctx, repeats, output_size=None):
    """repeat_interleave(repeats, output_size=n): i repeated repeats[i] times, in order, as n
    elements (the index half of `x.repeat_interleave(repeats, dim, output_size=n)`). Element j
    is the number of running totals of repeats at or below j. Negative repeats, or totals other
    than n, raise as in eager. Without output_size the size depends on the values: no rule."""
    n = ctx.out_shape[0]
    totals = jnp.cumsum(repeats)
    ctx.check(jnp.any(repeats < 0), "repeats can not be negative", error=VALUE)
    ctx.check(totals[-1] != n if repeats.shape[0] else n != 0,
              f"output_size {n} does not match the sum of repeats (eager: allocated size does not match required size)",
              error=VALUE)
    return jnp.searchsorted(totals, jnp.arange(n, dtype=totals.dtype), side="right").astype(ctx.out_dtype)
