"""Lowering rules: linalg (mm, addmm, bmm).

Every matmul is one `lax.dot_general`. nn.Linear arrives as `addmm(b, x, permute(W, [1, 0]))`:
the permute lowers to a `transpose` that XLA folds into the dot's contracting dimensions
(TransposeFolding), so no transposed copy of the weight is materialised; see
tests/frontend/test_linalg.py::test_linear_weight_transpose_is_folded.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from torch.ops import aten

from .registry import register_lowering

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accumulation_dtype(dtype):
    """The dtype torch accumulates a matmul/conv of `dtype` in: float32 for bf16/f16."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) in _HALF else jnp.dtype(dtype)


def matmul_precision(dtype):
    # Full-precision float32 (no TF32/bf16 passes on backends that would otherwise use them).
    return lax.Precision.HIGHEST if jnp.issubdtype(dtype, jnp.floating) else None


def dot(a, b, contract, batch=((), ())):
    """dot_general accumulating like torch; the result stays in the accumulation dtype."""
    acc = accumulation_dtype(a.dtype)
    return lax.dot_general(
        a, b, (contract, batch), precision=matmul_precision(a.dtype), preferred_element_type=acc
    )


def _scaled(x, s):
    """x * s, skipping the multiply for s == 1 (torch's alpha/beta are Python scalars)."""
    return x if s == 1 else x * jnp.asarray(s, x.dtype)


@register_lowering(aten.mm.default)
def _mm(ctx, a, b):
    return dot(a, b, ((1,), (0,)))


@register_lowering(aten.bmm.default)
def _bmm(ctx, a, b):
    return dot(a, b, ((2,), (1,)), ((0,), (0,)))


@register_lowering(aten.addmm.default)
def _addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    out = _scaled(dot(a, b, ((1,), (0,))), alpha)
    if beta == 0:  # torch ignores `self` entirely (NaN/inf in it do not propagate)
        return out
    # Bias added in the accumulation dtype and rounded once, like torch's gemm epilogue.
    bias = _scaled(bias.astype(out.dtype), beta)
    return out + jnp.broadcast_to(bias, out.shape)
