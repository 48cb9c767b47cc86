"""Lowering rules: linear-algebra factorizations and solves (Cholesky, LU, QR, eigh, SVD,
triangular and general solves, inverses, determinants), through jax.lax.linalg.

On the CPU jax runs LAPACK's own routines (potrf, getrf, geqrf/orgqr, syevd, gesdd), as eager
torch does, so even the vectors QR/eigh/SVD leave free (a sign, a phase) usually come out as
eager's; torch documents them as unique only up to that, so tests compare invariants there.

Errors. The `_ex` ops return LAPACK's `info` (0, or a 1-based index), computed here from the
factorization: for LU the first exactly-zero diagonal element of U (what getrf reports); for
Cholesky the order of the first leading minor that is not positive-definite. jax's Cholesky
reports no info (it fills a failed factor with NaN), so where a factor is not all finite an
unblocked Cholesky, run only then (`lax.cond`), finds the order. torch.linalg.cholesky, inv,
solve... (not `_ex`) trace as the `_ex` op plus `with_effects(_linalg_check_errors, info)`:
that op, aten.cholesky (which raises inside its kernel) and the `_ex` ops called with
check_errors=True record a run-time check (LoweringContext.check), so a singular or
non-positive-definite input raises fx2xla.LinAlgError, a torch.linalg.LinAlgError, when the
graph runs.

Where eager's result depends on its input's layout (det and slogdet factor A^T instead of A
when A is contiguous and real, which changes their LU/pivots outputs and what their backward
formulas read), the rules read the same strides from the node's meta. linalg.solve and inv
factor A itself in torch 2.13, whatever its layout.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import torch
import torch.fx
from jax import lax
from torch.ops import aten, higher_order

from .checks import LINALG
from .dtypes import dtype_name
from .registry import RejectedInput, concrete_shape, register_lowering

_FLOATS = tuple(np.dtype(d) for d in (jnp.float32, jnp.float64, jnp.complex64, jnp.complex128))


def linalg_error_message(api_name: str) -> str:
    """Eager's LinAlgError message for `api_name` (torch's `_linalg_check_errors`), less the
    LAPACK `info` value and batch element it names, which the verdict of a run-time check does
    not carry."""
    if "solve" in api_name and "lu_solve" not in api_name:
        return f"{api_name}: The solver failed because the input matrix is singular."
    if "inv" in api_name:
        return (f"{api_name}: A diagonal element of the input's LU factor is zero, the inversion could not be "
                "completed because the input matrix is singular.")
    if "cholesky" in api_name:
        return (f"{api_name}: The factorization could not be completed because the input is not "
                "positive-definite (a leading minor is not positive-definite).")
    if "lu_factor" in api_name:
        return (f"{api_name}: A diagonal element of U is zero and using it on lu_solve would result in a division "
                "by zero. If you still want to perform the factorization, consider calling linalg.lu(A, pivot) "
                "or linalg.lu_factor_ex(A, pivot)")
    if "svd" in api_name:
        return (f"{api_name}: The algorithm failed to converge because the input matrix is ill-conditioned or has "
                "too many repeated singular values.")
    if "eig" in api_name or "syevd" in api_name:
        return (f"{api_name}: The algorithm failed to converge because the input matrix is ill-conditioned or has "
                "too many repeated eigenvalues.")
    if "lstsq" in api_name:
        return (f"{api_name}: The least squares solution could not be computed because the input matrix does not "
                "have full rank.")
    return f"{api_name}: LAPACK reported an error (info != 0)."


def check_info(ctx, info, api_name: str) -> None:
    """A run-time check that raises fx2xla.LinAlgError (a torch.linalg.LinAlgError) with eager's
    words where any of LAPACK's `info` values is not 0, as `_linalg_check_errors` does."""
    ctx.check(jnp.any(info != 0), linalg_error_message(api_name), error=LINALG)


def _is_linalg_check(node) -> bool:
    return len(node.args) > 1 and node.args[1] is aten._linalg_check_errors.default


@register_lowering(higher_order.with_effects, accepts=_is_linalg_check)
def _linalg_check_errors(ctx, token, op, info, api_name, *, is_matrix=True):
    """`with_effects(token, _linalg_check_errors, info, api_name)`, which torch.linalg.cholesky,
    inv, solve and lu_factor trace as after their `_ex` op: the check, run with the graph, and
    the effect token passed on. Other effectful ops keep no rule (they run eagerly)."""
    check_info(ctx, info, api_name)
    # (The token and the op's result, None: in-memory graphs read only the token, and the extra
    # entry beyond their meta is dropped; torch.export's deserialized ones read both.)
    return token, None


def _check_dtype(ctx, x, name: str, i: int = 0) -> None:
    """Eager's linalg kernels take float32/float64/complex64/complex128 only."""
    if np.dtype(x.dtype) not in _FLOATS:
        raise RejectedInput(f"{name}: Expected a floating point or complex tensor as input. "
                            f"Got {dtype_name(ctx.arg_meta(i).dtype)}")


def _mH(x):
    """The conjugate transpose of the last two dims."""
    return jnp.conj(jnp.swapaxes(x, -1, -2)) if jnp.iscomplexobj(x) else jnp.swapaxes(x, -1, -2)


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _batch_broadcast(a, b):
    """a (..., m, m) and b (..., m, k) with their batch dims broadcast together."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


def _contiguous(ctx, i: int) -> bool:
    """Whether node argument `i` is contiguous in torch's layout (read from its meta)."""
    meta = ctx.arg_meta(i)
    return bool(meta.is_contiguous())


def _empty(ctx, index: int, dtype):
    """The (empty) output `index` of the node as torch shapes it (e.g. Q of mode='r')."""
    shape = concrete_shape(ctx.out[index].shape, ctx.sizes)
    return jnp.zeros(shape, dtype)


def _tri_solve(a, b, *, lower: bool, left: bool = True, transpose: bool = False, conjugate: bool = False,
               unit: bool = False):
    """op(a) x = b (left) or x op(a) = b, op = transpose/conjugate as asked; batch broadcast."""
    a, b = _batch_broadcast(a, b)
    if 0 in a.shape[-2:] or 0 in b.shape[-2:] or 0 in a.shape[:-2]:
        return jnp.zeros(b.shape, jnp.result_type(a, b))
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=lower, transpose_a=transpose,
                                       conjugate_a=conjugate and jnp.iscomplexobj(a), unit_diagonal=unit)


# -- Cholesky ---------------------------------------------------------------------------------
def _cholesky_info(a):
    """int32 (...,): the order (1-based) of the first leading minor of the Hermitian matrix whose
    lower triangle is `a`'s that is not positive-definite, or 0: an unblocked Cholesky, as LAPACK's
    potrf fails at its first pivot that is not > 0 (or is NaN)."""
    n = a.shape[-1]
    lower = jnp.tril(a)
    w = lower + _mH(jnp.tril(a, -1))

    def step(j, carry):
        w, info = carry
        d = jnp.real(w[..., j, j])
        bad = ~(d > 0)
        info = jnp.where((info == 0) & bad, j + 1, info)
        col = w[..., :, j] / jnp.sqrt(jnp.where(bad, 1, d)).astype(w.dtype)[..., None]
        below = (jnp.arange(n) > j)
        col = jnp.where(below, col, 0)
        w = w - col[..., :, None] * jnp.conj(col)[..., None, :]
        return w, info

    info = jnp.zeros(a.shape[:-2], jnp.int32)
    return lax.fori_loop(0, n, step, (w, info))[1]


def _cholesky(a, upper: bool):
    """(L or U, info) as torch's linalg_cholesky_ex: upper reads `a`'s upper triangle. A failed
    factorization comes back NaN (torch's is LAPACK's partial factor: unspecified either way)."""
    if upper:
        a = _mH(a)  # its lower triangle is `a`'s upper one, conjugated
    info_shape = a.shape[:-2]
    if a.size == 0:
        return jnp.zeros(a.shape, a.dtype), jnp.zeros(info_shape, jnp.int32)
    factor = jnp.tril(lax.linalg.cholesky(a, symmetrize_input=False))
    ok = jnp.all(jnp.isfinite(factor))
    info = lax.cond(ok, lambda x: jnp.zeros(info_shape, jnp.int32), _cholesky_info, a)
    return (_mH(factor) if upper else factor), info


@register_lowering(aten.linalg_cholesky_ex.default)
def _linalg_cholesky_ex(ctx, a, *, upper=False, check_errors=False):
    _check_dtype(ctx, a, "linalg.cholesky")
    factor, info = _cholesky(a, upper)
    if check_errors:
        check_info(ctx, info, "linalg.cholesky")
    return factor, info


@register_lowering(aten.cholesky.default)
def _cholesky_rule(ctx, a, upper=False):
    _check_dtype(ctx, a, "cholesky")
    factor, info = _cholesky(a, upper)
    check_info(ctx, info, "cholesky")
    return factor


def _cholesky_solve(b, factor, upper: bool):
    """A^-1 b for A = L L^H (factor = L) or U^H U (factor = U, upper)."""
    if upper:  # U^H y = b, U x = y
        y = _tri_solve(factor, b, lower=False, transpose=True, conjugate=True)
        return _tri_solve(factor, y, lower=False)
    y = _tri_solve(factor, b, lower=True)
    return _tri_solve(factor, y, lower=True, transpose=True, conjugate=True)


@register_lowering(aten.cholesky_solve.default)
def _cholesky_solve_rule(ctx, b, factor, upper=False):
    _check_dtype(ctx, b, "cholesky_solve")
    return _cholesky_solve(b, factor, upper).astype(ctx.out_dtype)


@register_lowering(aten.cholesky_inverse.default)
def _cholesky_inverse(ctx, factor, upper=False):
    _check_dtype(ctx, factor, "cholesky_inverse")
    n = factor.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=factor.dtype), factor.shape)
    return _cholesky_solve(eye, factor, upper)


# -- triangular solves ------------------------------------------------------------------------
@register_lowering(aten.triangular_solve.default)
def _triangular_solve(ctx, b, a, upper=True, transpose=False, unitriangular=False):
    """(solution, cloned_coefficient): op(A) X = B, op(A) = A^T for transpose (not conjugated);
    the second output is A broadcast to the batch shape, as torch returns it."""
    _check_dtype(ctx, b, "triangular_solve")
    x = _tri_solve(a, b, lower=not upper, transpose=transpose, unit=unitriangular)
    clone_shape = concrete_shape(ctx.out[1].shape, ctx.sizes)
    return x, jnp.broadcast_to(a, clone_shape)


@register_lowering(aten.linalg_solve_triangular.default)
def _linalg_solve_triangular(ctx, a, b, *, upper, left=True, unitriangular=False):
    _check_dtype(ctx, a, "linalg.solve_triangular")
    return _tri_solve(a, b, lower=not upper, left=left, unit=unitriangular)


# -- LU ---------------------------------------------------------------------------------------
def _lu_factor(a):
    """(LU, pivots int32 1-based, info int32) as LAPACK's getrf (partial pivoting)."""
    m, n = a.shape[-2:]
    k = min(m, n)
    batch = a.shape[:-2]
    if a.size == 0:
        pivots = jnp.broadcast_to(jnp.arange(1, k + 1, dtype=jnp.int32), batch + (k,))
        return jnp.zeros(a.shape, a.dtype), pivots, jnp.zeros(batch, jnp.int32)
    lu, pivots, _ = lax.linalg.lu(a)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    zero = diag == 0
    info = jnp.where(jnp.any(zero, -1), jnp.argmax(zero, -1) + 1, 0).astype(jnp.int32)
    return lu, (pivots + 1).astype(jnp.int32), info


def _permutation(pivots, m: int):
    """perm (..., m), 0-based: A[perm] = L U for LAPACK's 1-based `pivots`."""
    if pivots.shape[-1] == 0 or m == 0:
        return jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), pivots.shape[:-1] + (m,))
    return lax.linalg.lu_pivots_to_permutation(pivots.astype(jnp.int32) - 1, m)


def _unpack(lu, pivots, dtype):
    """(P, L, U) with A = P L U, P (..., m, m), L (..., m, k), U (..., k, n)."""
    m, n = lu.shape[-2:]
    k = min(m, n)
    l_ = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    u = jnp.triu(lu[..., :k, :])
    perm = _permutation(pivots, m)
    # P^T A = A[perm]: row i of P^T is e_{perm[i]}, so P[perm[i], i] = 1.
    p = _mT(jnp.eye(m, dtype=dtype)[perm])
    return p, l_, u


def _no_pivot(pivot: bool, name: str) -> None:
    if not pivot:
        raise RejectedInput(f"{name}: LU without pivoting is not implemented on the CPU")


@register_lowering(aten.linalg_lu_factor_ex.default)
def _linalg_lu_factor_ex(ctx, a, *, pivot=True, check_errors=False):
    _check_dtype(ctx, a, "linalg.lu_factor")
    _no_pivot(pivot, "linalg.lu_factor")
    lu, pivots, info = _lu_factor(a)
    if check_errors:
        check_info(ctx, info, "torch.linalg.lu_factor")
    return lu, pivots, info


@register_lowering(aten.linalg_lu.default)
def _linalg_lu(ctx, a, *, pivot=True):
    _check_dtype(ctx, a, "linalg.lu")
    _no_pivot(pivot, "linalg.lu")
    lu, pivots, _ = _lu_factor(a)
    return _unpack(lu, pivots, a.dtype)


@register_lowering(aten.lu_unpack.default)
def _lu_unpack(ctx, lu, pivots, unpack_data=True, unpack_pivots=True):
    p, l_, u = _unpack(lu, pivots, lu.dtype)
    if not unpack_data:
        l_, u = _empty(ctx, 1, lu.dtype), _empty(ctx, 2, lu.dtype)
    if not unpack_pivots:
        p = _empty(ctx, 0, lu.dtype)
    return p, l_, u


def _lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    """X with A X = B (left) or X A = B, op(A) = A^H for adjoint, A = P L U given as (lu, pivots)."""
    if not left:  # X op(A) = B  <=>  op(A)^H X^H = B^H
        return _mH(_lu_solve(lu, pivots, _mH(b), left=True, adjoint=not adjoint))
    n = lu.shape[-1]
    batch = jnp.broadcast_shapes(lu.shape[:-2], b.shape[:-2])
    lu = jnp.broadcast_to(lu, batch + lu.shape[-2:])
    pivots = jnp.broadcast_to(pivots, batch + pivots.shape[-1:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    if b.size == 0 or n == 0:
        return jnp.zeros(b.shape, jnp.result_type(lu, b))
    perm = _permutation(pivots, n)
    if not adjoint:  # L U X = P^T B = B[perm]
        pb = jnp.take_along_axis(b, perm[..., :, None], axis=-2)
        y = lax.linalg.triangular_solve(lu, pb, left_side=True, lower=True, unit_diagonal=True)
        return lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)
    # A^H = U^H L^H P^T: U^H L^H Y = B, X = P Y (X[perm] = Y)
    conj = jnp.iscomplexobj(lu)
    y = lax.linalg.triangular_solve(lu, b, left_side=True, lower=False, transpose_a=True, conjugate_a=conj)
    y = lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, transpose_a=True, conjugate_a=conj,
                                    unit_diagonal=True)
    inverse = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(y, inverse[..., :, None], axis=-2)


@register_lowering(aten.linalg_lu_solve.default)
def _linalg_lu_solve(ctx, lu, pivots, b, *, left=True, adjoint=False):
    _check_dtype(ctx, lu, "linalg.lu_solve")
    return _lu_solve(lu, pivots, b, left=left, adjoint=adjoint).astype(ctx.out_dtype)


def _solve_ex(ctx, a, b, left: bool):
    """(result, LU, pivots, info) as torch's _linalg_solve_ex: LU, pivots and info are A's
    (torch 2.13 factors A itself whatever its layout; det/slogdet do not, see _det_lu)."""
    vector = b.ndim == 1 or (a.ndim - 1 == b.ndim and b.shape == a.shape[:-1])
    lu, pivots, info = _lu_factor(a)
    rhs = b[..., None] if vector else b
    x = _lu_solve(lu, pivots, rhs, left=left)
    return (x[..., 0] if vector else x), lu, pivots, info


@register_lowering(aten._linalg_solve_ex.default)
def _linalg_solve_ex(ctx, a, b, *, left=True, check_errors=False):
    _check_dtype(ctx, a, "linalg.solve")
    x, lu, pivots, info = _solve_ex(ctx, a, b, left)
    if check_errors:
        check_info(ctx, info, "torch.linalg.solve")
    shapes = [concrete_shape(o.shape, ctx.sizes) for o in ctx.out]
    return (x.astype(ctx.out_dtype), jnp.broadcast_to(lu, shapes[1]), jnp.broadcast_to(pivots, shapes[2]),
            jnp.broadcast_to(info, shapes[3]))


@register_lowering(aten.linalg_inv_ex.default)
def _linalg_inv_ex(ctx, a, *, check_errors=False):
    """(inverse, info): eager solves A X = I (linalg.solve_ex), so its info is the solve's."""
    _check_dtype(ctx, a, "linalg.inv")
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    x, _, _, info = _solve_ex(ctx, a, eye, True)
    if check_errors:
        check_info(ctx, info, "linalg.inv")
    return x, info


# -- determinants -----------------------------------------------------------------------------
def _det_lu(ctx, a):
    """LU and pivots as eager's det/slogdet factor them: A^H for a contiguous real A."""
    use_t = _contiguous(ctx, 0) and not jnp.iscomplexobj(a)
    lu, pivots, _ = _lu_factor(_mH(a) if use_t else a)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    n = a.shape[-1]
    swaps = jnp.sum(pivots != jnp.arange(1, n + 1, dtype=jnp.int32), axis=-1)
    perm_sign = jnp.where(swaps % 2 == 0, 1, -1).astype(a.dtype)
    return lu, pivots, diag, perm_sign


@register_lowering(aten._linalg_det.default)
def _linalg_det(ctx, a):
    _check_dtype(ctx, a, "linalg.det")
    lu, pivots, diag, perm_sign = _det_lu(ctx, a)
    return perm_sign * jnp.prod(diag, axis=-1), lu, pivots


@register_lowering(aten._linalg_slogdet.default)
def _linalg_slogdet(ctx, a):
    """(sign, logabsdet, LU, pivots): sign is det/|det| (0 for a singular A, with -inf)."""
    _check_dtype(ctx, a, "linalg.slogdet")
    lu, pivots, diag, perm_sign = _det_lu(ctx, a)
    absdiag = jnp.abs(diag)
    logabsdet = jnp.sum(jnp.log(absdiag), axis=-1)
    if jnp.iscomplexobj(a):
        phase = jnp.prod(diag / jnp.where(absdiag == 0, 1, absdiag).astype(a.dtype), axis=-1)
    else:
        phase = jnp.prod(jnp.sign(diag), axis=-1)
    sign = jnp.where(jnp.any(absdiag == 0, axis=-1), 0, perm_sign * phase).astype(a.dtype)
    return sign, logabsdet, lu, pivots


# -- QR, eigh, SVD ----------------------------------------------------------------------------
@register_lowering(aten.linalg_qr.default)
def _linalg_qr(ctx, a, mode="reduced"):
    _check_dtype(ctx, a, "linalg.qr")
    if mode not in ("reduced", "complete", "r"):
        raise RejectedInput(f"qr received unrecognized mode '{mode}' but expected one of 'reduced' (default), "
                            "'r', or 'complete'")
    m, n = a.shape[-2:]
    if a.size == 0:
        k = m if mode == "complete" else min(m, n)
        q = jnp.broadcast_to(jnp.eye(m, k, dtype=a.dtype), a.shape[:-2] + (m, k))
        r = jnp.zeros(a.shape[:-2] + (k, n), a.dtype)
    else:
        q, r = lax.linalg.qr(a, full_matrices=mode == "complete")
    if mode == "r":
        return _empty(ctx, 0, a.dtype), r
    return q, r


@register_lowering(aten.geqrf.default)
def _geqrf(ctx, a):
    """LAPACK's geqrf: R on and above the diagonal, the Householder vectors below it, and their
    scalars tau (min(m, n)); jax runs the same routine on the CPU, as eager does."""
    _check_dtype(ctx, a, "geqrf")
    k = min(a.shape[-2:])
    if a.size == 0:
        return a, jnp.zeros(a.shape[:-2] + (k,), a.dtype)
    h, tau = jnp.linalg.qr(a, mode="raw")  # numpy's raw mode: LAPACK's array, transposed
    return _mT(h), tau


@register_lowering(aten.linalg_householder_product.default)
def _householder_product(ctx, a, tau):
    """The first n columns of H_1 ... H_k, H_i = I - tau_i v_i v_i^H with v_i below the
    diagonal of a's column i (LAPACK's orgqr/ungqr)."""
    _check_dtype(ctx, a, "linalg.householder_product")
    m, n = a.shape[-2:]
    if m < n:
        raise RejectedInput("torch.linalg.householder_product: input.shape[-2] must be greater than or equal to "
                            "input.shape[-1]")
    if tau.shape[-1] > n:
        raise RejectedInput("torch.linalg.householder_product: input.shape[-1] must be greater than or equal to "
                            "tau.shape[-1]")
    if a.size == 0:
        return a
    if tau.shape[-1] == 0:
        return jnp.broadcast_to(jnp.eye(m, n, dtype=a.dtype), a.shape)
    return lax.linalg.householder_product(a, tau)


@register_lowering(aten.ormqr.default)
def _ormqr(ctx, a, tau, other, left=True, transpose=False):
    """other multiplied by Q = H_1 ... H_k (the reflectors geqrf leaves in a and tau): Q C, Q^H C
    (transpose), C Q or C Q^H (left=False), by LAPACK's ormqr/unmqr as eager's."""
    _check_dtype(ctx, a, "ormqr")
    if other.size == 0 or a.size == 0 or tau.shape[-1] == 0:  # Q is the identity
        return other
    return lax.linalg.ormqr(a, tau, other, left=left, transpose=transpose)


@register_lowering(aten._linalg_eigh.default)
def _linalg_eigh(ctx, a, UPLO="L", compute_v=True):
    """(eigenvalues ascending, real; eigenvectors as columns, or an empty tensor)."""
    _check_dtype(ctx, a, "linalg.eigh")
    if UPLO not in ("L", "U", "l", "u"):
        raise RejectedInput(f"Expected UPLO argument to be 'L' or 'U', but got {UPLO}")
    real = jnp.finfo(a.dtype).dtype
    if a.size == 0:
        w, v = jnp.zeros(a.shape[:-1], real), jnp.zeros(a.shape, a.dtype)
    else:
        v, w = lax.linalg.eigh(a, lower=UPLO in ("L", "l"), symmetrize_input=False)
    if not compute_v:
        v = _empty(ctx, 1, a.dtype)
    return w.astype(real), v


def _on_cpu(node) -> bool:
    val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    return val is not None and val.device.type == "cpu"


@register_lowering(aten.linalg_eig.default, accepts=_on_cpu)
def _linalg_eig(ctx, a):
    """(eigenvalues, right eigenvectors as columns), complex, of a general square matrix:
    LAPACK's geev on the CPU, as eager's (each eigenvector of unit norm; the order is geev's,
    which torch does not promise either). XLA has eig on the CPU only: a GPU tensor's runs
    eagerly."""
    _check_dtype(ctx, a, "linalg.eig")
    if a.shape[-1] != a.shape[-2]:
        raise RejectedInput(f"linalg.eig: A must be batches of square matrices, but they are {a.shape[-2]} by "
                            f"{a.shape[-1]} matrices")
    complex_dtype = ctx.out_dtype
    if a.size == 0:
        return jnp.zeros(a.shape[:-1], complex_dtype), jnp.zeros(a.shape, complex_dtype)
    w, v = lax.linalg.eig(a, compute_left_eigenvectors=False, compute_right_eigenvectors=True)
    return w.astype(complex_dtype), v.astype(complex_dtype)


@register_lowering(aten._linalg_svd.default)
def _linalg_svd(ctx, a, full_matrices=False, compute_uv=True, *, driver=None):
    _check_dtype(ctx, a, "linalg.svd")
    if driver is not None:
        raise RejectedInput("torch.linalg.svd: keyword argument `driver=` is only supported on CUDA inputs with "
                            "cuSOLVER backend.")
    shapes = [concrete_shape(o.shape, ctx.sizes) for o in ctx.out]
    real = jnp.finfo(a.dtype).dtype
    if a.size == 0:  # torch's shapes (U/Vh identity-like where full_matrices)
        m, n = a.shape[-2:]
        u = jnp.broadcast_to(jnp.eye(m, shapes[0][-1] if compute_uv else 0, dtype=a.dtype), shapes[0]) \
            if compute_uv else _empty(ctx, 0, a.dtype)
        vh = jnp.broadcast_to(jnp.eye(shapes[2][-2] if compute_uv else 0, n, dtype=a.dtype), shapes[2]) \
            if compute_uv else _empty(ctx, 2, a.dtype)
        return u, jnp.zeros(shapes[1], real), vh
    if not compute_uv:
        s = lax.linalg.svd(a, full_matrices=False, compute_uv=False)
        return _empty(ctx, 0, a.dtype), s.astype(real), _empty(ctx, 2, a.dtype)
    u, s, vh = lax.linalg.svd(a, full_matrices=full_matrices, compute_uv=True)
    return u, s.astype(real), vh


@register_lowering(aten.linalg_pinv.atol_rtol_tensor)
def _linalg_pinv(ctx, a, *, atol=None, rtol=None, hermitian=False):
    """torch's linalg_pinv: singular values (|eigenvalues| where hermitian) above
    max(atol, rtol * largest) are inverted, the rest zeroed. atol defaults to 0, rtol to
    eps * max(m, n) (0 where atol > 0 is given); tolerances are float64, as eager's."""
    _check_dtype(ctx, a, "linalg.pinv")
    m, n = a.shape[-2:]
    real = jnp.finfo(a.dtype).dtype
    f64 = jnp.float64
    atol_ = jnp.zeros((), f64) if atol is None else jnp.asarray(atol).astype(f64)
    if rtol is not None:
        rtol_ = jnp.asarray(rtol).astype(f64)
    else:
        default = jnp.asarray(float(jnp.finfo(real).eps) * max(m, n), f64)
        rtol_ = default if atol is None else jnp.where(atol_ > 0, 0.0, default)
    if a.size == 0:
        return jnp.zeros(a.shape[:-2] + (n, m), a.dtype)
    if not hermitian:
        u, s, vh = lax.linalg.svd(a, full_matrices=False, compute_uv=True)
        largest = s[..., :1]
        sv, vecs_l, vecs_r = s, _mH(vh), u
    else:
        v, w = lax.linalg.eigh(a, lower=True, symmetrize_input=False)
        largest = jnp.max(jnp.abs(w), axis=-1, keepdims=True)
        sv, vecs_l, vecs_r = w, v, v
    tol = jnp.maximum(atol_[..., None], (rtol_[..., None] * largest.astype(real)).astype(f64))
    inv = jnp.where(jnp.abs(sv).astype(f64) > tol, 1 / sv, 0).astype(a.dtype)
    return jnp.matmul(vecs_l * inv[..., None, :], _mH(vecs_r), precision=lax.Precision.HIGHEST)


@register_lowering(aten.linalg_matrix_exp.default)
def _linalg_matrix_exp(ctx, a):
    """jax.scipy.linalg.expm (Padé approximant with scaling and squaring; torch uses a Taylor
    polynomial of degree up to 18: the results agree to rounding). bf16/f16 compute in float32."""
    if a.size == 0:
        return a
    x = a.astype(jnp.float32) if np.dtype(a.dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)) else a
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating)):
        raise RejectedInput(f"linalg.matrix_exp: Expected a floating point or complex tensor as input. "
                            f"Got {dtype_name(ctx.arg_meta(0).dtype)}")
    batch = x.shape[:-2]
    flat = x.reshape((-1,) + x.shape[-2:])
    out = jax.vmap(jsl.expm)(flat).reshape(batch + x.shape[-2:])
    return out.astype(ctx.out_dtype)
