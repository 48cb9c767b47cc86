"""Lowering rules: fft — the real-to-complex, complex-to-real and complex-to-complex transforms
torch.fft's functions lower to (_fft_r2c, _fft_c2r, _fft_c2c), as one StableHLO fft each.

torch's `normalization` argument is an enum: 0 = none, 1 = by 1/sqrt(n), 2 = by 1/n, where n is
the product of the logical signal sizes. jnp.fft's `norm` names where the 1/n goes instead.
"""
from __future__ import annotations

import jax.numpy as jnp

from torch.ops import aten

from .registry import register_lowering
from .shape import canonical_dim

# torch's normalization enum -> jnp.fft norm, for forward and for inverse transforms.
_FORWARD_NORM = {0: "backward", 1: "ortho", 2: "forward"}
_INVERSE_NORM = {0: "forward", 1: "ortho", 2: "backward"}


def _dims(dim, ndim):
    return [canonical_dim(d, ndim) for d in dim]


@register_lowering(aten._fft_r2c.default)
def _fft_r2c(ctx, x, dim, normalization, onesided):
    axes = _dims(dim, x.ndim)
    norm = _FORWARD_NORM[normalization]
    if onesided:  # the last transformed dim keeps n // 2 + 1 bins
        out = jnp.fft.rfftn(x, axes=axes, norm=norm)
    else:
        out = jnp.fft.fftn(x.astype(ctx.out_dtype), axes=axes, norm=norm)
    return out.astype(ctx.out_dtype)


@register_lowering(aten._fft_c2r.default)
def _fft_c2r(ctx, x, dim, normalization, last_dim_size):
    # Hermitian input: the other dims are full length, the last one is rebuilt to last_dim_size.
    axes = _dims(dim, x.ndim)
    sizes = [x.shape[a] for a in axes[:-1]] + [int(last_dim_size)]
    return jnp.fft.irfftn(x, s=sizes, axes=axes, norm=_INVERSE_NORM[normalization]).astype(ctx.out_dtype)


@register_lowering(aten._fft_c2c.default)
def _fft_c2c(ctx, x, dim, normalization, forward):
    # fft2/fftn of a real tensor transform the last dim with r2c and the others with c2c.
    axes = _dims(dim, x.ndim)
    if forward:
        return jnp.fft.fftn(x, axes=axes, norm=_FORWARD_NORM[normalization])
    return jnp.fft.ifftn(x, axes=axes, norm=_INVERSE_NORM[normalization])
