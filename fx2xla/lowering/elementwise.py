"""Lowering rules: elementwise arithmetic, comparisons, math functions, casts, where.

Numerics follow PyTorch's CPU kernels: bfloat16/float16 are computed in float32 ("opmath")
and rounded once at the end (the registry casts every result to torch's output dtype), except
where torch's kernel rounds after every step (div with a rounding mode, see `_div`).
"""
from __future__ import annotations

import math
import platform

import jax.numpy as jnp
import numpy as np
from jax import lax

import torch
from torch.ops import aten

from .registry import current_platform, register_lowering

_F32 = np.dtype(jnp.float32)
_REDUCED = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _is_bool(dtype) -> bool:
    return np.dtype(dtype) == np.dtype(jnp.bool_)


def opmath(x):
    """`x` in the dtype torch computes it in: float32 for bfloat16/float16."""
    return lax.convert_element_type(x, _F32) if x.dtype in _REDUCED else x


def _arith_operands(ctx, a, b, exact_scalar: bool):
    """Operands of add/sub/mul/div cast to the dtype torch's CPU kernel computes in, broadcast.

    exact_scalar: torch's mul/div kernels read a one-element second operand of a bf16/f16
    op at its original precision (a Python scalar or e.g. a 0-d float32 tensor).
    """
    dtype, shape = ctx.out_dtype, ctx.out_shape

    def cast(x, dt):
        return lax.convert_element_type(x, dt) if hasattr(x, "dtype") else _scalar(x, dt)

    if exact_scalar and dtype in _REDUCED and _is_scalar_operand(b):
        a, b = opmath(cast(a, dtype)), cast(b, _F32)
    else:
        a, b = opmath(cast(a, dtype)), opmath(cast(b, dtype))
    return jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)


def _scalar(v, dtype):
    """A Python scalar as a 0-d array of `dtype`, converted like a C cast (ints wrap, so -1
    becomes 255 in uint8 as in torch)."""
    if isinstance(v, (bool, int)) and jnp.issubdtype(dtype, jnp.integer):
        return lax.convert_element_type(jnp.asarray(v, jnp.int64), dtype)
    return jnp.asarray(v, dtype=dtype)


def _is_scalar_operand(b) -> bool:
    return not hasattr(b, "dtype") or b.size == 1


def _rounder(dtype):
    """Rounds float32 values to `dtype`'s precision when it is bf16/f16 (else identity).
    reduce_precision, unlike a convert pair, cannot be elided by XLA's excess-precision
    simplifications, so it reproduces torch kernels that round after every step."""
    if np.dtype(dtype) not in _REDUCED:
        return lambda v: v
    info = jnp.finfo(dtype)
    return lambda v: lax.reduce_precision(v, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _scaled(ctx, b, alpha):
    """`alpha * b`, alpha rounded to the output dtype first as torch's add kernel does."""
    if alpha is None or alpha == 1:
        return b
    return lax.mul(b, lax.convert_element_type(_scalar(alpha, ctx.out_dtype), b.dtype))


@register_lowering(aten.add.Tensor, aten.add.Scalar)
def _add(ctx, a, b, alpha=None):
    a, b = _arith_operands(ctx, a, b, exact_scalar=False)
    if _is_bool(ctx.out_dtype):
        return lax.bitwise_or(a, b) if alpha is None or alpha else a
    return lax.add(a, _scaled(ctx, b, alpha))


@register_lowering(aten.sub.Tensor, aten.sub.Scalar)
def _sub(ctx, a, b, alpha=None):
    a, b = _arith_operands(ctx, a, b, exact_scalar=False)
    return lax.sub(a, _scaled(ctx, b, alpha))


@register_lowering(aten.mul.Tensor, aten.mul.Scalar)
def _mul(ctx, a, b):
    a, b = _arith_operands(ctx, a, b, exact_scalar=True)
    return lax.mul(a, b) if not _is_bool(ctx.out_dtype) else lax.bitwise_and(a, b)


def _floor_div_float(a, b, rnd):
    """torch's c10::div_floor_floating (Python floor division, exact at integer quotients);
    `rnd` rounds each intermediate result like torch's kernel does."""
    zero, one = jnp.zeros((), a.dtype), jnp.ones((), a.dtype)
    mod = lax.rem(a, b)
    div = rnd(lax.div(rnd(lax.sub(a, mod)), b))
    div = jnp.where((mod != zero) & ((b < zero) != (mod < zero)), rnd(div - one), div)
    floordiv = lax.floor(div)
    floordiv = jnp.where(rnd(div - floordiv) > jnp.asarray(0.5, a.dtype), rnd(floordiv + one), floordiv)
    true_div = rnd(lax.div(a, b))
    # A zero quotient keeps the sign of a / b; division by zero gives the IEEE a / b.
    floordiv = jnp.where(div == zero, jnp.copysign(zero, true_div), floordiv)
    return jnp.where(b == zero, true_div, floordiv)


def _floor_div_int(a, b):
    """C truncating division corrected toward -inf when the signs differ (Python's //)."""
    q, r = lax.div(a, b), lax.rem(a, b)
    zero = jnp.zeros((), a.dtype)
    fix = (r != zero) & ((r < zero) != (b < zero))
    return jnp.where(fix, q - jnp.ones((), a.dtype), q)


@register_lowering(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div(ctx, a, b, rounding_mode=None):
    # With a rounding mode and a bf16/f16 tensor divisor, torch's vectorized kernel rounds to
    # bf16/f16 after every step (with a scalar divisor it stays in float32 throughout).
    per_step = rounding_mode is not None and not _is_scalar_operand(b)
    rnd = _rounder(ctx.out_dtype) if per_step else (lambda v: v)
    a, b = _arith_operands(ctx, a, b, exact_scalar=True)
    if rounding_mode is None:
        return lax.div(a, b)
    if not _is_float(a.dtype):
        return lax.div(a, b) if rounding_mode == "trunc" else _floor_div_int(a, b)
    if rounding_mode == "trunc":
        return jnp.trunc(rnd(lax.div(a, b)))
    if rounding_mode == "floor":
        return _floor_div_float(a, b, rnd)
    raise ValueError(f"div: unknown rounding_mode {rounding_mode!r}")


# Binary math ops torch computes in the promoted dtype (scalars rounded to it first).
@register_lowering(aten.fmod.Tensor, aten.fmod.Scalar, promote="out", broadcast=True)
def _fmod(ctx, a, b):
    return lax.rem(opmath(a), opmath(b))  # C fmod / %: sign of the dividend


@register_lowering(aten.remainder.Tensor, aten.remainder.Scalar, promote="out", broadcast=True)
def _remainder(ctx, a, b):
    a, b = opmath(a), opmath(b)
    mod = lax.rem(a, b)
    zero = jnp.zeros((), mod.dtype)
    # Python-style: the result takes the sign of the divisor.
    return jnp.where((mod != zero) & ((b < zero) != (mod < zero)), lax.add(mod, b), mod)


@register_lowering(aten.atan2.default, promote="out", broadcast=True)
def _atan2(ctx, a, b):
    return lax.atan2(opmath(a), opmath(b))


@register_lowering(aten.maximum.default, promote="out", broadcast=True)
def _maximum(ctx, a, b):
    return lax.max(a, b)  # XLA's max propagates NaN, like torch.maximum


@register_lowering(aten.minimum.default, promote="out", broadcast=True)
def _minimum(ctx, a, b):
    return lax.min(a, b)


@register_lowering(aten.fmax.default, promote="out", broadcast=True)
def _fmax(ctx, a, b):
    return jnp.fmax(a, b)  # NaN only when both are NaN


@register_lowering(aten.fmin.default, promote="out", broadcast=True)
def _fmin(ctx, a, b):
    return jnp.fmin(a, b)


@register_lowering(aten.hypot.default, promote="out", broadcast=True)
def _hypot(ctx, a, b):
    return jnp.hypot(opmath(a), opmath(b))


@register_lowering(aten.copysign.Tensor, aten.copysign.Scalar, promote="out", broadcast=True)
def _copysign(ctx, a, b):
    return jnp.copysign(a, b)


@register_lowering(aten.nextafter.default, promote="out", broadcast=True)
def _nextafter(ctx, a, b):
    return lax.nextafter(a, b)


def _shift_rule(left: bool):
    def rule(ctx, a, b):
        # torch: a shift by a negative amount or by >= the bit width gives 0 (-1 for a
        # right shift of a negative signed value); lax leaves those undefined.
        bits = jnp.iinfo(a.dtype).bits
        zero = jnp.zeros((), a.dtype)
        out_of_range = (b < zero) | (b >= jnp.asarray(bits, a.dtype))
        safe_b = jnp.where(out_of_range, zero, b)
        if left:
            return jnp.where(out_of_range, zero, lax.shift_left(a, safe_b))
        if not jnp.issubdtype(a.dtype, jnp.signedinteger):
            return jnp.where(out_of_range, zero, lax.shift_right_logical(a, safe_b))
        fill = jnp.where(a < zero, -jnp.ones((), a.dtype), zero)
        return jnp.where(out_of_range, fill, lax.shift_right_arithmetic(a, safe_b))

    return rule


for _packet, _left in ((aten.bitwise_left_shift, True), (aten.bitwise_right_shift, False)):
    register_lowering(_packet.Tensor, _packet.Tensor_Scalar, _packet.Scalar_Tensor, promote="out",
                      broadcast=True)(_shift_rule(_left))
# `a << b` / `a >> b` (same kernels in torch).
register_lowering(aten.__lshift__.Tensor, aten.__lshift__.Scalar, promote="out", broadcast=True)(_shift_rule(True))
register_lowering(aten.__rshift__.Tensor, aten.__rshift__.Scalar, promote="out", broadcast=True)(_shift_rule(False))


def _int_pow(base, exp):
    """torch's integer pow (c10 powi): square-and-multiply; negative exponents give 0
    except for bases 1 and -1."""
    one = jnp.ones((), base.dtype)
    e = jnp.where(exp < jnp.zeros((), exp.dtype), jnp.zeros((), exp.dtype), exp)

    def step(_, carry):
        r, b, e = carry
        r = jnp.where((e & jnp.ones((), e.dtype)) != 0, r * b, r)
        return r, b * b, lax.shift_right_logical(e, jnp.ones((), e.dtype))

    r, _, _ = lax.fori_loop(0, jnp.iinfo(exp.dtype).bits, step, (jnp.broadcast_to(one, base.shape), base, e))
    odd = (exp & jnp.ones((), exp.dtype)) != 0
    neg = jnp.where(base == one, one, jnp.where(base == -one, jnp.where(odd, -one, one), jnp.zeros((), base.dtype)))
    return jnp.where(exp < jnp.zeros((), exp.dtype), neg, r)


# torch's pow_tensor_scalar fast paths for float tensors (exact rewrites of pow).
_POW_SPECIAL = {
    2: lambda x: x * x,
    3: lambda x: x * x * x,
    0.5: lax.sqrt,
    -0.5: lax.rsqrt,
    -1: lambda x: lax.div(jnp.ones((), x.dtype), x),
    -2: lambda x: lax.div(jnp.ones((), x.dtype), x * x),
}


@register_lowering(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar, promote="out", broadcast=True)
def _pow(ctx, a, b):
    if _is_float(ctx.out_dtype) or jnp.issubdtype(ctx.out_dtype, jnp.complexfloating):
        exp = ctx.node.args[1] if ctx.node.target == aten.pow.Tensor_Scalar else None
        if isinstance(exp, (int, float)) and not isinstance(exp, bool) and exp in _POW_SPECIAL:
            return _POW_SPECIAL[exp](opmath(a))
        return lax.pow(opmath(a), opmath(b))
    return _int_pow(a, b)


# Unary math functions (int/bool inputs promote to float; computed in float32 for bf16/f16).
_FLOAT_UNARY = {
    aten.exp.default: lax.exp,
    aten.exp2.default: lax.exp2,
    aten.expm1.default: lax.expm1,
    aten.log.default: lax.log,
    aten.log1p.default: lax.log1p,
    aten.log2.default: jnp.log2,
    aten.log10.default: jnp.log10,
    aten.sqrt.default: lax.sqrt,
    aten.rsqrt.default: lax.rsqrt,
    aten.reciprocal.default: lambda x: lax.div(jnp.ones((), x.dtype), x),
    aten.sin.default: lax.sin,
    aten.cos.default: lax.cos,
    aten.tan.default: lax.tan,
    aten.tanh.default: lax.tanh,
    aten.sinh.default: lax.sinh,
    aten.cosh.default: lax.cosh,
    aten.asin.default: lax.asin,
    aten.acos.default: lax.acos,
    aten.atan.default: lax.atan,
    aten.asinh.default: lax.asinh,
    aten.acosh.default: lax.acosh,
    aten.atanh.default: lax.atanh,
    aten.erf.default: lax.erf,
    aten.erfc.default: lax.erfc,
    aten.erfinv.default: lax.erf_inv,
    aten.lgamma.default: lax.lgamma,
    aten.digamma.default: lambda x: torch_digamma(x),
    aten.sigmoid.default: lax.logistic,
    aten.i0.default: lambda x: lax.mul(lax.bessel_i0e(x), lax.exp(lax.abs(x))),
}


def torch_digamma(x):
    # torch (calc_digamma): -inf at +0 (+inf at -0), NaN at negative integers.
    zero = jnp.zeros((), x.dtype)
    d = jnp.where(x == zero, jnp.copysign(jnp.asarray(math.inf, x.dtype), -x), lax.digamma(x))
    return jnp.where((x < zero) & (x == lax.floor(x)), jnp.asarray(math.nan, x.dtype), d)


def _float_unary_rule(fn, expensive: bool):
    def rule(ctx, x):
        y = fn(opmath(x))
        return _materialized(y) if expensive and _broadcast_reader(ctx, y) else y

    return rule


# A transcendental function's result read by ops over at least BROADCAST_READ_FACTOR times its
# elements, READ_MIN_ELEMENTS or more (a rotary embedding's cos and sin tables, [1, seq, dim],
# multiplied into every batch and head) is computed once into a buffer of its own. XLA:CPU fuses
# it into each reader's loop instead, one sin or cos per element read: a jax probe of one LLaMA
# 4L layer's rotary embedding of q and k at 4 x 128 took 1.5-1.9 ms with the tables fused, and
# 0.23-0.31 ms with them computed once (docs/benchmarks.md, "Rotary tables computed once").
BROADCAST_READ_FACTOR = 4
READ_MIN_ELEMENTS = 1 << 15


def _broadcast_reader(ctx, y) -> bool:
    """Whether, on one CPU device, the node's real floating result reaches (through ops of its
    own size: views, casts, scales) an op of at least BROADCAST_READ_FACTOR times and
    READ_MIN_ELEMENTS elements, all sizes static.

    A matmul counts as well, though it reads its operand as a buffer: in an MLP's backward the
    weight gradient g^T . gelu'(h) g is far larger than h, and so GELU's erf and exp each get a
    loop of their own. XLA runs those loops beside the first products, off the critical path.
    Fused into the loop after g . W, the backward took 1.06-1.16x the time on a 2-core Emerald
    Rapids (docs/benchmarks.md, "The MLP training step on the Emerald Rapids")."""
    # (Not under SPMD: the predicate would read one shard's element across the mesh.)
    if current_platform() != "cpu" or ctx.spmd or not jnp.issubdtype(y.dtype, jnp.floating):
        return False
    node = ctx.node
    size = _static_numel(node)
    if not size:
        return False
    todo, seen = list(node.users), set()
    while todo:
        u = todo.pop()
        if u in seen or u.op != "call_function":
            continue
        seen.add(u)
        n = _static_numel(u)
        if n and n >= max(BROADCAST_READ_FACTOR * size, READ_MIN_ELEMENTS):
            return True
        if n == size:  # an op of the same size (a view, a cast, a scale): its readers read these elements
            todo.extend(u.users)
    return False


def _materialized(y):
    """`y`, computed into a buffer of its own. XLA:CPU passes a conditional's operand as a
    buffer and cannot fuse its producer into the readers of the conditional's result. Both
    branches give y's values (v * 1 is v for every real float, NaN, infinities and -0.0
    included), and the predicate reads y, so that XLA cannot fold the conditional away. (An
    optimization barrier does not do it: XLA:CPU fuses across it.)"""
    first = y.reshape(-1)[0]
    one = jnp.ones((), y.dtype)
    return lax.cond(first == first, lambda v: v, lambda v: v * one, y)


def _static_numel(node) -> int | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or any(not isinstance(d, int) for d in val.shape):
        return None
    return val.numel()


# The cheap ones, computed again in each reader's loop at little cost.
_CHEAP_UNARY = {aten.sqrt.default, aten.rsqrt.default, aten.reciprocal.default}
for _op, _fn in _FLOAT_UNARY.items():
    register_lowering(_op, promote="out")(_float_unary_rule(_fn, _op not in _CHEAP_UNARY))


@register_lowering(aten.neg.default)
def _neg(ctx, x):
    return lax.neg(x)


@register_lowering(aten.abs.default)
def _abs(ctx, x):  # complex: the magnitude (a real dtype); bool and unsigned: unchanged
    signed = _is_float(x.dtype) or jnp.iscomplexobj(x) or jnp.issubdtype(x.dtype, jnp.signedinteger)
    return lax.abs(x) if signed else x


@register_lowering(aten.angle.default, promote=None)
def _angle(ctx, x):
    """The phase: atan2(imag, real) for complex; for real x, pi below 0, 0 at or above, NaN
    kept (torch's real angle), in torch's float output dtype."""
    if jnp.iscomplexobj(x):
        return lax.atan2(lax.imag(x), lax.real(x))
    x = opmath(lax.convert_element_type(x, ctx.out_dtype))
    zero = jnp.zeros((), x.dtype)
    return jnp.where(x < zero, jnp.asarray(math.pi, x.dtype), jnp.where(x != x, x, zero))


@register_lowering(aten._conj.default, aten._conj_physical.default, aten.conj_physical.default)
def _conj(ctx, x):
    return lax.conj(x) if jnp.iscomplexobj(x) else x


@register_lowering(aten.view_as_real.default)
def _view_as_real(ctx, x):
    return jnp.stack([lax.real(x), lax.imag(x)], axis=-1)


@register_lowering(aten.view_as_complex.default)
def _view_as_complex(ctx, x):
    return lax.complex(x[..., 0], x[..., 1])


@register_lowering(aten.ldexp.Tensor, promote="out", broadcast=True)
def _ldexp(ctx, x, e):  # x * 2**e, computed as torch's decomposition does
    return lax.mul(x, lax.pow(jnp.asarray(2, x.dtype), e))


@register_lowering(aten.sign.default)
def _sign(ctx, x):
    if _is_bool(x.dtype):
        return x
    if _is_float(x.dtype):
        # torch: (0 < x) - (x < 0), so sign(NaN) = 0 and sign(-0.0) = +0.0.
        zero = jnp.zeros((), x.dtype)
        return lax.sub(lax.convert_element_type(x > zero, x.dtype), lax.convert_element_type(x < zero, x.dtype))
    return lax.sign(x)


def _rounding_rule(fn):
    def rule(ctx, x):
        return fn(x) if _is_float(x.dtype) else x  # integers are already integral

    return rule


register_lowering(aten.floor.default)(_rounding_rule(lax.floor))
register_lowering(aten.ceil.default)(_rounding_rule(lax.ceil))
register_lowering(aten.trunc.default)(_rounding_rule(jnp.trunc))
register_lowering(aten.round.default)(
    _rounding_rule(lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)))


@register_lowering(aten.round.decimals)
def _round_decimals(ctx, x, decimals=0):
    if not _is_float(x.dtype):
        return x
    # torch: nearbyint(x * 10^d) / 10^d (x / 10^-d, then * 10^-d, for d < 0), in float32
    # for bf16/f16, with 10^|d| rounded to that compute dtype.
    xa = opmath(x)
    scale = jnp.asarray(10.0 ** abs(decimals), xa.dtype)
    even = lax.RoundingMethod.TO_NEAREST_EVEN
    if decimals >= 0:
        return lax.div(lax.round(lax.mul(xa, scale), even), scale)
    return lax.mul(lax.round(lax.div(xa, scale), even), scale)


@register_lowering(aten.isnan.default)
def _isnan(ctx, x):
    return lax.ne(x, x) if _is_float(x.dtype) else jnp.zeros(x.shape, jnp.bool_)


@register_lowering(aten.isinf.default)
def _isinf(ctx, x):
    if not _is_float(x.dtype):
        return jnp.zeros(x.shape, jnp.bool_)
    return lax.eq(lax.abs(x), jnp.asarray(math.inf, x.dtype))


@register_lowering(aten.signbit.default)
def _signbit(ctx, x):
    if _is_float(x.dtype):
        return jnp.signbit(x)  # true for -0.0 and negative NaN payloads
    return x < jnp.zeros((), x.dtype) if jnp.issubdtype(x.dtype, jnp.signedinteger) else jnp.zeros(x.shape, jnp.bool_)


@register_lowering(aten.isfinite.default)
def _isfinite(ctx, x):
    return lax.is_finite(x) if _is_float(x.dtype) else jnp.ones(x.shape, jnp.bool_)


def _binary_rule(fn):
    def rule(ctx, a, b):
        return fn(a, b)

    return rule


# Comparisons: both sides cast to torch.result_type of the operands; output is bool.
for _name, _fn in (("eq", lax.eq), ("ne", lax.ne), ("lt", lax.lt), ("le", lax.le), ("gt", lax.gt), ("ge", lax.ge)):
    _packet = getattr(aten, _name)
    register_lowering(_packet.Tensor, _packet.Scalar, promote="common", broadcast=True)(_binary_rule(_fn))


# Logical ops: any dtype, nonzero (NaN included) is true; output is bool.
def _truthy(x):
    return x if _is_bool(x.dtype) else lax.ne(x, jnp.zeros((), x.dtype))


def _logical_rule(fn):
    def rule(ctx, a, b):
        return fn(_truthy(a), _truthy(b))

    return rule


for _op, _fn in ((aten.logical_and.default, lax.bitwise_and), (aten.logical_or.default, lax.bitwise_or),
                 (aten.logical_xor.default, lax.bitwise_xor)):
    register_lowering(_op, broadcast=True)(_logical_rule(_fn))


@register_lowering(aten.logical_not.default)
def _logical_not(ctx, x):
    return lax.bitwise_not(_truthy(x))


# Bitwise ops on integers and bools (lax's bitwise ops on bool are the logical ones).
for _name, _fn in (("bitwise_and", lax.bitwise_and), ("bitwise_or", lax.bitwise_or), ("bitwise_xor", lax.bitwise_xor)):
    _packet = getattr(aten, _name)
    register_lowering(_packet.Tensor, _packet.Scalar, promote="out", broadcast=True)(_binary_rule(_fn))


@register_lowering(aten.bitwise_not.default)
def _bitwise_not(ctx, x):
    return lax.bitwise_not(x)


@register_lowering(aten.where.self, broadcast=True)
def _where(ctx, cond, a, b):
    dtype = ctx.out_dtype
    return lax.select(_truthy(cond), lax.convert_element_type(a, dtype), lax.convert_element_type(b, dtype))


@register_lowering(aten.clamp.default, aten.clamp.Tensor, promote="out", broadcast=True)
def _clamp(ctx, x, min=None, max=None):  # noqa: A002 (aten's argument names)
    # max(x, lo) then min(., hi): NaN propagates and hi wins when lo > hi, as in torch.
    if min is not None:
        x = jnp.maximum(x, min)
    if max is not None:
        x = jnp.minimum(x, max)
    return x


def _convert(x, dtype):
    """Cast like torch: float -> narrow integer goes through a wider integer (wrapping, not
    saturating); complex -> real keeps the real part (torch warns that it discards the imaginary
    one)."""
    dtype = np.dtype(dtype)
    if jnp.iscomplexobj(x) and not jnp.issubdtype(dtype, jnp.complexfloating):
        x = lax.real(x)
    if _is_float(x.dtype) and jnp.issubdtype(dtype, jnp.integer):
        if X86_HOST and current_platform() == "cpu" and (jnp.issubdtype(dtype, jnp.signedinteger)
                                                         or dtype.itemsize < 4):
            return _x86_float_to_int(x, dtype)
        if dtype.itemsize < 8:
            x = lax.convert_element_type(x, jnp.int64)
    return lax.convert_element_type(x, dtype)  # float -> int truncates; -> bool is x != 0


# Eager's CPU kernels convert float to int32 / int64 with x86's cvtt instructions, which give the
# "integer indefinite" value (the type's minimum) for NaN and out-of-range values, where XLA's
# convert saturates (NaN -> 0). Narrower types (int8, uint8, int16) are int32's result wrapped.
# C++ leaves the case undefined, so this follows the host torch runs on.
X86_HOST = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def _x86_float_to_int(x, dtype):
    """`x` (floating) cast to integer `dtype` as x86's cvtt instructions cast it (see X86_HOST)."""
    wide = jnp.int64 if dtype.itemsize == 8 else jnp.int32
    info = jnp.iinfo(wide)
    t = jnp.trunc(x)
    bad = jnp.isnan(x) | (t < float(info.min)) | (t >= -float(info.min))
    r = lax.select(bad, jnp.full(x.shape, info.min, wide), lax.convert_element_type(x, wide))
    return lax.convert_element_type(r, dtype)  # integer narrowing wraps


@register_lowering(aten._to_copy.default)
def _to_copy(ctx, x, **kwargs):  # layout/device/pin_memory/memory_format do not apply here
    return _convert(x, ctx.out_dtype)


# (In graphs where a Python float became symbolic: an optimizer's learning rate once its
# scheduler changed it, cast to the parameters' dtype.)
@register_lowering(torch.ops.prims.convert_element_type.default)
def _prims_convert(ctx, x, dtype):
    return _convert(jnp.asarray(x), ctx.out_dtype)


@register_lowering(aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default)
def _identity(ctx, x, **kwargs):  # memory_format: the executable's outputs are dense anyway
    return x


# copy_ appears only as AOTAutograd's write-back of a mutated graph input (inference graphs
# keep input mutations in the graph): its value is the input's new contents, which lower_graph
# hands back as an extra result for CompiledGraph to install in the input.
@register_lowering(aten.copy.default, aten.copy_.default)
def _copy(ctx, dst, src, non_blocking=False):
    return jnp.broadcast_to(_convert(src, ctx.out_dtype), ctx.out_shape)


@register_lowering(aten.fill.Scalar)
def _fill(ctx, x, value):
    dtype = ctx.out_dtype
    # The scalar converts like a C cast: float -> int truncates, out-of-range ints wrap.
    if _is_float(dtype):
        v = jnp.asarray(float(value), jnp.float64)
    elif _is_bool(dtype):
        v = jnp.asarray(bool(value), jnp.bool_)
    else:
        v = jnp.asarray(int(value), jnp.int64)
    return jnp.broadcast_to(lax.convert_element_type(v, dtype), ctx.out_shape)


# prims.fma survives the core decompositions (AdamW's addcmul/lerp). It is defined by Inductor's
# prims module when that loads, so it is registered by name.
@register_lowering("prims.fma.default", promote="out", broadcast=True)
def _fma(ctx, a, b, c):
    return a * b + c
