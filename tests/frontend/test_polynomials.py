"""Orthogonal polynomials and Airy Ai (fx2xla/lowering/polynomials.py) against eager PyTorch.

Every function is compiled with `backend="fx2xla", fullgraph=True, options={"fallback": "error"}`,
so an op without a rule fails the test instead of running eagerly, and compared with eager on the
same inputs with torch.testing.assert_close (NaN == NaN; dtypes must match). Tolerances:
  float64: rtol 1e-10, atol 1e-10 (the rules port torch's recurrences and closed forms; only
           XLA's float64 acos/cos/sin differ from glibc's, by an ulp or so, amplified by n <= 20).
  float32: rtol 1e-5, atol 1e-5 (transcendental functions are evaluated in float64 and rounded,
           so results agree with torch's to an ulp or two; atol covers values near the roots,
           where a one-ulp difference in acos is multiplied by n).
Eager's loops for U/V/W, the shifted Chebyshev polynomials, Laguerre and Legendre read an
uninitialised variable for NaN x and degree >= 2 (their `T r;` is returned when `!isnan(q)` stops
the loop before its first step): eager returns garbage there (0.0, 1.0, denormals), so those
entries are checked to be NaN instead of compared.
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
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
}

POLYNOMIALS = {
    "chebyshev_t": S.chebyshev_polynomial_t, "chebyshev_u": S.chebyshev_polynomial_u,
    "chebyshev_v": S.chebyshev_polynomial_v, "chebyshev_w": S.chebyshev_polynomial_w,
    "shifted_chebyshev_t": S.shifted_chebyshev_polynomial_t, "shifted_chebyshev_u": S.shifted_chebyshev_polynomial_u,
    "shifted_chebyshev_v": S.shifted_chebyshev_polynomial_v, "shifted_chebyshev_w": S.shifted_chebyshev_polynomial_w,
    "hermite_h": S.hermite_polynomial_h, "hermite_he": S.hermite_polynomial_he,
    "laguerre_l": S.laguerre_polynomial_l, "legendre_p": S.legendre_polynomial_p,
}
# Defined for NaN x at every degree in eager (r initialised, or no NaN test in the loop).
NAN_DEFINED = {"chebyshev_t", "hermite_h", "hermite_he"}
DEGREES = [-1, 0, 1, 2, 5, 7, 12]


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})


def assert_all_close(got: dict, want: dict, tol: dict):
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        assert g.dtype == w.dtype, (name, g.dtype, w.dtype)
        torch.testing.assert_close(g, w, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}", **tol)


def x_values(dtype):
    """[-2, 2] in steps of 0.1, exactly +-1, 0, 0.5 (the shifted polynomials' x = 0, 1 and
    centre), and values just inside (-1, 1) where the closed forms' degenerate tests apply."""
    grid = torch.linspace(-2, 2, 41, dtype=torch.float64)
    extra = torch.tensor([1.0, -1.0, 0.0, -0.0, 0.5, 0.999999, -0.999999, 1e-7])
    return torch.cat([grid, extra]).to(dtype)


def all_polynomials(x, n):
    out = {name: fn(x, n) for name, fn in POLYNOMIALS.items()}
    out.update({f"{name}_x_scalar": fn(0.3, n) for name, fn in POLYNOMIALS.items()})
    out.update({f"{name}_n_scalar": fn(x, 7) for name, fn in POLYNOMIALS.items()})
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_polynomials_match_eager(dtype):
    """All twelve polynomials on x in [-2, 2] (plus +-1, 0, 0.5) against degrees {-1, 0, 1, 2,
    5, 7, 12} broadcast as tensors (the special cases, the recurrences and the high-degree
    closed forms), and their Scalar-x (x = 0.3) and Scalar-n (n = 7) overloads."""
    x = x_values(dtype)[:, None]
    n = torch.tensor(DEGREES, dtype=dtype)[None, :]
    assert_all_close(compiled(all_polynomials)(x, n), all_polynomials(x, n), TOL[dtype])


def test_polynomials_int64_degree_and_int_x():
    """An int64 degree tensor with float32 x (n cast to float32, then truncated as torch does),
    and integer x with integer n (both promoted to float32)."""
    def fn(x, n, xi):
        return {**{name: f(x, n) for name, f in POLYNOMIALS.items()},
                **{f"{name}_int": f(xi, n) for name, f in POLYNOMIALS.items()}}

    x = x_values(torch.float32)[:, None]
    n = torch.tensor(DEGREES, dtype=torch.int64)[None, :]
    xi = torch.tensor([-2, -1, 0, 1, 2, 3], dtype=torch.int64)[:, None]
    assert_all_close(compiled(fn)(x, n, xi), fn(x, n, xi), TOL[torch.float32])


def test_polynomials_degree_edge_cases():
    """Degrees torch truncates (2.7 -> 2, -0.5 -> 0, so degree 0), high degrees (20: closed forms
    and long recurrences; 130 and 600: past Hermite's float/double limits 128 and 512, NaN), and
    NaN/inf/huge degrees (torch's int64 cast gives INT64_MIN: the polynomial is 0), in float64."""
    x = x_values(torch.float64)[:, None]
    n = torch.tensor([2.7, -0.5, -1.5, 20, 130, 600, nan, inf, -inf, 1e19, 1e30], dtype=torch.float64)[None, :]
    assert_all_close(compiled(all_polynomials)(x, n), all_polynomials(x, n), TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_polynomials_nan_x(dtype):
    """NaN x: NaN for degree >= 1, 1 for degree 0, 0 for negative degrees (as eager); where eager
    reads an uninitialised value (see the module docstring) the compiled result is NaN."""
    x = torch.tensor([nan], dtype=dtype)[:, None]
    n = torch.tensor(DEGREES, dtype=dtype)[None, :]
    got, want = compiled(all_polynomials)(x, n), all_polynomials(x, n)
    for name in POLYNOMIALS:
        g, w = got[name][0], want[name][0]
        defined = (n[0] <= 1) if name not in NAN_DEFINED else torch.ones_like(n[0], dtype=torch.bool)
        torch.testing.assert_close(g[defined], w[defined], equal_nan=True, msg=lambda m, k=name: f"{k}: {m}")
        assert torch.isnan(g[~defined]).all(), (name, g)
        assert got[name].dtype == want[name].dtype


@pytest.mark.parametrize("name", ["chebyshev_polynomial_t", "shifted_chebyshev_polynomial_w",
                                  "hermite_polynomial_h", "laguerre_polynomial_l", "airy_ai"])
@pytest.mark.parametrize("dtype,label", [(torch.bfloat16, "BFloat16"), (torch.float16, "Half")])
def test_bfloat16_float16_rejected_as_eager(name, dtype, label):
    """These CPU kernels are dispatched for float and double only: eager raises '"<op>_cpu" not
    implemented for 'BFloat16'' (or 'Half'); the compiled function raises
    fx2xla.InvalidInputError with that message."""
    f = getattr(S, name)
    fn = f if name == "airy_ai" else (lambda x: f(x, x))
    x = torch.ones(3, dtype=dtype)
    message = f'"{name}_cpu" not implemented for \'{label}\''
    with pytest.raises(RuntimeError, match=message):
        fn(x)
    with pytest.raises(fx2xla.InvalidInputError, match=message):
        compiled(fn)(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_airy_ai_matches_eager(dtype):
    """Airy Ai on [-10, 10] (the oscillating expansion below -2.09, the series between, the
    decaying expansion above 2.09 and past 8.3203353), its branch points, the underflow cut at
    103.892, +-inf (NaN) and NaN; int64 input promotes to float32."""
    x = torch.cat([torch.linspace(-10, 10, 401, dtype=torch.float64),
                   torch.tensor([-2.09, 2.09, 8.3203353, 50.0, 103.0, 104.0, 1e6, -1e3, inf, -inf, nan])]).to(dtype)
    xi = torch.arange(-10, 11, dtype=torch.int64)

    def fn(x, xi):
        return {"airy": S.airy_ai(x), "airy_int": S.airy_ai(xi)}

    got, want = compiled(fn)(x, xi), fn(x, xi)
    assert_all_close({"airy": got["airy"]}, {"airy": want["airy"]}, TOL[dtype])
    assert_all_close({"airy_int": got["airy_int"]}, {"airy_int": want["airy_int"]}, TOL[torch.float32])
