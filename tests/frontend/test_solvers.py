"""Linear-algebra lowerings (fx2xla/lowering/solvers.py) against eager PyTorch: Cholesky, triangular
solves, LU and its solves, inverses, determinants, QR, eigh, eig, SVD, pinv and matrix_exp.

Every function is compiled with `torch.compile(fn, backend="fx2xla", fullgraph=True,
options={"fallback": "error"})`, so an op without a rule fails the test instead of running eagerly.
Tolerances (TOL), asserted with torch.testing.assert_close on every compared output:
float32/complex64 rtol 1e-4, atol 1e-5; float64/complex128 rtol 1e-10, atol 1e-10. Integer
outputs (pivots, info) are compared exactly (assert_close's default for integer dtypes), and
dtype and shape of every output always. Vectors torch documents as unique only up to sign/phase
(QR's Q, eigh's, eig's and SVD's vectors) are compared through invariants (reconstruction,
orthonormality, eigen-equation) at the same tolerances scaled by the matrix size.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fx2xla

DTYPES = [torch.float32, torch.float64, torch.complex64, torch.complex128]
TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-5), torch.complex64: dict(rtol=1e-4, atol=1e-5),
    torch.float64: dict(rtol=1e-10, atol=1e-10), torch.complex128: dict(rtol=1e-10, atol=1e-10),
}


def _tol(t: torch.Tensor, scale: float = 1.0) -> dict:
    real = t.real.dtype if t.is_complex() else t.dtype
    base = TOL.get(t.dtype, TOL.get({torch.float32: torch.complex64, torch.float64: torch.complex128}.get(real)))
    if not (t.is_floating_point() or t.is_complex()):
        return dict(rtol=0, atol=0)
    return {k: v * scale for k, v in base.items()}


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})


def check_same(actual, expected, scale: float = 1.0):
    """Same structure, dtypes and shapes; values within TOL (integers exact)."""
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        torch.testing.assert_close(actual, expected, equal_nan=True, **_tol(expected, scale))
        return
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        check_same(a, e, scale)


def run_both(fn, *args, scale: float = 1.0):
    expected = fn(*args)
    actual = compiled(fn)(*args)
    check_same(actual, expected, scale)
    return actual, expected


def make(*shape, dtype=torch.float64, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def spd(*batch, n=4, dtype=torch.float64, seed=0):
    a = make(*batch, n, n, dtype=dtype, seed=seed)
    return a @ a.mH + n * torch.eye(n, dtype=dtype)


def well_conditioned(*batch, n=4, dtype=torch.float64, seed=0):
    return make(*batch, n, n, dtype=dtype, seed=seed) + n * torch.eye(n, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cholesky_rules_match_eager(dtype):
    """linalg.cholesky_ex (lower and upper: L/U and info), torch.cholesky (lower, upper),
    cholesky_solve (lower, upper, batch dims broadcast between B [3, 4, 2] and L [2, 3, 4, 4])
    and cholesky_inverse (lower, upper) on batched [2, 3, 4, 4] inputs equal eager's within TOL,
    with equal dtypes and shapes, and info exactly 0."""
    a = spd(2, 3, dtype=dtype)
    b = make(3, 4, 2, dtype=dtype, seed=1)

    def fn(a, b):
        low, info = torch.linalg.cholesky_ex(a)
        up, info_up = torch.linalg.cholesky_ex(a, upper=True)
        return (low, info, up, info_up, torch.cholesky(a), torch.cholesky(a, upper=True),
                torch.cholesky_solve(b, low), torch.cholesky_solve(b, up, upper=True),
                torch.cholesky_inverse(low), torch.cholesky_inverse(up, upper=True))

    actual, _ = run_both(fn, a, b, scale=10)
    assert not actual[1].any() and not actual[3].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_triangular_solve_rules_match_eager(dtype):
    """triangular_solve for each of upper x transpose x unitriangular (solution and the cloned
    coefficient broadcast to the batch), and linalg.solve_triangular for upper x left with a
    B of batch [3] against A of batch [2, 3], equal eager's within TOL (dtypes, shapes too)."""
    a = well_conditioned(2, 3, dtype=dtype)
    b = make(3, 4, 2, dtype=dtype, seed=1)

    def fn(a, b):
        outs = []
        for upper in (True, False):
            for transpose in (True, False):
                for unit in (True, False):
                    outs += list(torch.triangular_solve(b, a, upper=upper, transpose=transpose, unitriangular=unit))
            outs.append(torch.linalg.solve_triangular(a, b, upper=upper))
            outs.append(torch.linalg.solve_triangular(a, b.mT, upper=upper, left=False))
        return outs

    run_both(fn, a, b, scale=10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lu_rules_match_eager(dtype):
    """linalg.lu_factor_ex on square [2, 4, 4] and rectangular [2, 3, 5] / [2, 5, 3] inputs (LU,
    int32 1-based pivots, info), linalg.lu (P, L, U), lu_unpack (all three flag settings),
    linalg.lu_solve for left x adjoint, linalg.solve_ex with a matrix and a vector right-hand
    side, and linalg.inv_ex all equal eager's within TOL (integers exactly, dtypes and shapes)."""
    a = well_conditioned(2, dtype=dtype)
    rect = make(2, 3, 5, dtype=dtype, seed=2)
    b = make(2, 4, 3, dtype=dtype, seed=1)

    def fn(a, rect, b):
        lu, piv, info = torch.linalg.lu_factor_ex(a)
        outs = [lu, piv, info, *torch.linalg.lu_factor_ex(rect), *torch.linalg.lu_factor_ex(rect.mT),
                *torch.linalg.lu(rect), *torch.linalg.lu(rect.mT), *torch.lu_unpack(lu, piv),
                *torch.lu_unpack(lu, piv, unpack_data=False), *torch.lu_unpack(lu, piv, unpack_pivots=False)]
        for left in (True, False):
            for adjoint in (True, False):
                outs.append(torch.linalg.lu_solve(lu, piv, b if left else b.mT, left=left, adjoint=adjoint))
        outs += [*torch.linalg.solve_ex(a, b), *torch.linalg.solve_ex(a, b[..., 0]),
                 *torch.linalg.solve_ex(a, b.mT, left=False), *torch.linalg.inv_ex(a)]
        return outs

    actual, _ = run_both(fn, a, rect, b, scale=10)
    assert actual[1].dtype == torch.int32 and int(actual[1].min()) >= 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_determinant_rules_match_eager(dtype):
    """linalg.det, linalg.slogdet (sign, logabsdet) and logdet of a [3, 4, 4] batch (logdet on
    Hermitian positive-definite matrices) equal eager's within TOL, dtypes and shapes too."""
    a = make(3, 4, 4, dtype=dtype)
    p = spd(3, dtype=dtype)
    run_both(lambda a, p: (torch.linalg.det(a), *torch.linalg.slogdet(a), torch.logdet(p)), a, p, scale=10)


def _eye(n, like):
    return torch.eye(n, dtype=like.dtype).expand(*like.shape[:-2], n, n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decompositions_satisfy_invariants(dtype):
    """For a [2, 5, 3] batch: linalg.qr in modes reduced/complete/r gives eager's shapes and
    dtypes, Q^H Q = I, Q R = A and R upper triangular (mode 'r': R equal to reduced R, Q empty);
    linalg.eigh (UPLO L and U) gives eager's eigenvalues, V^H V = I and A V = V diag(w);
    linalg.svd (full and reduced) gives eager's singular values, U^H U = I, Vh Vh^H = I and
    U diag(S) Vh = A; svdvals and pinv (plain and hermitian) equal eager's. All within TOL x 10."""
    a = make(2, 5, 3, dtype=dtype)
    h = make(2, 4, 4, dtype=dtype, seed=1)
    h = h + h.mH

    def fn(a, h):
        return (*torch.linalg.qr(a), *torch.linalg.qr(a, mode="complete"), *torch.linalg.qr(a, mode="r"),
                *torch.linalg.eigh(h), *torch.linalg.eigh(h, UPLO="U"), *torch.linalg.svd(a),
                *torch.linalg.svd(a, full_matrices=False), torch.linalg.svdvals(a), torch.linalg.pinv(a),
                torch.linalg.pinv(h, hermitian=True))

    actual = compiled(fn)(a, h)
    expected = fn(a, h)
    for x, e in zip(actual, expected):
        assert x.dtype == e.dtype and x.shape == e.shape, (x.dtype, x.shape, e.dtype, e.shape)
    tol = _tol(a, 10)
    q, r, qc, rc, q_r, r_r, w, v, wu, vu, u, s, vh, ur, sr, vhr, sv, pinv, pinv_h = actual
    for qq, rr in ((q, r), (qc, rc)):
        torch.testing.assert_close(qq.mH @ qq, _eye(qq.shape[-1], qq), **tol)
        torch.testing.assert_close(qq @ rr, a, **tol)
        torch.testing.assert_close(rr, rr.triu(), **tol)
    torch.testing.assert_close(r_r, r, **tol)
    assert q_r.numel() == 0
    for ww, vv, e_w in ((w, v, expected[6]), (wu, vu, expected[8])):
        torch.testing.assert_close(ww, e_w, **_tol(e_w, 10))
        torch.testing.assert_close(vv.mH @ vv, _eye(4, vv), **tol)
        torch.testing.assert_close(h @ vv, vv * ww.to(dtype).unsqueeze(-2), **tol)
    for uu, ss, vvh in ((u, s, vh), (ur, sr, vhr)):
        torch.testing.assert_close(ss, expected[11], **_tol(ss, 10))
        torch.testing.assert_close(uu.mH @ uu, _eye(uu.shape[-1], uu), **tol)
        torch.testing.assert_close(vvh @ vvh.mH, _eye(vvh.shape[-2], vvh), **tol)
        k = ss.shape[-1]
        torch.testing.assert_close((uu[..., :k] * ss.to(dtype).unsqueeze(-2)) @ vvh[..., :k, :], a, **tol)
    check_same([sv, pinv, pinv_h], expected[-3:], scale=10)


def test_solver_empty_batch_and_zero_size_matrices():
    """An empty batch [0, 3, 3] and 0 x 0 matrices [2, 0, 0] (float64): cholesky_ex,
    cholesky_solve, cholesky_inverse, solve_triangular, lu_factor_ex, lu, solve_ex, inv_ex, det,
    slogdet, qr, eigh, svd and pinv give eager's dtypes, shapes and values (TOL)."""
    def fn(a, b):
        return (*torch.linalg.cholesky_ex(a), torch.cholesky_solve(b, a), torch.cholesky_inverse(a),
                torch.linalg.solve_triangular(a, b, upper=False), *torch.linalg.lu_factor_ex(a),
                *torch.linalg.lu(a), *torch.linalg.solve_ex(a, b), *torch.linalg.inv_ex(a), torch.linalg.det(a),
                *torch.linalg.slogdet(a), *torch.linalg.qr(a), *torch.linalg.eigh(a), *torch.linalg.svd(a),
                torch.linalg.pinv(a))

    for shape in ((0, 3, 3), (2, 0, 0)):
        run_both(fn, torch.ones(shape, dtype=torch.float64), torch.ones(*shape[:-1], 2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex128])
def test_solver_non_contiguous_inputs(dtype):
    """Transposed (non-contiguous) inputs, and the same matrices contiguous: linalg.solve_ex,
    inv_ex, cholesky_ex, lu_factor_ex and the ATen ops _linalg_solve_ex, _linalg_det and
    _linalg_slogdet with ALL their outputs (eager's det/slogdet factor a contiguous real A as
    A^T, so their LU and pivots depend on the layout) equal eager's within TOL, integers exactly."""
    aten = torch.ops.aten
    a = well_conditioned(2, dtype=dtype).mT
    p = spd(2, dtype=dtype).mT
    b = make(2, 4, 3, dtype=dtype, seed=1)
    assert not a.is_contiguous()

    def fn(a, p, b):
        return (*torch.linalg.solve_ex(a, b), *torch.linalg.inv_ex(a), *aten._linalg_solve_ex(a, b),
                *aten._linalg_det(a), *aten._linalg_slogdet(a), *torch.linalg.cholesky_ex(p),
                *torch.linalg.lu_factor_ex(a))

    run_both(fn, a, p, b, scale=10)
    run_both(fn, a.contiguous(), p.contiguous(), b, scale=10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_solver_info_of_singular_and_non_pd_inputs(dtype):
    """info outputs: cholesky_ex (lower and upper) gives the order of the first non-positive-
    definite leading minor ([0, 3, 1] for identity / a -1 at (2, 2) / a 0 at (0, 0), and 4 for a
    NaN at (3, 3)); lu_factor_ex gives the first exactly-zero pivot (3 for a zero column 2);
    solve_ex and inv_ex report eager's info on the same singular batch; det is 0, slogdet's
    sign 0 and logabsdet -inf there. All equal eager's (integers exactly)."""
    n = torch.eye(4, dtype=dtype).repeat(4, 1, 1)
    n[1, 2, 2], n[2, 0, 0], n[3, 3, 3] = -1, 0, float("nan")
    s = well_conditioned(2, dtype=dtype)
    s[1, :, 2] = 0

    def fn(n, s):
        return (torch.linalg.cholesky_ex(n)[1], torch.linalg.cholesky_ex(n, upper=True)[1],
                *torch.linalg.lu_factor_ex(s)[1:], torch.linalg.solve_ex(s, s[..., 0])[1],
                torch.linalg.inv_ex(s)[1], torch.linalg.det(s), *torch.linalg.slogdet(s))

    actual, _ = run_both(fn, n, s)
    assert actual[0].tolist() == [0, 3, 1, 4] and actual[1].tolist() == [0, 3, 1, 4]
    assert actual[3].tolist() == [0, 3]
    assert actual[6][1] == 0 and actual[7][1] == 0 and actual[8][1] == float("-inf")


ERRORS = [  # (function, what its message says, eager's words for it)
    (lambda a: torch.linalg.cholesky(a), "linalg.cholesky", "not positive-definite"),
    (lambda a: torch.linalg.cholesky_ex(a, check_errors=True)[0], "linalg.cholesky", "not positive-definite"),
    (lambda a: torch.cholesky(a), "cholesky", "not positive-definite"),
    (lambda a: torch.linalg.inv(a), "linalg.inv", "singular"),
    (lambda a: torch.linalg.solve(a, a[..., :1]), "torch.linalg.solve", "singular"),
    (lambda a: torch.linalg.lu_factor(a)[0], "torch.linalg.lu_factor", "division by zero"),
]


@pytest.mark.parametrize("case", range(len(ERRORS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linalg_errors_are_raised_from_the_graph(case, dtype):
    """torch.linalg.cholesky, inv, solve, lu_factor (their `with_effects(_linalg_check_errors)`),
    torch.cholesky and cholesky_ex(check_errors=True) lower whole (fallback="error", and no
    fallback warning under the default): a matrix eager rejects (a non-positive-definite one, a
    singular one; alone and as element 1 of a batch) raises fx2xla.LinAlgError, which is a
    torch.linalg.LinAlgError as eager raises (a RuntimeError, what eager's lu_factor raises),
    with eager's words, the api's name and the user's
    source line; an accepted input equals eager's result (TOL, dtype, shape). With
    options={"check_indices": False} the bad input raises nothing."""
    fn, name, words = ERRORS[case]
    bad = -torch.eye(3, dtype=dtype) if "positive" in words else torch.zeros(3, 3, dtype=dtype)
    good = spd(2, n=3, dtype=dtype)
    with pytest.raises(RuntimeError, match=words):
        fn(bad)  # eager: a LinAlgError, and lu_factor a RuntimeError (which LinAlgError is too)
    f = compiled(fn)
    for a in (bad, torch.stack([good[0], bad])):
        with pytest.raises(fx2xla.LinAlgError, match=words) as info:
            f(a)
        assert isinstance(info.value, torch.linalg.LinAlgError)
        assert name + ":" in str(info.value) and "test_solvers.py" in str(info.value), str(info.value)
    check_same(f(good), fn(good))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        torch._dynamo.reset()
        torch.compile(fn, backend="fx2xla")(good)
    torch._dynamo.reset()
    unchecked = torch.compile(fn, backend="fx2xla", options={"check_indices": False, "fallback": "error"})
    unchecked(bad)


def test_linalg_checks_beside_an_effectful_op_that_runs_eagerly(capfd):
    """A graph with linalg.inv, linalg.solve and an effectful op without a rule (aten._print):
    the print runs eagerly between two XLA subgraphs, in order (it prints once per call, and not
    when inv's check failed first, as eager), the fallback warning names aten._print, and the
    result equals eager's (TOL); a singular input raises fx2xla.LinAlgError."""
    def fn(a):
        y = torch.linalg.inv(a)
        torch.ops.aten._print("printed by the graph")
        return torch.linalg.solve(a, y) + 1

    a = well_conditioned(n=3)
    expected = fn(a)
    torch._dynamo.reset()
    f = torch.compile(fn, backend="fx2xla")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        actual = f(a)
    check_same(actual, expected)
    printed = capfd.readouterr().out
    assert printed.count("printed by the graph") == 1, printed
    messages = [str(w.message) for w in seen]
    assert any("aten._print.default has no lowering rule" in m for m in messages), messages
    assert not any("with_effects" in m or "_linalg_check_errors" in m for m in messages), messages
    with pytest.raises(fx2xla.LinAlgError, match="linalg.inv: .*singular"):
        f(torch.zeros(3, 3, dtype=torch.float64))
    assert "printed by the graph" not in capfd.readouterr().out


def test_linalg_checks_in_a_training_step():
    """linalg.inv and linalg.solve in a float64 loss compiled for training (fallback="error"):
    the loss and the gradients of A and b equal eager's within 1e-10, and a singular A raises
    fx2xla.LinAlgError from the forward graph."""
    def loss(a, b):
        return (torch.linalg.inv(a) @ b).sum() + torch.linalg.solve(a, b).square().sum()

    a0, b0 = well_conditioned(n=4), make(4, 2, seed=1)
    results = []
    for f in (loss, compiled(loss)):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        out = f(a, b)
        out.backward()
        results.append((out.detach(), a.grad, b.grad))
    check_same(results[1], results[0])
    with pytest.raises(fx2xla.LinAlgError, match="singular"):
        f(torch.zeros(4, 4, dtype=torch.float64, requires_grad=True), b0)


def test_solver_backward_matches_eager():
    """Gradients (float64) of sum(cholesky_ex(A).L) + slogdet(A).logabsdet + sum(solve_ex(A, b))
    + sum(inv_ex(A)) + det(A) w.r.t. A and b, compiled (forward and AOTAutograd's backward graph,
    fallback="error"), equal eager's within 1e-10, as does the loss."""
    a0 = spd(2, dtype=torch.float64)
    b0 = make(2, 4, 2, dtype=torch.float64, seed=1)

    def loss(a, b):
        return (torch.linalg.cholesky_ex(a)[0].sum() + torch.linalg.slogdet(a)[1].sum()
                + torch.linalg.solve_ex(a, b)[0].sum() + torch.linalg.inv_ex(a)[0].sum() + torch.linalg.det(a).sum())

    grads = []
    for f in (loss, compiled(loss)):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        out = f(a, b)
        out.backward()
        grads.append((out.detach(), a.grad, b.grad))
    check_same(grads[1], grads[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_matrix_exp_matches_eager(dtype):
    """linalg.matrix_exp of a [2, 5, 5] batch (entries of scale 1 and 3) and of 1 x 1 matrices
    equals eager's within TOL x 100 (Padé against torch's Taylor polynomial), dtype and shape."""
    a = make(2, 5, 5, dtype=dtype)
    run_both(lambda a: (torch.linalg.matrix_exp(a), torch.linalg.matrix_exp(3 * a),
                        torch.linalg.matrix_exp(a[:, :1, :1])), a, scale=100)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linalg_eig(dtype):
    """linalg.eig and eigvals of a general [3, 5, 5] batch (real inputs give complex results, as
    eager's): eager's dtypes, shapes and eigenvalues, in eager's order (both are LAPACK's geev),
    within TOL x 10; each eigenvector of unit norm, A V = V diag(w), and each the same as eager's
    up to a phase (|v^H v_eager| = 1). An empty batch and 0 x 0 matrices give eager's shapes.
    The gradient of the eigenvalues' real parts (the trace's) matches eager's within TOL x 10."""
    a = make(3, 5, 5, dtype=dtype)
    (w, v), wv = compiled(torch.linalg.eig)(a), compiled(torch.linalg.eigvals)(a)
    we, ve = torch.linalg.eig(a)
    tol = _tol(we, 10)
    for x, e in ((w, we), (v, ve), (wv, we)):
        assert x.dtype == e.dtype and x.shape == e.shape, (x.dtype, x.shape, e.dtype, e.shape)
    torch.testing.assert_close(w, we, **tol)
    torch.testing.assert_close(wv, we, **tol)
    torch.testing.assert_close(torch.linalg.vector_norm(v, dim=-2), torch.ones(3, 5, dtype=w.real.dtype), **tol)
    torch.testing.assert_close(a.to(v.dtype) @ v, v * w.unsqueeze(-2), **tol)
    overlap = (v.conj() * ve).sum(-2).abs()
    torch.testing.assert_close(overlap, torch.ones_like(overlap), **tol)
    for shape in ((0, 3, 3), (2, 0, 0)):
        empty = torch.zeros(shape, dtype=dtype)
        check_same(compiled(torch.linalg.eig)(empty), torch.linalg.eig(empty))
    x = a.clone().requires_grad_()

    def loss(x):
        return torch.linalg.eigvals(x).real.sum()

    actual, = torch.autograd.grad(compiled(loss)(x), x)
    expected, = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(actual, expected, **_tol(expected, 10))


@pytest.mark.parametrize("dtype", DTYPES)
def test_geqrf_householder_product_ormqr(dtype):
    """geqrf (tall, wide, batched, empty), linalg.householder_product with every and with fewer
    reflectors, and ormqr in its four forms (Q C, Q^H C, C Q, C Q^H) from geqrf's reflectors:
    eager's values at TOL (LAPACK's own routines on both sides, so no sign is left free)."""
    g = torch.Generator().manual_seed(0)
    tall = torch.randn(6, 4, dtype=dtype, generator=g)
    wide = torch.randn(2, 3, 5, dtype=dtype, generator=g)
    run_both(lambda a, b: (*torch.geqrf(a), *torch.geqrf(b), *torch.geqrf(a[:0])), tall, wide)
    h, tau = torch.geqrf(tall)
    run_both(lambda h, t: (torch.linalg.householder_product(h, t), torch.linalg.householder_product(h, t[:2]),
                           torch.linalg.householder_product(h[:, :3], t[:0])), h, tau)
    c_left, c_right = torch.randn(6, 3, dtype=dtype, generator=g), torch.randn(2, 6, dtype=dtype, generator=g)
    run_both(lambda h, t, cl, cr: tuple(torch.ormqr(h, t, c, left=left, transpose=tr)
                                        for left, c in ((True, cl), (False, cr)) for tr in (False, True)),
             h, tau, c_left, c_right)
    hb, taub = torch.geqrf(torch.randn(3, 5, 5, dtype=dtype, generator=g))
    run_both(lambda h, t, c: (torch.ormqr(h, t, c), torch.ormqr(h[..., :2], t[..., :2], c, transpose=True)),
             hb, taub, torch.randn(3, 5, 2, dtype=dtype, generator=g))
