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
