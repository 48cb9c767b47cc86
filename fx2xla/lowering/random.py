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

from .checks import VALUE
from .registry import RejectedInput, base_key, lowering_for, register_lowering


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
    graph whose placeholders are the HOP's tensor arguments (`arg_nodes` / `kwarg_nodes`, the
    FX arguments whose traced values are `args` / `kwargs`)."""
    from .graph import run_nodes

    graph, env = torch.fx.Graph(), {}
    holders: dict = {}

    def bind(a, value):  # each FX node argument -> a placeholder bound to its traced value
        if isinstance(a, torch.fx.Node):
            if a not in holders:
                holders[a] = graph.placeholder(f"arg{len(holders)}")
                holders[a].meta["val"] = a.meta.get("val")
                env[holders[a]] = value
            return holders[a]
        if isinstance(a, (list, tuple)):
            return type(a)(bind(x, v) for x, v in zip(a, value))
        return a

    inner_args = tuple(bind(a, v) for a, v in zip(arg_nodes, args))
    inner_kwargs = {k: bind(a, kwargs[k]) for k, a in kwarg_nodes.items()}
    node = graph.call_function(op, inner_args, inner_kwargs)
    node.meta.update(ctx.node.meta)
    node.meta["val"] = op(*torch.fx.node.map_arg(tuple(arg_nodes), lambda n: n.meta["val"]),
                          **torch.fx.node.map_arg(dict(kwarg_nodes), lambda n: n.meta["val"]))
    graph.output(node)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    return run_nodes(gm, graph.nodes, env, ctx.sizes, key, ctx.checks)[node]


@register_lowering(higher_order.run_and_save_rng_state, random=True, accepts=_inner_rule_lowers)
def _run_and_save_rng_state(ctx, op, *args, **kwargs):
    key = ctx.rng_key()
    out = _run_inner(ctx, key, op, ctx.node.args[1:], ctx.node.kwargs, args, kwargs)
    return _key_bytes(key), out


@register_lowering(higher_order.run_with_rng_state, accepts=_inner_rule_lowers)
def _run_with_rng_state(ctx, state, op, *args, **kwargs):
    like = base_key(jnp.zeros((), jnp.int64))
    return _run_inner(ctx, _key_from_bytes(state, like), op, ctx.node.args[2:], ctx.node.kwargs, args, kwargs)


# More distributions (the functional forms of the in-place `Tensor.cauchy_`, `log_normal_`,
# `geometric_`; torch.multinomial; nn.RReLU in training). Like the others, real randomness from
# the call's seed: the distributions are eager's, the bits are not.

def _uniform_open(ctx, dtype):
    """Uniform draws in (0, 1), never 0: for the logarithms and tangents below."""
    u = jax.random.uniform(ctx.rng_key(), ctx.out_shape, dtype=dtype)
    return jnp.maximum(u, jnp.finfo(dtype).tiny)


def _compute_dtype(ctx):
    dt = ctx.out_dtype
    return jnp.float64 if dt == jnp.float64 else jnp.float32


@register_lowering(aten.cauchy.default, random=True)
def _cauchy(ctx, x, median=0.0, sigma=1.0, generator=None):
    u = _uniform_open(ctx, _compute_dtype(ctx))
    return median + sigma * jnp.tan(jnp.pi * (u - 0.5))


@register_lowering(aten.log_normal.default, random=True)
def _log_normal(ctx, x, mean=1.0, std=2.0, generator=None):
    z = jax.random.normal(ctx.rng_key(), ctx.out_shape, dtype=_compute_dtype(ctx))
    return jnp.exp(z * std + mean)


@register_lowering(aten.geometric.default, random=True)
def _geometric(ctx, x, p, generator=None):
    """The number of Bernoulli(p) trials up to the first success (1, 2, ...), as eager's
    ceil(log(u) / log(1 - p)); for integer tensors too."""
    dt = _compute_dtype(ctx)
    u = _uniform_open(ctx, dt)
    return jnp.maximum(jnp.ceil(jnp.log(u) / jnp.log1p(-jnp.asarray(p, dt))), 1)


@register_lowering(aten.rrelu_with_noise_functional.default, random=True)
def _rrelu_with_noise(ctx, x, noise, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    """nn.RReLU: in training each negative element is scaled by its own slope drawn from
    U(lower, upper), which `noise` records for the backward (1 for the others); in eval the
    slope is (lower + upper) / 2 and `noise` is returned as it came."""
    if not training:
        slope = jnp.asarray((lower + upper) / 2, x.dtype)
        return jnp.where(x >= 0, x, x * slope), noise
    dt = _compute_dtype(ctx)
    r = jax.random.uniform(ctx.rng_key(), x.shape, dtype=dt, minval=lower, maxval=upper)
    negative = x < 0
    slope = jnp.where(negative, r, jnp.ones((), dt))
    return (x.astype(dt) * slope).astype(x.dtype), slope.astype(noise.dtype)


@register_lowering(aten.rrelu_with_noise_backward.default)
def _rrelu_with_noise_backward(ctx, grad, x, noise, lower, upper, training, self_is_result):
    """In training, the gradient times the recorded slopes; in eval, leaky ReLU's with the mean
    slope."""
    if training:
        return grad * noise.astype(grad.dtype)
    slope = jnp.asarray((lower + upper) / 2, grad.dtype)
    return jnp.where(x > 0, grad, grad * slope)


@register_lowering(aten.multinomial.default, random=True)
def _multinomial(ctx, probs, num_samples, replacement=False, generator=None):
    """torch.multinomial over the last dim (1-D or 2-D weights, not necessarily normalized):
    with replacement, independent categorical draws; without, the first num_samples of the
    categories ordered by Gumbel-perturbed log weights, which draws them one after another
    without replacement in proportion to the weights left. Weights that are negative, NaN or
    infinite, rows that sum to 0, and rows with fewer than num_samples nonzero weights (without
    replacement) raise, as in eager."""
    k = probs.shape[-1]
    if not replacement and num_samples > k:
        raise RejectedInput(f"cannot sample n_sample > prob_dist.size(-1) samples without replacement "
                            f"(n_sample = {num_samples}, size(-1) = {k})")
    dt = _compute_dtype(ctx)
    w = probs.astype(dt)
    if num_samples == 0:
        return jnp.zeros(ctx.out_shape, jnp.int64)
    ctx.check(jnp.any(~jnp.isfinite(w) | (w < 0)), "probability tensor contains either `inf`, `nan` or element < 0",
              error=VALUE)
    ctx.check(jnp.any(jnp.sum(w, axis=-1) <= 0), "invalid multinomial distribution (sum of probabilities <= 0)",
              error=VALUE)
    logits = jnp.where(w > 0, jnp.log(jnp.where(w > 0, w, 1)), -jnp.inf)
    if replacement:
        out = jax.random.categorical(ctx.rng_key(), logits[..., None, :], axis=-1,
                                     shape=probs.shape[:-1] + (num_samples,))
        return out.astype(jnp.int64)
    ctx.check(jnp.any(jnp.sum(w > 0, axis=-1) < num_samples),
              "invalid multinomial distribution (with replacement=False, not enough non-negative category to sample)",
              error=VALUE)
    gumbel = jax.random.gumbel(ctx.rng_key(), probs.shape, dtype=dt)
    _, picked = lax.top_k(logits + gumbel, num_samples)
    return picked.astype(jnp.int64)
