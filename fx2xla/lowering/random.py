"""Lowering rules: random ops. Each draws from `ctx.rng_key()`: a seed that enters the
executable as an input, drawn from torch's default generator on every call (so two calls
differ and `torch.manual_seed` makes runs repeatable), folded with the node's position."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.fx
from jax import lax
from torch.ops import aten, higher_order

from .registry import base_key, register_lowering


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


# Activation checkpointing (torch.utils.checkpoint) with random ops inside the checkpointed
# region: AOTAutograd's forward wraps each such op as `run_and_save_rng_state(op, *args)`, which
# returns the generator's state and op's result, and the backward recomputes the region with
# `run_with_rng_state(state, op, *args)`, which must draw the same bits. Here the "state" is the
# PRNG key op drew from: KEY_BYTES bytes (uint8) a forward returns like any saved tensor
# (torch's own CPU state is 5056 bytes; the graphs give it a symbolic size, which the
# backward's placeholder takes from the bytes it is passed), and the backward draws from that
# key again. Op runs as a one-node graph of its own, so the forward and the backward fold the
# key the same way. Both rules lower only an op whose rule lowers every node of it, so the
# forward's and the backward's HOP either both lower or both run eagerly with torch's state.
KEY_BYTES = 16


def _inner_rule_lowers(node) -> bool:
    """The checkpointed op (the HOP's op argument) has a rule for every node of it."""
    from .registry import lowering_for

    index = 1 if node.target is higher_order.run_with_rng_state else 0
    op = node.args[index] if len(node.args) > index else None
    rule = lowering_for(op) if isinstance(op, torch._ops.OpOverload) else None
    return rule is not None and rule.accepts is None


def _key_bytes(key):
    data = lax.bitcast_convert_type(jax.random.key_data(key), jnp.uint8).reshape(-1)
    return jnp.pad(data, (0, KEY_BYTES - data.shape[0]))


def _key_from_bytes(state, like):
    """The key `_key_bytes` wrote into `state`, of the same PRNG implementation as `like`."""
    data = jax.random.key_data(like)
    words = lax.bitcast_convert_type(state[: data.size * 4].reshape(data.shape + (4,)), data.dtype)
    return jax.random.wrap_key_data(words, impl=jax.random.key_impl(like))


def _run_inner(ctx, key, op, arg_nodes, kwarg_nodes, args, kwargs):
    """`op(*args, **kwargs)` lowered by its own rule, drawing from `key`: as the only op of a
    graph whose placeholders are the HOP's tensor arguments."""
    from .graph import run_nodes

    graph, env, holders = torch.fx.Graph(), {}, {}

    def hold(node):
        if node not in holders:
            holders[node] = graph.placeholder(f"arg{len(holders)}")
            holders[node].meta["val"] = node.meta.get("val")
        return holders[node]

    inner_args = torch.fx.node.map_arg(tuple(arg_nodes), hold)
    inner_kwargs = torch.fx.node.map_arg(dict(kwarg_nodes), hold)
    node = graph.call_function(op, inner_args, inner_kwargs)
    node.meta.update(ctx.node.meta)
    node.meta["val"] = op(*torch.fx.node.map_arg(tuple(arg_nodes), lambda n: n.meta["val"]),
                          **torch.fx.node.map_arg(dict(kwarg_nodes), lambda n: n.meta["val"]))
    graph.output(node)
    values = dict(zip((holders[n] for n in holders), (_value_of(n, arg_nodes, kwarg_nodes, args, kwargs)
                                                       for n in holders)))
    env.update(values)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    return run_nodes(gm, graph.nodes, env, ctx.sizes, key, ctx.checks)[node]


def _value_of(node, arg_nodes, kwarg_nodes, args, kwargs):
    for a, v in zip(arg_nodes, args):
        if a is node:
            return v
    for k, a in kwarg_nodes.items():
        if a is node:
            return kwargs[k]
    raise KeyError(node)


@register_lowering(higher_order.run_and_save_rng_state, random=True, accepts=_inner_rule_lowers)
def _run_and_save_rng_state(ctx, op, *args, **kwargs):
    key = ctx.rng_key()
    out = _run_inner(ctx, key, op, ctx.node.args[1:], ctx.node.kwargs, args, kwargs)
    return _key_bytes(key), out


@register_lowering(higher_order.run_with_rng_state, accepts=_inner_rule_lowers)
def _run_with_rng_state(ctx, state, op, *args, **kwargs):
    like = base_key(jnp.zeros((), jnp.int64))
    return _run_inner(ctx, _key_from_bytes(state, like), op, ctx.node.args[2:], ctx.node.kwargs, args, kwargs)
