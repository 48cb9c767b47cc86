"""Special-function lowerings (fx2xla/lowering/special.py) against eager PyTorch.

Every function is compiled with `backend="fx2xla", fullgraph=True, options={"fallback": "error"}`,
so an op without a rule fails the test instead of running eagerly, and compared with eager on the
same inputs. Tolerances (assert_close, NaN == NaN, infinities and signs must match):
  float64: rtol 1e-12, atol 1e-12 (the rules port torch's own algorithms, or use jax's ports of
           the same Cephes expansions).
  float32: rtol 1e-5, atol 1e-6. The atol also absorbs results below float32's normal range:
           XLA:CPU flushes subnormals to zero where torch keeps them (e.g. K0(100) ~ 4.6e-45).
           igamma/igammac: rtol 5e-5, since torch evaluates the series in float32 and some
           terms (pow(x / fac, a) near a ~ 100) are subnormal in its arithmetic, losing ~1e-5
           relative, where the rule keeps them in double.
  bfloat16: rtol 1.6e-2, atol 1e-2 (torch computes these in float32 and rounds; the OpInfo
           sweep's bf16 tolerance).
  integer outputs (gcd, lcm, frexp's exponent): exact.
"""
from __future__ import annotations

import math

import pytest
import torch

import fx2xla

S = torch.special
nan, inf = math.nan, math.inf
pytestmark = pytest.mark.filterwarnings("error:fx2xla. .* has no lowering rule:UserWarning")

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}
IGAMMA_F32 = dict(rtol=5e-5, atol=1e-6)


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})


def assert_all_close(got: dict, want: dict, tol: dict, overrides: dict | None = None):
    """Every named output: same dtype and shape as eager, values within `tol` (or its override)."""
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}",
                                   **(overrides or {}).get(name, tol))


# Unary ops of one float argument (int inputs promote to float32).
UNARY = {
    "i0e": S.i0e, "i1": S.i1, "i1e": S.i1e, "erfcx": S.erfcx,
    "modified_bessel_i0": S.modified_bessel_i0, "modified_bessel_i1": S.modified_bessel_i1,
    "modified_bessel_k0": S.modified_bessel_k0, "modified_bessel_k1": S.modified_bessel_k1,
    "scaled_modified_bessel_k0": S.scaled_modified_bessel_k0,
    "scaled_modified_bessel_k1": S.scaled_modified_bessel_k1,
    "bessel_j0": S.bessel_j0, "bessel_j1": S.bessel_j1, "bessel_y0": S.bessel_y0, "bessel_y1": S.bessel_y1,
    "spherical_bessel_j0": S.spherical_bessel_j0,
    "polygamma0": lambda x: torch.polygamma(0, x), "polygamma1": lambda x: torch.polygamma(1, x),
    "polygamma2": lambda x: torch.polygamma(2, x), "polygamma5": lambda x: torch.polygamma(5, x),
}


def unary_all(x, p):
    out = {name: fn(x) for name, fn in UNARY.items()}
    out["ndtri"] = S.ndtri(p)
    return out


# Spanning every approximation range: |x| <= 1e-5 (J0's series), <= 2 (K's), <= 5 (J/Y's
# rational), <= 8 (I's first expansion), beyond (asymptotic forms), huge, negative, zeros, inf, NaN.
POINTS = [0.0, -0.0, 1e-30, 3e-6, -3e-6, 0.1, 0.49, 0.5, 1.0, 1.5, 2.0, 2.01, 3.7, 5.0, 5.01, 7.9, 8.0, 8.1,
          12.5, 30.0, 85.0, 100.0, 700.0, 1e4, -0.3, -1.0, -2.5, -4.99, -7.5, -9.0, -40.0, inf, -inf, nan]
PROBS = [0.0, 1.0, 1e-300, 1e-30, 1e-6, 0.02, 0.135, 0.5, 0.8647, 0.99, 1 - 1e-7, -0.1, 1.1, nan]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_special_unary_ops_match_eager(dtype):
    """All unary special functions (i0e, i1, i1e, erfcx, ndtri, modified Bessel I0/I1/K0/K1 and
    scaled K0/K1, Bessel J0/J1/Y0/Y1, spherical J0, polygamma n = 0, 1, 2, 5), compiled as one
    graph on a non-contiguous input spanning every approximation range and the special values:
    each output has eager's dtype and matches eager within the dtype's tolerance."""
    points = torch.tensor(POINTS, dtype=dtype)
    x = torch.stack([points, -points], 1)[:, 0]  # stride 2
    p = torch.tensor(PROBS, dtype=dtype)
    assert not x.is_contiguous()
    got = compiled(unary_all)(x, p)
    assert_all_close(got, unary_all(x, p), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_special_unary_ops_zero_dim_empty_and_int(dtype):
    """The unary special functions on a 0-d tensor and on an empty tensor (float32), and on int64
    inputs (promoted to float32 as torch's INT_TO_FLOAT does; for int64 also zeta, and igamma /
    igammac of an int64 and a float32 operand): results have eager's dtype and shape and match
    eager at float32 tolerance."""
    if dtype == torch.int64:
        x = torch.tensor([-3, -1, 0, 1, 2, 5, 9, 30])
        p = torch.tensor([0, 1, 0, 1])

        def fn(x, p):
            out = unary_all(x, p)
            y = x.flip(0).float()
            out.update(igamma=torch.igamma(x, y), igammac=torch.igammac(y, x), zeta=S.zeta(x, x.flip(0)))
            return out

        got, want = compiled(fn)(x, p), fn(x, p)
        assert all(v.dtype == torch.float32 for v in want.values())
        assert_all_close(got, want, TOL[torch.float32])
        return
    f = compiled(unary_all)
    for x, p in ((torch.tensor(2.5, dtype=dtype), torch.tensor(0.3, dtype=dtype)),
                 (torch.empty(0, 3, dtype=dtype), torch.empty(0, dtype=dtype))):
        got = f(x, p)
        assert all(v.shape == x.shape for k, v in got.items() if k != "ndtri")
        assert got["ndtri"].shape == p.shape
        assert_all_close(got, unary_all(x, p), TOL[dtype])


@pytest.mark.parametrize("fn,a,b,message", [
    (torch.igamma, torch.int64, torch.int64, '"igamma_cpu" not implemented for \'Long\''),
    (torch.igammac, torch.int32, torch.bool, '"igammac_cpu" not implemented for \'Int\''),
    (torch.gcd, torch.int64, torch.float32, '"gcd_cpu" not implemented for \'Float\''),
    (torch.lcm, torch.float64, torch.float64, '"lcm_cpu" not implemented for \'Double\''),
])
def test_special_common_dtype_rejected_as_eager(fn, a, b, message):
    """igamma/igammac of integer operands and gcd/lcm of float operands: torch's CPU kernels
    dispatch on the operands' common dtype and raise; the compiled function raises
    fx2xla.InvalidInputError with eager's message."""
    x, y = torch.ones(3, dtype=a), torch.ones(3, dtype=b)
    with pytest.raises(RuntimeError, match=message):
        fn(x, y)
    with pytest.raises(fx2xla.InvalidInputError, match=message):
        compiled(fn)(x, y)


A_VALUES = [0.0, 1e-8, 0.3, 0.5, 1.0, 1.05, 2.0, 4.5, 10.0, 25.0, 60.0, 150.0, 250.0, 1e4, -0.5, inf, nan]
X_VALUES = [0.0, 1e-8, 0.3, 0.5, 0.9, 1.0, 1.08, 1.2, 2.0, 4.5, 9.0, 21.0, 25.0, 55.0, 160.0, 240.0, 1e4,
            -1.0, inf, nan]
ZETA_X = [1.0, 0.5, -2.0, 1.5, 2.0, 3.0, 4.5, 10.0, 60.0, inf, nan]
ZETA_Q = [0.0, -0.0, -1.0, -2.5, -3.7, -10.0, 1e-8, 0.3, 1.0, 2.0, 7.9, 9.5, 100.0, 1e10, inf, nan]


def binary_all(a, x, zx, zq):
    return {"igamma": torch.igamma(a, x), "igammac": torch.igammac(a, x), "zeta": S.zeta(zx, zq),
            "zeta_self_scalar": S.zeta(2.0, zq), "zeta_other_scalar": S.zeta(zx, 2.5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_special_igamma_zeta_match_eager(dtype):
    """igamma, igammac (every branch: series, continued fraction, asymptotic a ~ x with a in
    (20, 200) and > 200, boundaries a = 0, x = 0, negative, inf, NaN) and zeta in its three
    overloads (Tensor-Tensor, Scalar self, Scalar other; x = 1, x < 1, q <= 0 integral and not,
    large q), on broadcast operands: eager's dtype, values within tolerance (igamma/igammac
    float32: rtol 5e-5, see the module docstring)."""
    a = torch.tensor(A_VALUES, dtype=dtype)[:, None]
    x = torch.tensor(X_VALUES, dtype=dtype)[None, :]
    zx = torch.tensor(ZETA_X, dtype=dtype)[:, None]
    zq = torch.tensor(ZETA_Q, dtype=dtype)[None, :]
    got = compiled(binary_all)(a, x, zx, zq)
    overrides = {"igamma": IGAMMA_F32, "igammac": IGAMMA_F32} if dtype == torch.float32 else None
    assert_all_close(got, binary_all(a, x, zx, zq), TOL[dtype], overrides)


def bf16_all(x, a):
    return {"i0e": S.i0e(x), "i1": S.i1(x), "i1e": S.i1e(x), "polygamma0": torch.polygamma(0, x),
            "polygamma1": torch.polygamma(1, x), "polygamma3": torch.polygamma(3, x),
            "igamma": torch.igamma(a, x.abs()), "igammac": torch.igammac(a, x.abs())}


def test_special_bfloat16_computed_in_float32():
    """The ops torch's CPU kernels support for bfloat16 (i0e, i1, i1e, polygamma, igamma,
    igammac): bf16 results matching eager within the bf16 tolerance."""
    x = torch.tensor([0.0, 0.1, 0.5, 1.0, 2.5, 7.0, 9.0, 40.0, -0.5, -3.5, -12.0], dtype=torch.bfloat16)
    a = torch.tensor([0.5, 1.0, 2.0, 3.0, 4.0, 8.0, 9.0, 30.0, 0.2, 1.5, 2.0], dtype=torch.bfloat16)
    assert_all_close(compiled(bf16_all)(x, a), bf16_all(x, a), TOL[torch.bfloat16])


@pytest.mark.parametrize("name,fn", [("ndtri", S.ndtri), ("erfcx", S.erfcx), ("zeta", lambda x: S.zeta(x, 2.0)),
                                     ("modified_bessel_k0", S.modified_bessel_k0), ("bessel_y1", S.bessel_y1)])
def test_special_bfloat16_rejected_as_eager(name, fn):
    """Ops whose CPU kernel has no bfloat16 instance: eager raises '"<op>_cpu" not implemented
    for 'BFloat16''; the compiled function raises fx2xla.InvalidInputError with that message."""
    x = torch.ones(3, dtype=torch.bfloat16)
    message = f'"{name}_cpu" not implemented for \'BFloat16\''
    with pytest.raises(RuntimeError, match=message):
        fn(x)
    with pytest.raises(fx2xla.InvalidInputError, match=message):
        compiled(fn)(x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int16, torch.uint8])
def test_gcd_lcm_match_eager(dtype):
    """gcd and lcm over all pairs of zeros, +-1, negatives, coprimes and large values (wrapping
    to the dtype): exactly eager's values and dtype; gcd(0, 0) = 0 and lcm is never negative
    for int64 (torch takes |a / g * b|)."""
    values = [0, 1, -1, 2, -2, 3, 6, -6, 12, -18, 35, 127, -128, 300, 2**40, -(2**40) * 3, 7919 * 104729]
    grid = torch.tensor(values)
    a, b = (t.reshape(-1).to(dtype) for t in torch.meshgrid(grid, grid, indexing="ij"))
    got = compiled(lambda a, b: (torch.gcd(a, b), torch.lcm(a, b)))(a, b)
    for g, w in zip(got, (torch.gcd(a, b), torch.lcm(a, b))):
        assert g.dtype == w.dtype == dtype
        assert torch.equal(g, w)
    if dtype == torch.int64:
        assert got[0][0] == 0 and (got[1] >= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_frexp_matches_eager(dtype):
    """frexp on zeros, +-inf, NaN, normal and subnormal values: the mantissa equals eager's
    (NaN where eager's is) with |m| in [0.5, 1) for finite nonzero x, and the exponent is int32
    and exactly eager's; m * 2**e == x."""
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, 3.0, -7.25, 1e-40, -1e-42, 1e-310, 2.0**-126, 6e-8, 1e30,
                      inf, -inf, nan], dtype=torch.float64).to(dtype)
    m, e = compiled(torch.frexp)(x)
    m_ref, e_ref = torch.frexp(x)
    assert m.dtype == dtype and e.dtype == torch.int32
    assert torch.equal(e, e_ref)
    torch.testing.assert_close(m, m_ref, equal_nan=True, rtol=0, atol=0)
    finite = torch.isfinite(x) & (x != 0)
    assert ((m[finite].abs() >= 0.5) & (m[finite].abs() < 1)).all()
    assert torch.equal(torch.ldexp(m[finite].double(), e[finite]), x[finite].double())
