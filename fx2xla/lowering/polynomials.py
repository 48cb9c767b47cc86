"""Lowering rules: torch.special's orthogonal polynomials (Chebyshev T/U/V/W and their shifted
forms, Hermite H/He, Laguerre L, Legendre P) and the Airy function Ai.

Numerics are ports of PyTorch's CPU kernels (aten/src/ATen/native/Math.h), step for step:

* Both operands are cast to the output dtype (torch.result_type, ints and bools promoted to
  float32: the registry's promote="out"), and the kernels run in that dtype. Their CPU kernels
  are dispatched for float and double only: bfloat16/float16 are rejected with eager's message
  ('"chebyshev_polynomial_t_cpu" not implemented for 'BFloat16'').
* n is data. torch truncates it with `static_cast<int64_t>(n)` (toward zero, so n = -0.5 is
  degree 0); NaN, infinite and out-of-int64-range n give x86's "integer indefinite" (INT64_MIN),
  i.e. a negative degree, for which every polynomial is 0 (Hermite H says so explicitly). The
  rule maps those to -1 (XLA's conversion would saturate instead).
* Special cases come first, in torch's order (n < 0 -> 0; |x| == 1 closed values for Chebyshev
  and Legendre, x == 0/1 for the shifted Chebyshev, x == 0 for Laguerre; Hermite's NaN above
  degree 128 (float) / 512 (double)); then torch's trigonometric closed forms for high degree
  inside (-1, 1) (Chebyshev: n > 6 for T, n > 8 for U/V/W; shifted: n > 6, n > 4 for W); then
  the three-term recurrences. The recurrences run in one `lax.while_loop` over a shared counter
  k, each element stepping while k is below its own degree (and, where torch's loop says
  `!isnan(q)`, while its last value is not NaN); the loop ends when no element steps. The
  integer factors k, 2k + 1, k + 1 enter as torch's int64-to-T conversions, in its order of
  operations.
* Transcendental functions (acos, cos, sin, exp) of float32 values are evaluated in float64 and
  rounded once: glibc's float32 acosf/cosf/sinf/expf are correctly rounded (or nearly), XLA's
  float32 approximations are not, and the closed forms multiply acos's error by n. Products and
  sums stay in the kernel's dtype.
* XLA rewrites `a / broadcast(b)` as `a * broadcast(1 / b)`, an ulp off torch's division: the
  recurrences carry k as a full array (so `/ (k + 1)` stays a division; Laguerre at n = 600 in
  float32 drifted 1e-5 relative otherwise), and Airy's divisions by 3 are formed in float64 for
  float32 (see _div).
* NaN x at degree >= 2: torch's U/V/W, shifted Chebyshev, Laguerre and Legendre loops stop
  before their first step (`!isnan(q)`) and return an uninitialised `T r` (eager gives 0, 1 or
  denormals, varying from call to call); the rules return NaN there, as Chebyshev T (whose r
  starts at x) and Hermite do.
* Airy Ai: Cephes' rational asymptotic expansions for x < -2.09 and x >= 2.09, the Maclaurin
  series (summed until a term is below epsilon, per element in a while_loop) between; Ai(inf)
  and Ai(-inf) are NaN, Ai(x > 103.892) = 0, as torch.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from torch.ops import aten

from .registry import RejectedInput, register_lowering

_F32, _F64 = np.dtype(jnp.float32), np.dtype(jnp.float64)
_REDUCED_NAMES = {np.dtype(jnp.bfloat16): "BFloat16", np.dtype(jnp.float16): "Half"}


def _c(v, dtype):
    """A constant of `dtype` (a C++ `T(v)`: rounded to T once)."""
    return jnp.asarray(v, dtype)


def _reject_reduced(ctx, kernel: str):
    """eager's error for bf16/f16: these CPU kernels are dispatched for float and double only."""
    name = _REDUCED_NAMES.get(np.dtype(ctx.out_dtype))
    if name is not None:
        raise RejectedInput(f'"{kernel}_cpu" not implemented for \'{name}\'')


def _wide(fn):
    """`fn` (a transcendental function) in float64 for float32 arguments, rounded once."""
    def wrapped(v):
        return fn(v.astype(_F64)).astype(v.dtype) if v.dtype == _F32 else fn(v)

    return wrapped


_acos, _cos, _sin, _exp = _wide(lax.acos), _wide(lax.cos), _wide(lax.sin), _wide(lax.exp)


def _degree(n):
    """torch's static_cast<int64_t>(n) of a float degree: truncation toward zero; NaN, infinite
    and out-of-range values give a negative degree (x86's INT64_MIN; -1 here)."""
    bad = jnp.isnan(n) | (lax.abs(n) >= _c(2.0 ** 63, n.dtype))
    return jnp.where(bad, jnp.asarray(-1, jnp.int64), lax.convert_element_type(n, jnp.int64))


def _as(v, dtype):
    """An int64 (C++ integer expression) converted to T."""
    return lax.convert_element_type(v, dtype)


def _recurrence(p, q, active, k0: int, step: int, steps, next_value, nan_stop: bool):
    """torch's `for (k = k0; steps(k); k += step) { r = next_value(k, p, q); p = q; q = r; }`
    per element (those `active`), optionally also stopping where q is NaN. Returns the final q
    (torch's r: equal to q after any step, and q's NaN where no step ran). k is carried as an
    array of q's shape, not a scalar: XLA rewrites a division by a broadcast scalar (Legendre's
    and Laguerre's `/ (k + 1)`) into a multiplication by its reciprocal, off by an ulp."""
    def live(k, q):
        go = active & steps(k)
        return go & ~jnp.isnan(q) if nan_stop else go

    def cond(st):
        k, _, q = st
        return jnp.any(live(k, q))

    def body(st):
        k, p, q = st
        go = live(k, q)
        r = next_value(k, p, q)
        return k + step, jnp.where(go, q, p), jnp.where(go, r, q)

    return lax.while_loop(cond, body, (jnp.full(q.shape, k0, jnp.int64), p, q))[2]


def _chebyshev_recurrence(a, q1, n, active):
    """T/U/V/W's loop: p = 1, q = q1 (the degree-1 value), r = a * q - p for k = 2..n."""
    return _recurrence(jnp.ones_like(q1), q1, active, 2, 1, lambda k: k <= n, lambda k, p, q: a * q - p, True)


def _chebyshev(kind: str, x, n, shifted: bool):
    """chebyshev_polynomial_{t,u,v,w}_forward and their shifted_ forms (x cast to T, n int64)."""
    dt = x.dtype
    t = lambda v: _c(v, dt)  # noqa: E731
    one, zero = t(1.0), t(0.0)
    nf = _as(n, dt)
    n1 = _as(n + 1, dt)  # `n + 1` in int64, then T
    n21 = _as(n + n + 1, dt)
    # y: the argument of the unshifted polynomial; shifted ones spell `x + x - T(1.0)` each time.
    y = x + x - one if shifted else x
    two_y = y + y  # torch: `(x + x)` or `(x + x - 1 + (x + x - 1))`, the same value
    if shifted:
        at_plus, at_minus = x == one, x == zero
    else:
        ax1 = lax.abs(x) == one
        at_plus, at_minus = ax1 & (x > zero), ax1 & ~(x > zero)
    even = lax.rem(n, jnp.asarray(2, jnp.int64)) == 0
    inside = lax.abs(y) < one
    theta = _acos(y)  # torch evaluates acos inside the branch only; its value is not used elsewhere
    if kind == "t":
        plus, minus = one, jnp.where(even, one, -one)
        limit = 6
        closed = _cos(nf * theta)
        q1 = y
    elif kind == "u":
        plus, minus = n1, jnp.where(even, n1, -n1)
        limit = 6 if shifted else 8
        s = _sin(theta)
        closed = jnp.where(s != zero, _sin(n1 * theta) / s, n1 * _cos(n1 * theta) / y)
        q1 = two_y
    elif kind == "v":
        plus, minus = one, jnp.where(even, n21, -n21)
        limit = 6 if shifted else 8
        half = theta / t(2.0)
        closed = jnp.where(_sin(half) != one, _cos((nf + t(0.5)) * theta) / _cos(half), minus)
        q1 = two_y - one
    else:  # "w"
        plus, minus = n21, jnp.where(even, one, -one)
        limit = 4 if shifted else 8
        half = theta / t(2.0)
        # (The unshifted form tests x > 0 in the degenerate branch: cos(acos(x)/2) == 1 only for
        # x near 1, so it is `plus` there; the shifted one returns the sign of n's parity.)
        degenerate = jnp.where(x > zero, plus, minus) if not shifted else minus
        closed = jnp.where(_cos(half) != one, _sin((nf + t(0.5)) * theta) / _sin(half), degenerate)
        q1 = two_y + one
    use_closed = (n > limit) & inside
    special = at_plus | at_minus | use_closed | (n <= 1)
    loop = _chebyshev_recurrence(two_y, q1, n, ~special & (n >= 2))
    out = jnp.where(n == 0, one, jnp.where(n == 1, q1, loop))
    out = jnp.where(use_closed, closed, out)
    out = jnp.where(at_minus, minus, out)
    out = jnp.where(at_plus, plus, out)
    return jnp.where(n < 0, zero, out)


def _hermite_limit(dtype) -> int:
    return 128 if dtype == _F32 else 512


def _hermite_h(x, n):
    dt = x.dtype
    t = lambda v: _c(v, dt)  # noqa: E731
    two_x = x + x
    loop = _recurrence(jnp.ones_like(x), two_x, (n >= 2) & (n <= _hermite_limit(dt)), 2, 2, lambda k: k < n + n,
                       lambda k, p, q: two_x * q - _as(k, dt) * p, False)
    out = jnp.where(n > _hermite_limit(dt), t(math.nan), loop)
    out = jnp.where(n == 1, two_x, jnp.where(n == 0, t(1.0), out))
    return jnp.where(n < 0, t(0.0), out)


def _hermite_he(x, n):
    dt = x.dtype
    t = lambda v: _c(v, dt)  # noqa: E731
    loop = _recurrence(jnp.ones_like(x), x, (n >= 2) & (n <= _hermite_limit(dt)), 1, 1, lambda k: k < n,
                       lambda k, p, q: x * q - _as(k, dt) * p, False)
    out = jnp.where(n > _hermite_limit(dt), t(math.nan), loop)
    out = jnp.where(n == 1, x, jnp.where(n == 0, t(1.0), out))
    return jnp.where(n < 0, t(0.0), out)


def _laguerre(x, n):
    dt = x.dtype
    t = lambda v: _c(v, dt)  # noqa: E731
    one = t(1.0)
    omx = one - x
    zero_x = lax.abs(x) == t(0.0)
    loop = _recurrence(jnp.ones_like(x), omx, ~zero_x & (n >= 2), 1, 1, lambda k: k < n,
                       lambda k, p, q: ((_as(k + k, dt) + (one - x)) * q - _as(k, dt) * p) / _as(k + 1, dt), True)
    out = jnp.where(n == 1, omx, jnp.where(n == 0, one, loop))
    out = jnp.where(zero_x, one, out)
    return jnp.where(n < 0, t(0.0), out)


def _legendre(x, n):
    dt = x.dtype
    t = lambda v: _c(v, dt)  # noqa: E731
    one, zero = t(1.0), t(0.0)
    ax1 = lax.abs(x) == one
    even = lax.rem(n, jnp.asarray(2, jnp.int64)) == 0
    loop = _recurrence(jnp.ones_like(x), x, ~ax1 & (n >= 2), 1, 1, lambda k: k < n,
                       lambda k, p, q: (_as(k + k + 1, dt) * x * q - _as(k, dt) * p) / _as(k + 1, dt), True)
    out = jnp.where(n == 1, x, jnp.where(n == 0, one, loop))
    out = jnp.where(ax1, jnp.where((x > zero) | even, one, -one), out)
    return jnp.where(n < 0, zero, out)


def _binary(packet, kernel: str, fn):
    """Register fn(x, n_int64) for every overload of `packet` (Tensor-Tensor, x_scalar, n_scalar)."""
    def rule(ctx, x, n):
        _reject_reduced(ctx, kernel)
        return fn(x, _degree(n))

    register_lowering(packet, promote="out", broadcast=True)(rule)


for _kind in "tuvw":
    _binary(getattr(aten, f"special_chebyshev_polynomial_{_kind}"), f"chebyshev_polynomial_{_kind}",
            lambda x, n, k=_kind: _chebyshev(k, x, n, shifted=False))
    _binary(getattr(aten, f"special_shifted_chebyshev_polynomial_{_kind}"), f"shifted_chebyshev_polynomial_{_kind}",
            lambda x, n, k=_kind: _chebyshev(k, x, n, shifted=True))
_binary(aten.special_hermite_polynomial_h, "hermite_polynomial_h", _hermite_h)
_binary(aten.special_hermite_polynomial_he, "hermite_polynomial_he", _hermite_he)
_binary(aten.special_laguerre_polynomial_l, "laguerre_polynomial_l", _laguerre)
_binary(aten.special_legendre_polynomial_p, "legendre_polynomial_p", _legendre)


# --- Airy Ai: a port of torch's airy_ai_forward (Cephes) -----------------------------------------

_AN = (3.46538101525629032477e-01, 1.20075952739645805542e+01, 7.62796053615234516538e+01,
       1.68089224934630576269e+02, 1.59756391350164413639e+02, 7.05360906840444183113e+01,
       1.40264691163389668864e+01, 9.99999999999999995305e-01)
_AD = (5.67594532638770212846e-01, 1.47562562584847203173e+01, 8.45138970141474626562e+01,
       1.77318088145400459522e+02, 1.64234692871529701831e+02, 7.14778400825575695274e+01,
       1.40959135607834029598e+01, 1.00000000000000000470e+00)
_AFN = (-1.31696323418331795333e-01, -6.26456544431912369773e-01, -6.93158036036933542233e-01,
        -2.79779981545119124951e-01, -4.91900132609500318020e-02, -4.06265923594885404393e-03,
        -1.59276496239262096340e-04, -2.77649108155232920844e-06, -1.67787698489114633780e-08)
_AFD = (1.33560420706553243746e+01, 3.26825032795224613948e+01, 2.67367040941499554804e+01,
        9.18707402907259625840e+00, 1.47529146771666414581e+00, 1.15687173795188044134e-01,
        4.40291641615211203805e-03, 7.54720348287414296618e-05, 4.51850092970580378464e-07)
_AGN = (1.97339932091685679179e-02, 3.91103029615688277255e-01, 1.06579897599595591108e+00,
        9.39169229816650230044e-01, 3.51465656105547619242e-01, 6.33888919628925490927e-02,
        5.85804113048388458567e-03, 2.82851600836737019778e-04, 6.98793669997260967291e-06,
        8.11789239554389293311e-08, 3.41551784765923618484e-10)
_AGD = (9.30892908077441974853e+00, 1.98352928718312140417e+01, 1.55646628932864612953e+01,
        5.47686069422975497931e+00, 9.54293611618961883998e-01, 8.64580826352392193095e-02,
        4.12656523824222607191e-03, 1.01259085116509135510e-04, 1.17166733214413521882e-06,
        4.91834570062930015649e-09)


def _div(v, c: float):
    """`v / T(c)` rounded as a division. XLA's simplifier turns a division by a broadcast scalar
    into a multiplication by its rounded reciprocal (x / 3 -> x * 0.333333343f, off by an ulp),
    which the Airy phase at x = -1000 (~21082 radians in float32) turns into a 0.3% error. For
    float32 the quotient is formed in float64 (its reciprocal's error, 2^-53, vanishes in the
    rounding to float32); for float64 it stays within an ulp."""
    if v.dtype == _F32:
        return (v.astype(_F64) / _c(c, _F64)).astype(_F32)
    return v / _c(c, v.dtype)


def _horner(coefs, z):
    """torch's `r = 0; r = r * z + C[i]` loops (coefficients highest degree first)."""
    r = jnp.broadcast_to(_c(coefs[0], z.dtype), z.shape)
    for c in coefs[1:]:
        r = r * z + _c(c, z.dtype)
    return r


def _airy_ai(x):
    dt = x.dtype
    t = lambda v: _c(v, dt)  # noqa: E731
    one = t(1.0)
    # x < -2.09: the oscillating asymptotic expansion (arguments clamped where unused).
    xn = jnp.where(x < t(-2.09), x, t(-3.0))
    root = lax.sqrt(-xn)
    z = one / _div(t(-2.0) * xn * root, 3.0)
    zz = z * z
    afn, afd, agn, agd = (_horner(c, zz) for c in (_AFN, _AFD, _AGN, _AGD))
    phase = _div(t(-2.0) * xn * root, 3.0) + t(0.25) * t(math.pi)
    negative = (t(5.64189583547756286948e-01) / lax.sqrt(root)
                * (_sin(phase) * (one + zz * afn / afd) - _cos(phase) * (z * agn / agd)))
    # x >= 2.09: the decaying expansion in 1 / zeta.
    xp = jnp.where(x >= t(2.09), x, t(3.0))
    zeta = _div(t(2.0) * xp * lax.sqrt(xp), 3.0)
    inv = one / zeta
    positive = t(5.64189583547756286948e-01) * (_horner(_AN, inv) / _horner(_AD, inv)) / (
        t(2.0) * lax.sqrt(lax.sqrt(xp)) * _exp(zeta))
    # between: the Maclaurin series f, g, summed until |m / f| <= epsilon.
    series_domain = ~(x < t(-2.09)) & ~(x >= t(2.09))
    xs = jnp.where(series_domain, x, t(0.0))
    zc = xs * xs * xs
    eps = t(float(jnp.finfo(dt).eps))

    def cond(st):
        return jnp.any(st[-1] > eps)

    def body(st):
        f, g, k, m, nn, tt = st
        go = tt > eps
        m2 = m * zc
        k2 = k + one
        m2 = m2 / k2
        n2 = nn * zc
        k2 = k2 + one
        n2 = n2 / k2
        m2 = m2 / k2
        f2 = f + m2
        k2 = k2 + one
        n2 = n2 / k2
        g2 = g + n2
        t2 = lax.abs(m2 / f2)
        new = (f2, g2, k2, m2, n2, t2)
        return tuple(jnp.where(go, a, b) for a, b in zip(new, st))

    ones = jnp.ones_like(x)
    init = (ones, xs, ones, ones, xs, jnp.where(series_domain, ones, t(0.0)))
    f, g, *_ = lax.while_loop(cond, body, init)
    series = t(0.355028053887817239260) * f - t(0.258819403792806798405) * g
    out = jnp.where(x < t(-2.09), negative, jnp.where(x >= t(2.09), positive, series))
    out = jnp.where(x > t(103.892), t(0.0), out)
    return jnp.where(jnp.isinf(x), t(math.nan), out)


@register_lowering(aten.special_airy_ai.default, promote="out")
def _airy_ai_rule(ctx, x):
    _reject_reduced(ctx, "airy_ai")
    return _airy_ai(x)
