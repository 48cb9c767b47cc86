"""Lowering rules: random ops. Each draws from `ctx.rng_key()`: a seed that enters the
executable as an input, drawn from torch's default generator on every call (so two calls
differ and `torch.manual_seed` makes runs repeatable), folded with the node's position."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from torch.ops import aten

from .registry import register_lowering


def _float_dtype(ctx):
    dt = ctx.out_dtype
    return dt if jnp.issubdtype(dt, jnp.floating) else jnp.float32


def _uniform01(ctx):
    return jax.random.uniform(ctx.rng_key(), ctx.out_shape, dtype=_float_dtype(ctx))


@register_lowering(aten.rand.default, aten.rand_like.default, random=True)
def _rand(ctx, *args, **kwargs):
    return _uniform01(ctx)


@register_lowering(aten.randn.default, aten.randn_like.default, random=True)
def _randn(ctx, *args, **kwargs):
    return jax.random.normal(ctx.rng_key(), ctx.out_shape, dtype=_float_dtype(ctx))


@register_lowering(aten.uniform.default, random=True)
def _uniform(ctx, x, low=0.0, high=1.0, generator=None):
    dt = _float_dtype(ctx)
    return jax.random.uniform(ctx.rng_key(), ctx.out_shape, dtype=dt, minval=low, maxval=high)


def _normal(ctx, mean, std):
    z = jax.random.normal(ctx.rng_key(), ctx.out_shape, dtype=_float_dtype(ctx))
    return z * std + mean


@register_lowering(aten.normal_functional.default, random=True)
def _normal_functional(ctx, x, mean=0.0, std=1.0, generator=None):
    return _normal(ctx, mean, std)


@register_lowering(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, random=True)
def _normal_tensors(ctx, mean, std=1.0, generator=None):
    return _normal(ctx, mean, std)


@register_lowering(aten.normal.float_float, random=True)
def _normal_floats(ctx, mean, std, size, generator=None, **kwargs):
    return _normal(ctx, mean, std)


@register_lowering(aten.exponential.default, random=True)
def _exponential(ctx, x, lambd=1.0, generator=None):
    return jax.random.exponential(ctx.rng_key(), ctx.out_shape, dtype=_float_dtype(ctx)) / lambd


def _randint(ctx, low, high):
    dt = ctx.out_dtype
    draw = jnp.int64 if not jnp.issubdtype(dt, jnp.integer) else dt
    return jax.random.randint(ctx.rng_key(), ctx.out_shape, low, high, dtype=draw)


@register_lowering(aten.randint.default, random=True)
def _randint_high(ctx, high, size, **kwargs):
    return _randint(ctx, 0, high)


@register_lowering(aten.randint.low, random=True)
def _randint_low(ctx, low, high, size, **kwargs):
    return _randint(ctx, low, high)


@register_lowering(aten.randint_like.default, random=True)
def _randint_like(ctx, x, high, **kwargs):
    return _randint(ctx, 0, high)


@register_lowering(aten.randint_like.low_dtype, random=True)
def _randint_like_low(ctx, x, low, high, **kwargs):
    return _randint(ctx, low, high)


@register_lowering(aten.randperm.default, random=True)
def _randperm(ctx, n, **kwargs):
    return jax.random.permutation(ctx.rng_key(), jnp.arange(n, dtype=jnp.int64))


@register_lowering(aten.bernoulli.p, random=True)
def _bernoulli_p(ctx, x, p=0.5, generator=None):
    return _uniform01(ctx) < p


@register_lowering(aten.bernoulli.default, random=True)
def _bernoulli(ctx, p, generator=None):
    return _uniform01(ctx) < p.astype(_float_dtype(ctx))


@register_lowering(aten.native_dropout.default, random=True)
def _native_dropout(ctx, x, p, train):
    if train is False:
        return x, jnp.ones(x.shape, dtype=jnp.bool_)
    keep = _uniform01(ctx) >= p  # P(keep) = 1 - p, as torch's bernoulli(1 - p)
    if p >= 1.0:
        return jnp.zeros_like(x), keep
    scale = jnp.asarray(1.0 / (1.0 - p), x.dtype)
    return lax.select(keep, x * scale, jnp.zeros_like(x)), keep
