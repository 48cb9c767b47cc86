"""addmv, addbmm, bilinear (_trilinear), dist, complex, polar, narrow_copy, unbind_copy,
diagonal_scatter and as_strided_scatter compiled with fx2xla (fallback="error": an op without
a rule fails) against eager.

Tolerances (assert_close): float32 rtol 1e-5 atol 1e-5 (products: rtol 1.3e-5, atol 1e-5 —
XLA and eager sum in other orders); float64 and complex128 rtol/atol 1e-10; bf16 rtol 1.6e-2
atol 1e-2; complex64 as float32; integers, bool and the pure data movements (copies and
scatters) exact.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo

import fx2xla  # noqa: F401  (registers the backend)

TOL = {
    torch.float32: dict(rtol=1.3e-5, atol=1e-5),
    torch.complex64: dict(rtol=1.3e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.complex128: dict(rtol=1e-10, atol=1e-10),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", options={"fallback": "error"})


def _check(fn, *args, exact=False, **kwargs):
    expected = fn(*args, **kwargs)
    actual = _compile(fn)(*args, **kwargs)
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        pairs = list(zip(actual, expected))
    else:
        pairs = [(actual, expected)]
    for a, e in pairs:
        assert a.dtype == e.dtype and a.shape == e.shape
        tol = dict(rtol=0, atol=0) if exact else TOL.get(e.dtype, dict(rtol=0, atol=0))
        torch.testing.assert_close(a, e, equal_nan=True, **tol)


def _rand(*shape, dtype=torch.float32):
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    return torch.randint(-5, 6, shape, dtype=dtype)


# ---------------------------------------------------------------- addmv / addbmm

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.complex64, torch.complex128])
def test_addmv_dtypes(dtype):
    torch.manual_seed(0)
    beta, alpha = ((1 + 2j), (2 - 1j)) if dtype.is_complex else (2, 3)
    self, mat, vec = _rand(5, dtype=dtype), _rand(5, 7, dtype=dtype), _rand(7, dtype=dtype)
    _check(lambda s, m, v: torch.addmv(s, m, v), self, mat, vec)
    _check(lambda s, m, v: torch.addmv(s, m, v, beta=beta, alpha=alpha), self, mat, vec)


def test_addmv_broadcast_noncontiguous_empty():
    torch.manual_seed(0)
    mat_t = torch.randn(6, 4).t()  # [4, 6], transposed buffer
    vec = torch.randn(12)[::2]  # strided
    _check(lambda s, m, v: torch.addmv(s, m, v, alpha=0.5), torch.randn(1), mat_t, vec)
    _check(lambda s, m, v: torch.addmv(s, m, v), torch.randn(()), mat_t, vec)
    # empty contraction: beta * self only; empty rows: empty result
    _check(lambda s, m, v: torch.addmv(s, m, v, beta=3), torch.randn(4), torch.randn(4, 0), torch.randn(0))
    _check(lambda s, m, v: torch.addmv(s, m, v), torch.randn(0), torch.randn(0, 3), torch.randn(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_addmv_beta_zero_ignores_nan_in_self(dtype):
    torch.manual_seed(0)
    mat, vec = _rand(3, 4, dtype=dtype), _rand(4, dtype=dtype)
    self = torch.full((3,), float("nan")) if dtype.is_floating_point else torch.zeros(3, dtype=dtype)
    self = self.to(dtype)
    fn = lambda s, m, v: torch.addmv(s, m, v, beta=0, alpha=2)  # noqa: E731
    out = _compile(fn)(self, mat, vec)
    assert not torch.isnan(out.float()).any()
    _check(fn, self, mat, vec)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64,
                                   torch.complex64, torch.complex128])
def test_addbmm_dtypes(dtype):
    torch.manual_seed(0)
    beta, alpha = ((1 + 2j), (2 + 3j)) if dtype.is_complex else (2, 3)
    self, b1, b2 = _rand(5, 6, dtype=dtype), _rand(3, 5, 4, dtype=dtype), _rand(3, 4, 6, dtype=dtype)
    _check(lambda s, a, b: torch.addbmm(s, a, b), self, b1, b2)
    _check(lambda s, a, b: torch.addbmm(s, a, b, beta=beta, alpha=alpha), self, b1, b2)


def test_addbmm_broadcast_noncontiguous_empty_beta_zero():
    torch.manual_seed(0)
    b1 = torch.randn(3, 4, 5).transpose(1, 2)  # [3, 5, 4], non-contiguous
    b2 = torch.randn(6, 4, 3).permute(2, 1, 0)  # [3, 4, 6]
    _check(lambda s, a, b: torch.addbmm(s, a, b), torch.randn(6), b1, b2)
    _check(lambda s, a, b: torch.addbmm(s, a, b, beta=0.5), torch.randn(5, 1), b1, b2)
    nan = torch.full((5, 6), float("nan"))
    _check(lambda s, a, b: torch.addbmm(s, a, b, beta=0), nan, b1, b2)
    assert not torch.isnan(_compile(lambda s, a, b: torch.addbmm(s, a, b, beta=0))(nan, b1, b2)).any()
    # empty batch: beta * self
    _check(lambda s, a, b: torch.addbmm(s, a, b, beta=2), torch.randn(5, 6), torch.randn(0, 5, 4), torch.randn(0, 4, 6))


def test_addmv_mixed_dtypes_rejected():
    fn = _compile(lambda s, m, v: torch.addmv(s, m, v))
    with pytest.raises(Exception, match="same dtype"):
        fn(torch.randn(3), torch.randn(3, 2, dtype=torch.float64), torch.randn(2))


# ---------------------------------------------------------------- bilinear / _trilinear

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_bilinear(dtype):
    torch.manual_seed(0)
    x1, x2 = _rand(7, 3, dtype=dtype), _rand(7, 4, dtype=dtype)
    w, b = _rand(5, 3, 4, dtype=dtype), _rand(5, dtype=dtype)
    _check(lambda a, c, w: torch.nn.functional.bilinear(a, c, w), x1, x2, w)
    _check(lambda a, c, w, b: torch.nn.functional.bilinear(a, c, w, b), x1, x2, w, b)


def test_bilinear_batch_dims_noncontiguous_empty():
    torch.manual_seed(0)
    x1 = torch.randn(3, 2, 6)[..., ::2]  # [3, 2, 3], strided
    x2 = torch.randn(4, 2, 3).permute(2, 1, 0)  # [3, 2, 4]
    w = torch.randn(5, 3, 4)
    _check(lambda a, c, w: torch.nn.functional.bilinear(a, c, w), x1, x2, w)
    _check(lambda a, c, w: torch.nn.functional.bilinear(a, c, w), torch.randn(0, 3), torch.randn(0, 4), w)


def test_trilinear_direct():
    torch.manual_seed(0)
    i1, i2, i3 = torch.randn(2, 3), torch.randn(4, 3), torch.randn(2, 4)
    fn = lambda a, b, c: torch.ops.aten._trilinear(a, b, c, [1], [0], [2], [2])  # noqa: E731
    _check(fn, i1, i2, i3)


# ---------------------------------------------------------------- dist

@pytest.mark.parametrize("p", [2, 1, 0, 3.5, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.complex64, torch.complex128])
def test_dist(dtype, p):
    torch.manual_seed(0)
    a, b = _rand(4, 5, dtype=dtype), _rand(4, 5, dtype=dtype)
    b[0, 0] = a[0, 0]  # one zero difference (p = 0 counts the others)
    _check(lambda x, y: torch.dist(x, y, p), a, b)


def test_dist_broadcast_promotion_noncontiguous_empty():
    torch.manual_seed(0)
    _check(lambda x, y: torch.dist(x, y), torch.randn(3, 4).t(), torch.randn(3))
    _check(lambda x, y: torch.dist(x, y), torch.randn(3), torch.randn(2, 3, dtype=torch.float64))
    _check(lambda x, y: torch.dist(x, y), torch.randn(3, dtype=torch.bfloat16), torch.randn(3))
    _check(lambda x, y: torch.dist(x, y), torch.randn(3, dtype=torch.complex64), torch.randn(3))
    _check(lambda x, y: torch.dist(x, y, 1), torch.randn(0, 3), torch.randn(0, 3))


# ---------------------------------------------------------------- complex / polar

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_complex_and_polar(dtype):
    torch.manual_seed(0)
    re, im = torch.randn(4, 1, dtype=dtype), torch.randn(3, dtype=dtype)
    _check(torch.complex, re, im)
    _check(torch.polar, re.abs(), im)
    _check(torch.complex, torch.randn(5, 4, dtype=dtype).t(), torch.randn(4, 5, dtype=dtype))
    _check(torch.polar, torch.rand(0, 2, dtype=dtype), torch.randn(2, dtype=dtype))
    special = torch.tensor([0.0, 1.0, math.inf, math.nan], dtype=dtype)
    _check(torch.polar, special, torch.tensor([0.0, math.pi, 0.0, 1.0], dtype=dtype))
    _check(torch.complex, special, special.flip(0))


# ---------------------------------------------------------------- view copies and scatters

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_narrow_copy_unbind_copy(dtype):
    torch.manual_seed(0)
    x = _rand(4, 5, 6, dtype=dtype)
    _check(lambda t: torch.narrow_copy(t, 1, 2, 2), x, exact=True)
    _check(lambda t: torch.narrow_copy(t, -1, -4, 3), x, exact=True)
    _check(lambda t: torch.narrow_copy(t, 0, 1, 0), x, exact=True)
    _check(lambda t: torch.narrow_copy(t, 2, 1, 3), x.transpose(0, 2), exact=True)
    _check(lambda t: torch.unbind_copy(t), x, exact=True)
    _check(lambda t: torch.unbind_copy(t, -1), x[:, ::2], exact=True)
    _check(lambda t: torch.unbind_copy(t, 1), _rand(3, 0, dtype=dtype), exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex128])
def test_diagonal_scatter(dtype):
    torch.manual_seed(0)
    x = _rand(4, 6, dtype=dtype)
    for offset in (0, 2, -1, 5, -3):
        src = _rand(torch.diagonal(x, offset).shape[0], dtype=dtype)
        _check(lambda t, s, o=offset: torch.diagonal_scatter(t, s, o), x, src, exact=True)
    y = _rand(3, 4, 5, dtype=dtype)
    src = _rand(*torch.diagonal(y, 1, 2, 0).shape, dtype=dtype)
    _check(lambda t, s: torch.diagonal_scatter(t, s, 1, 2, 0), y, src, exact=True)
    _check(lambda t, s: torch.diagonal_scatter(t, s, -1, -1, 0), y.transpose(0, 1), _rand(*torch.diagonal(
        y.transpose(0, 1), -1, -1, 0).shape, dtype=dtype), exact=True)
    # an empty diagonal (offset past the end) leaves the input unchanged
    _check(lambda t, s: torch.diagonal_scatter(t, s, 6), x, _rand(0, dtype=dtype), exact=True)


def test_diagonal_scatter_promotes_nothing():
    x, src = torch.zeros(3, 3), torch.arange(3.0)
    _check(lambda t, s: torch.diagonal_scatter(t, s), x, src, exact=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_as_strided_scatter(dtype):
    torch.manual_seed(0)
    x = _rand(4, 5, dtype=dtype)
    _check(lambda t, s: torch.as_strided_scatter(t, s, (2, 2), (5, 1), 3), x, _rand(2, 2, dtype=dtype), exact=True)
    _check(lambda t, s: torch.as_strided_scatter(t, s, (3,), (6,)), x, _rand(3, dtype=dtype), exact=True)
    _check(lambda t, s: torch.as_strided_scatter(t, s, (4, 5), (5, 1)), x, _rand(4, 5, dtype=dtype), exact=True)
    _check(lambda t, s: torch.as_strided_scatter(t, s, (), (), 7), x, _rand(dtype=dtype), exact=True)
    _check(lambda t, s: torch.as_strided_scatter(t, s, (0, 2), (1, 1)), x, _rand(0, 2, dtype=dtype), exact=True)
    # a transposed (dense, non-contiguous) input: positions follow its strides
    _check(lambda t, s: torch.as_strided_scatter(t, s, (2, 3), (1, 4), 1), x.t(), _rand(2, 3, dtype=dtype),
           exact=True)


def test_addmv_integer_scalars_truncate_like_eager():
    s, m, v = torch.tensor([5, 7, 9]), torch.ones(3, 2, dtype=torch.long), torch.tensor([1, 2])
    for beta, alpha in [(0.5, 1), (2.7, 1.9), (-1.5, 2)]:
        _check(lambda a, b, c, beta=beta, alpha=alpha: torch.addmv(a, b, c, beta=beta, alpha=alpha), s, m, v)
