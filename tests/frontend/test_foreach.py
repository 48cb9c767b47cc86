"""`torch._foreach_*` ops (foreach optimizers, clip_grad_norm_): fx2xla/decompositions.py
turns every functional overload into per-tensor core ops. Each test compiles with
fallback="error" (the `check` fixture), so a foreach op left without a lowering fails.

Lists mix shapes: 2-d, 0-d, empty, 3-d and a non-contiguous (transposed) tensor. Functions
take the tensors as separate arguments (`check` clones tensor arguments, not lists) and
split them into lists.
"""
from __future__ import annotations

import pytest
import torch

import fx2xla.decompositions as decompositions

aten = torch.ops.aten
FLOATS = [torch.float32, torch.bfloat16]
SHAPES = [(3, 4), (), (0,), (2, 1, 5), "t"]  # "t": a (4, 3) view of a transposed (3, 4) tensor
NONEMPTY = [(3, 4), (), (2, 1, 5), "t"]


def tensors(dtype, shapes=SHAPES, *, low=-2.0, high=2.0, seed=0, lists=1) -> tuple:
    """`lists` lists of tensors with `shapes`, values uniform in [low, high), flattened."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(lists):
        for s in shapes:
            base = (3, 4) if s == "t" else s
            t = (torch.rand(base, generator=g, dtype=torch.float64) * (high - low) + low).to(dtype)
            out.append(t.t() if s == "t" else t)
    return tuple(out)


def split(ts, n):
    k = len(ts) // n
    return [list(ts[i * k:(i + 1) * k]) for i in range(n)]


def test_every_foreach_overload_has_a_decomposition():
    """Every functional `_foreach_*` overload torch registers (77 in torch 2.13); in-place and
    out= overloads need none: functionalization rewrites them to these first."""
    table = decompositions.decomposition_table()
    schemas = [s for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::_foreach_")
               and not s.name.endswith("_") and not s.overload_name.endswith("out")]
    missing = [f"{s.name}.{s.overload_name}" for s in schemas
               if getattr(getattr(aten, s.name[len("aten::"):]), s.overload_name or "default") not in table]
    assert len(schemas) >= 77 and not missing, missing
    assert aten._foreach_add_.List not in table and aten._foreach_add.List_out not in table


UNARY = ["abs", "ceil", "cos", "erf", "erfc", "exp", "expm1", "floor", "frac", "neg", "round", "sigmoid",
         "sign", "sin", "sinh", "tan", "tanh", "trunc", "atan", "cosh"]
UNARY_POSITIVE = ["log", "log10", "log1p", "log2", "lgamma", "reciprocal", "rsqrt", "sqrt"]
UNARY_UNIT = ["acos", "asin"]  # domain [-1, 1]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("ops,low,high", [(UNARY, -2.0, 2.0), (UNARY_POSITIVE, 0.1, 3.0), (UNARY_UNIT, -0.9, 0.9)],
                         ids=["any", "positive", "unit"])
def test_unary(ops, low, high, dtype, check):
    def fn(*ts):
        return [getattr(torch, f"_foreach_{op}")(list(ts)) for op in ops]

    check(fn, *tensors(dtype, low=low, high=high))


@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_inplace(dtype, check):
    def fn(*ts):
        xs = list(ts)
        torch._foreach_exp_(xs)
        torch._foreach_sqrt_(xs)
        torch._foreach_neg_(xs)
        return xs

    check(fn, *tensors(dtype))


BINARY = ["add", "sub", "mul", "div", "pow", "maximum", "minimum", "clamp_min", "clamp_max"]


@pytest.mark.parametrize("dtype", FLOATS)
def test_binary_list(dtype, check):
    def fn(*ts):
        xs, ys = split(ts, 2)
        out = [getattr(torch, f"_foreach_{op}")(xs, ys) for op in BINARY]
        return out + [torch._foreach_add(xs, ys, alpha=-0.5), torch._foreach_sub(xs, ys, alpha=2)]

    # Positive bases for pow (a negative base to a fractional power is NaN either way).
    xs = tensors(dtype, low=0.5, high=2.0)
    ys = tensors(dtype, low=0.5, high=2.0, seed=1)
    check(fn, *xs, *ys)


@pytest.mark.parametrize("dtype", FLOATS)
def test_binary_scalar(dtype, check):
    def fn(*ts):
        xs = list(ts)
        return [getattr(torch, f"_foreach_{op}")(xs, 0.75) for op in BINARY] + [torch._foreach_mul(xs, 3)]

    check(fn, *tensors(dtype, low=0.1, high=2.0))


@pytest.mark.parametrize("dtype", FLOATS)
def test_binary_scalar_list(dtype, check):
    scalars = [0.5, -1.25, 2.0, 3, 1.5]  # one per tensor (an int among them)

    def fn(*ts):
        xs = list(ts)
        return [getattr(torch, f"_foreach_{op}")(xs, scalars) for op in BINARY]

    check(fn, *tensors(dtype, low=0.1, high=2.0))


@pytest.mark.parametrize("dtype", FLOATS)
def test_binary_tensor(dtype, check):
    """The .Tensor overloads: one 0-d tensor (e.g. a tensor lr) shared by the whole list.
    (torch._foreach_add(xs, t) without alpha binds the .Scalar overload and breaks the graph on
    t.item(), hence the explicit overload.)"""

    def fn(other, *ts):
        xs = list(ts)
        return [aten._foreach_add.Tensor(xs, other), torch._foreach_add(xs, other, alpha=-2),
                torch._foreach_mul(xs, other), torch._foreach_div(xs, other)]

    check(fn, torch.tensor(0.3, dtype=dtype), *tensors(dtype))


@pytest.mark.parametrize("dtype", FLOATS)
def test_pow_scalar_and_tensor(dtype, check):
    """`beta ** step` in Adam: a Scalar base, one exponent per tensor."""

    def fn(*ts):
        return torch._foreach_pow(0.9, list(ts)), torch._foreach_pow(2, list(ts))

    check(fn, *tensors(dtype, low=-3.0, high=5.0))


def test_binary_int64(check):
    def fn(*ts):
        xs, ys = split(ts, 2)
        return [torch._foreach_add(xs, ys, alpha=3), torch._foreach_sub(xs, 2),
                torch._foreach_mul(xs, [2, -1, 3, 0, 5]), torch._foreach_maximum(xs, ys), torch._foreach_minimum(xs, 1), torch._foreach_clamp_max(xs, ys),
                torch._foreach_div(xs, 4), torch._foreach_abs(xs), torch._foreach_neg(ys)]

    xs = tuple(t.round().long() for t in tensors(torch.float32, low=-9, high=9, lists=2))
    check(fn, *xs)


def _addc_inputs(dtype):
    ts = tensors(dtype, lists=3)
    return ts[:10] + tuple(t.abs() + 0.5 for t in ts[10:])  # divisors away from 0


@pytest.mark.parametrize("dtype", FLOATS)
def test_addcmul_addcdiv(dtype, check):
    """Scalar (default and given) and ScalarList values; eager computes bf16 in float32 and
    rounds once, which the comparison's bf16 tolerance (1 ulp) checks."""

    def fn(*ts):
        s, a, b = split(ts, 3)
        out = []
        for op in (torch._foreach_addcmul, torch._foreach_addcdiv):
            out += [op(s, a, b), op(s, a, b, 0.5), op(s, a, b, [0.5, -2.0, 3.0, 0.25, 1])]
        return out

    check(fn, *_addc_inputs(dtype))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["addcmul", "addcdiv"])
def test_addcmul_addcdiv_tensor_values(op, dtype):
    """The .Tensor overloads (one value per tensor in a 1-D tensor) cannot be compiled: their
    CPU kernel insists on CPU `scalars` and has no meta kernel, so Dynamo's fake-tensor run
    fails before fx2xla sees a graph. Their decomposition is checked directly against eager
    (default tolerances: eager's addcmul kernel rounds (value * t1) * t2 + self as one fma)."""
    s, a, b = split(_addc_inputs(dtype), 3)
    values = torch.tensor([0.5, -2.0, 3.0, 0.25, 1.0], dtype=torch.float64)
    overload = getattr(aten, f"_foreach_{op}").Tensor
    actual = decompositions.decomposition_table()[overload](s, a, b, values)
    expected = overload(s, a, b, values)
    assert len(actual) == len(expected)
    for x, e in zip(actual, expected):
        assert x.dtype == e.dtype and x.shape == e.shape
        torch.testing.assert_close(x, e)


@pytest.mark.parametrize("dtype", FLOATS)
def test_lerp(dtype, check):
    def fn(*ts):
        s, e, w = split(ts, 3)
        return (torch._foreach_lerp(s, e, w), torch._foreach_lerp(s, e, 0.1),
                torch._foreach_lerp(s, e, [0.1, 0.9, 0.5, -0.25, 1.5]))

    check(fn, *tensors(dtype, lists=3))


@pytest.mark.parametrize("dtype", FLOATS)
def test_norm_max_powsum(dtype, check):
    """clip_grad_norm_'s reductions: one 0-d result per tensor (0 for an empty tensor)."""

    def fn(*ts):
        xs = list(ts)
        return (torch._foreach_norm(xs), torch._foreach_norm(xs, 1), torch._foreach_norm(xs, 3.0),
                torch._foreach_norm(xs, 2, dtype=torch.float32), aten._foreach_powsum.Scalar(xs, 2),
                aten._foreach_powsum.Scalar(xs, 3.0, dtype=torch.float32))

    def nonempty(*ts):
        # inf-norm and max of an empty tensor raise in eager.
        xs = list(ts)
        return torch._foreach_norm(xs, float("inf")), aten._foreach_max.default(xs)

    check(fn, *tensors(dtype))
    check(nonempty, *tensors(dtype, NONEMPTY))


def test_powsum_edge_orders(check):
    """linalg._powsum (behind _foreach_powsum) is literally sum(|x| ** ord): 0 ** 0 = 1."""

    def fn(x):
        return [aten._foreach_powsum.Scalar([x], o)[0] for o in (0, 1, 0.5, -1, float("inf"))]

    check(fn, torch.tensor([1.0, -2.0, 0.0, 3.0]))
    check(fn, torch.tensor([1.0, -2.0, 0.5, 3.0]))


@pytest.mark.parametrize("dtype", FLOATS)
def test_mm(dtype, check):
    def fn(a, b, c, d):
        return aten._foreach_mm.default([a, c], [b, d])

    g = torch.Generator().manual_seed(0)
    a, b, c, d = (torch.randn(s, generator=g).to(dtype) for s in [(3, 4), (4, 5), (2, 0), (0, 6)])
    check(fn, a, b, c, d, tol_scale=2)


@pytest.mark.parametrize("dtype", FLOATS)
def test_copy_zero_clone(dtype, check):
    def fn(*ts):
        xs, ys, zs = split(ts, 3)
        torch._foreach_copy_(xs, ys)
        torch._foreach_zero_(zs)
        clones = aten._foreach_clone.default(ys)
        return xs, zs, clones, aten._foreach_zero.default(ys)

    check(fn, *tensors(dtype, lists=3))


@pytest.mark.parametrize("dtype", FLOATS)
def test_inplace_optimizer_pattern(dtype, check):
    """Adam's foreach update on lists in place: functionalization rewrites every `_foreach_x_`
    to `_foreach_x` plus a copy back into the inputs, which must land in the caller's tensors."""

    def fn(lr, *ts):
        params, grads, m, v = split(ts, 4)
        torch._foreach_lerp_(m, grads, 0.1)
        torch._foreach_mul_(v, 0.999)
        torch._foreach_addcmul_(v, grads, grads, 0.001)
        denom = torch._foreach_sqrt(v)
        torch._foreach_add_(denom, 1e-8)
        torch._foreach_addcdiv_(params, m, denom, -0.01)
        torch._foreach_mul_(params, lr)
        torch._foreach_maximum_(params, -1.0)
        return params, m, v

    ts = tensors(dtype, lists=4)
    ts = ts[:15] + tuple(t.abs() for t in ts[15:])  # v >= 0
    check(fn, torch.tensor(0.5, dtype=dtype), *ts)
