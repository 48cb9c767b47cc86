"""Lowering rules: tensor creation (full, arange, scalar_tensor, empty).

Shapes and dtypes come from torch's meta (`ctx.out_shape`, `ctx.out_dtype`), which already
applied torch's defaults (e.g. `full((2,), 1)` is int64, `arange(0, 1, 0.1)` is float32).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from torch.ops import aten

from .registry import register_lowering


def _filled(ctx, value):
    return lax.full(ctx.out_shape, jnp.asarray(value, ctx.out_dtype), ctx.out_dtype)


@register_lowering(aten.full.default)
def _full(ctx, size, fill_value, **kwargs):
    return _filled(ctx, fill_value)


@register_lowering(aten.full_like.default)
def _full_like(ctx, x, fill_value, **kwargs):
    return _filled(ctx, fill_value)


@register_lowering(aten.new_full.default)
def _new_full(ctx, x, size, fill_value, **kwargs):
    return _filled(ctx, fill_value)


# Uninitialised memory in torch: any value is correct, zeros are deterministic.
@register_lowering(
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default,
)
def _zeros(ctx, *args, **kwargs):
    return _filled(ctx, 0)


@register_lowering(aten.ones.default, aten.ones_like.default, aten.new_ones.default)
def _ones(ctx, *args, **kwargs):
    return _filled(ctx, 1)


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
