"""Lowering rules: elementwise arithmetic, comparisons, math functions, casts, where."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from torch.ops import aten

from .registry import register_lowering


# Binary arithmetic: operands promoted to the output dtype and broadcast by the registry.
@register_lowering(aten.add.Tensor, aten.add.Scalar, promote="out", broadcast=True)
def _add(ctx, a, b, alpha=None):
    if alpha is not None and alpha != 1:
        b = b * jnp.asarray(alpha, ctx.out_dtype)
    return lax.add(a, b) if ctx.out_dtype != jnp.bool_ else lax.bitwise_or(a, b)


@register_lowering(aten.sub.Tensor, aten.sub.Scalar, promote="out", broadcast=True)
def _sub(ctx, a, b, alpha=None):
    if alpha is not None and alpha != 1:
        b = b * jnp.asarray(alpha, ctx.out_dtype)
    return lax.sub(a, b)


@register_lowering(aten.mul.Tensor, aten.mul.Scalar, promote="out", broadcast=True)
def _mul(ctx, a, b):
    return lax.mul(a, b) if ctx.out_dtype != jnp.bool_ else lax.bitwise_and(a, b)
