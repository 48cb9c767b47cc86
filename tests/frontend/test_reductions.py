"""Reduction, scan, sort and topk lowerings (fx2xla/lowering/reductions.py) against eager."""
from __future__ import annotations

import math

import pytest
import torch
# run_op/check_op: one-node graphs for overloads torch.compile never emits.
from test_elementwise import check_op, make

aten = torch.ops.aten
# An op without a rule must fail these tests, not fall back to eager ("fx2xla: aten.x has no
# lowering rule and runs eagerly ...").
pytestmark = pytest.mark.filterwarnings("error:fx2xla. .* has no lowering rule:UserWarning")
nan = math.nan

F32, BF16, I64, BOOL = torch.float32, torch.bfloat16, torch.int64, torch.bool


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [F32, BF16, I64, BOOL])
def test_sum(check, dtype):
    def fn(x):
        return (x.sum(), x.sum(1), x.sum((-1, 0)), x.sum(0, keepdim=True), x.sum(-2, dtype=torch.float64),
                torch.sum(x, (0, 2), keepdim=True))

    check(fn, make(dtype, 4, 5, 6))


def test_sum_bf16_accumulates_in_f32(check):
    # 4096 ones plus small values: bf16 accumulation would stall at 256.
    x = (torch.ones(2, 4096) + torch.rand(2, 4096) * 0.01).to(BF16)
    check(lambda x: (x.sum(1), x.sum(), x.mean(1), x.float().sum(1, dtype=BF16)), x)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_mean(check, dtype):
    check(lambda x: (x.mean(), x.mean(1), x.mean((0, -1), keepdim=True), x.mean(-1, dtype=torch.float64)),
          make(dtype, 4, 5, 6))


def test_mean_int_with_dtype(check):
    check(lambda x: (x.mean(1, dtype=F32), torch.mean(x, dtype=BF16)), make(I64, 4, 5))


@pytest.mark.filterwarnings("ignore:var\\(\\). degrees of freedom:UserWarning")  # the edge cases are deliberate
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_var(check, dtype):
    def fn(x):
        return (x.var(), x.var(1), x.var((0, 2), unbiased=False), x.var(-1, correction=2, keepdim=True),
                x.std(1), torch.var(x[:1, :1, :1], 1), torch.var(x[:, :2], 1, correction=3))

    check(fn, make(dtype, 4, 5, 6))


def test_var_overloads_directly():
    x = make(F32, 4, 5)
    check_op(aten.var.dim, x, [1], False)
    check_op(aten.var.dim, x, None, True, True)
    check_op(aten.var.correction, x, [0], correction=0.5)
    check_op(aten.var.correction, x, [], keepdim=True)


@pytest.mark.parametrize("dtype", [F32, BF16, I64, BOOL])
def test_amax_amin_max_min(check, dtype):
    def fn(x):
        return (x.amax(1), x.amin(1), x.amax((0, 2), keepdim=True), x.amin(-1), x.max(), x.min(),
                torch.amax(x, ()))

    x = make(dtype, 4, 5, 6)
    if dtype.is_floating_point:
        x[1, 2, 3] = nan  # propagates
    check(fn, x)


@pytest.mark.parametrize("dtype", [F32, BF16, I64])
def test_argmax_argmin(check, dtype):
    def fn(x):
        return (x.argmax(), x.argmin(), x.argmax(1), x.argmin(-1), x.argmax(0, keepdim=True),
                x.argmin(keepdim=True), x.argmax(1, keepdim=True))

    x = make(dtype, 5, 7, low=-3, high=3)  # small range: ties -> first occurrence
    check(fn, x)


def test_argmax_nan(check):
    x = torch.tensor([[1.0, nan, 5.0, nan], [nan, 2.0, 3.0, 1.0], [0.0, 0.0, -1.0, -1.0]])
    check(lambda x: (x.argmax(1), x.argmin(1), x.argmax(), x.argmin(0)), x)


@pytest.mark.parametrize("dtype", [F32, BF16, I64, BOOL])
def test_max_min_dim(check, dtype):
    def fn(x):
        return x.max(1), x.min(-1), x.max(0, keepdim=True), torch.min(x, 2, keepdim=True)

    x = make(dtype, 4, 5, 6, low=-3, high=3)
    if dtype.is_floating_point:
        x[0, 1, 2] = nan
    check(fn, x)


@pytest.mark.parametrize("dtype", [F32, I64, BOOL])
def test_any(check, dtype):
    def fn(x):
        return x.any(), x.any(1), x.any(-1, keepdim=True), torch.any(x, (0, 2)), torch.any(x, ())

    x = make(dtype, 4, 5, 6, low=-1, high=1) if dtype != BOOL else torch.rand(4, 5, 6) > 0.9
    if dtype.is_floating_point:
        x = torch.where(x.abs() < 0.8, 0.0, x)
        x[0] = 0.0
        x[1, 0, 0] = nan  # NaN is true
    check(fn, x)


@pytest.mark.parametrize("dtype", [F32, BF16, I64, BOOL])
def test_prod(check, dtype):
    def fn(x):
        return x.prod(), x.prod(1), x.prod(-1, keepdim=True), x.prod(0, dtype=torch.float64)

    x = make(dtype, 3, 4, 5, low=0.5, high=1.5) if dtype.is_floating_point else make(dtype, 3, 4, 5, low=-2, high=2)
    check(fn, x)


@pytest.mark.parametrize("dtype", [F32, BF16, I64, BOOL])
def test_cumsum(check, dtype):
    check(lambda x: (x.cumsum(1), x.cumsum(-1), x.cumsum(0, dtype=torch.float64)), make(dtype, 4, 64))


@pytest.mark.parametrize("dtype", [F32, BF16, I64, BOOL])
def test_sort(check, dtype):
    def fn(x):
        return (torch.sort(x), torch.sort(x, 0, descending=True), torch.sort(x, stable=True, descending=True),
                torch.sort(x, dim=-1, stable=True))

    x = make(dtype, 6, 9, low=-3, high=3)  # many ties: stable order is checked through the indices
    if dtype.is_floating_point:
        x[0, 0], x[1, 3], x[2, 2] = nan, nan, -0.0
    check(fn, x)


@pytest.mark.parametrize("dtype", [F32, BF16, I64])
def test_topk(check, dtype):
    def fn(x):
        return x.topk(3), x.topk(2, largest=False), x.topk(1, dim=0), torch.topk(x, 4, 0, largest=False)

    x = torch.randperm(6 * 9).reshape(6, 9).to(dtype)  # distinct values: indices are unambiguous
    check(fn, x)


def test_topk_nan_is_largest(check):
    x = torch.tensor([[1.0, nan, 3.0, 2.0], [4.0, 0.0, -1.0, nan]])
    check(lambda x: (x.topk(2), x.topk(2, largest=False)), x)


def test_zero_dim_and_empty(check):
    def fn(s, e):
        return (s.sum(), s.sum(0), s.mean(), s.argmax(), s.argmax(0), s.amax(), s.cumsum(0), s.max(0),
                torch.sort(s), s.topk(1), s.any(), s.prod(),
                e.sum(0), e.sum(), e.prod(0), e.mean(0), e.any(0), e.cumsum(0), e.sort(0), e.amax(1))

    check(fn, torch.tensor(2.5), make(F32, 0, 3))


def test_dynamic_shapes(check):
    def fn(x):
        return x.sum(1), x.mean(0), x.var(1), x.argmax(1), x.sort(1), x.topk(2), x.cumsum(0), x.max(1)

    for n in (5, 7):
        check(fn, make(F32, n, 6), dynamic=True)


def test_non_contiguous(check):
    x = make(F32, 6, 8)
    check(lambda a, b: (a.sum(0), a.argmax(1), a.cumsum(1), a.sort(0), b.var(1), b.max(0)),
          x.t(), make(F32, 5, 12)[:, ::3])


def test_sum_prod_overloads_directly():
    check_op(aten.sum.default, make(BOOL, 3, 4))
    check_op(aten.sum.default, make(BF16, 3, 4), dtype=F32)
    check_op(aten.prod.default, make(I64, 3, 4))
    check_op(aten.any.dims, make(F32, 3, 4), [])


# -- non-core ops that survive the core-ATen decompositions --------------------------------

@pytest.mark.parametrize("dtype", [F32, BF16])
def test_var_mean_norm(check, dtype):
    def fn(x):
        return (torch.var_mean(x, 1), torch.std_mean(x, (0, 2), keepdim=True), torch.var_mean(x, correction=0),
                x.norm(), x.norm(dim=1), torch.linalg.vector_norm(x, 1, dim=-1),
                torch.linalg.vector_norm(x, float("inf"), dim=(0, 1)), torch.linalg.vector_norm(x, -float("inf")),
                torch.linalg.vector_norm(x, 0, dim=0), torch.linalg.vector_norm(x, 3.5, dim=2, keepdim=True))

    x = make(dtype, 4, 5, 6)
    x[0, 0] = 0.0
    check(fn, x)


@pytest.mark.parametrize("dtype", [F32, I64])
def test_cumprod_cummax_logcumsumexp(check, dtype):
    def fn(x):
        out = (x.cumprod(1), x.cummax(1), x.cummin(0), x.cumprod(0, dtype=torch.float64))
        return out + ((torch.logcumsumexp(x, 1),) if x.is_floating_point() else ())

    x = make(dtype, 5, 8, low=-2, high=2)  # ties: latest index wins
    if dtype.is_floating_point:
        x = x.round()
        x[1, 3] = x[2, 5] = nan
    check(fn, x)


@pytest.mark.parametrize("dtype", [F32, torch.float64], ids=str)
def test_histc_matches_eager(dtype):
    """torch.histc with an explicit range (elements outside it and NaN not counted, the max in the
    last bin), with the data's own range (min == max == 0), with a constant input (the range
    widened by 1 each way), with a range that splits bins unevenly, and on expert ids as a MoE
    layer counts them: each count equal to eager's exactly, in the input's dtype; and a data range
    that is not finite raises as eager does (fx2xla.InvalidValueError against RuntimeError)."""
    import fx2xla

    x = torch.tensor([0., 1, 1, 2, 3, 3, 3, 7, 7.5, -1, nan, 2.999], dtype=dtype)
    cases = [(x, 4, 0, 3), (x[:9], 8, 0, 0), (torch.full((5,), 2., dtype=dtype), 3, 0, 0),
             (torch.rand(1000, dtype=dtype), 10, 0.1, 0.9), (torch.randint(0, 8, (64,)).to(dtype), 8, 0, 7)]
    for values, bins, lo, hi in cases:
        torch._dynamo.reset()
        f = torch.compile(lambda v: torch.histc(v, bins=bins, min=lo, max=hi), backend="fx2xla",
                          options={"fallback": "error"})
        out, expected = f(values), torch.histc(values, bins=bins, min=lo, max=hi)
        assert out.dtype == expected.dtype == dtype
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="not finite"):
        torch.histc(x, bins=4)
    with pytest.raises(fx2xla.InvalidValueError, match="not finite"):
        torch.compile(lambda v: torch.histc(v, bins=4), backend="fx2xla")(x)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})


@pytest.mark.parametrize("dtype", [F32, torch.float64], ids=str)
def test_histogram_matches_eager(dtype):
    """torch.histogram with a bin count (the data's range, a given range, a constant input whose
    range is widened by 0.5, an empty input over [0, 1], NaN and values outside the range not
    counted, weights, density) and with given edges: bin edges within 2 ulps of the largest edge
    of eager's (eager's
    compiler fuses linspace's start + step * i into one multiply-add; XLA rounds twice) and the
    outer edges exact, counts exact, weighted and density values at rtol 1e-6 (f32) / 1e-12
    (f64); a data range that is not finite raises fx2xla.InvalidValueError where eager raises
    RuntimeError."""
    import fx2xla

    x = torch.tensor([0., 1, 1, 2, 3, 3, 3, 7, 7.5, -1, nan, 2.999], dtype=dtype)
    r = torch.randn(1000, dtype=dtype)
    w = torch.rand(1000, dtype=dtype)
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == F32 else dict(rtol=1e-12, atol=1e-14)
    ulps = 2 * torch.finfo(dtype).eps
    cases = [
        (lambda v: torch.histogram(v, 7), r), (lambda v: torch.histogram(v, 13), r * 1e3 + 5),
        (lambda v: torch.histogram(v, 4, range=(0., 3.)), x), (lambda v: torch.histogram(v, 3), x[:9]),
        (lambda v: torch.histogram(v, 3), torch.full((5,), 2., dtype=dtype)),
        (lambda v: torch.histogram(v, 3), torch.zeros(0, dtype=dtype)),
        (lambda v: torch.histogram(v, 5, range=(2., 2.)), x[:9]),
        (lambda v: torch.histogram(v.reshape(10, 100), 6, weight=w.reshape(10, 100)), r),
        (lambda v: torch.histogram(v, 6, range=(-1., 1.5), weight=w, density=True), r),
        (lambda v: torch.histogram(v, torch.tensor([-1., 0., 0.25, 2.], dtype=dtype)), r),
        (lambda v: torch.histogram(v, torch.tensor([-1., 0., 0.25, 2.], dtype=dtype), weight=w, density=True), r),
    ]
    for fn, values in cases:
        hist, edges = _compiled(fn)(values)
        expected_hist, expected_edges = fn(values)
        assert hist.dtype == expected_hist.dtype == dtype and edges.dtype == dtype
        span = expected_edges.abs().max().item()
        torch.testing.assert_close(edges, expected_edges, rtol=0, atol=ulps * span)
        torch.testing.assert_close(edges[[0, -1]], expected_edges[[0, -1]], rtol=0, atol=0)
        torch.testing.assert_close(hist, expected_hist, **tol)
    with pytest.raises(RuntimeError, match="not finite"):
        torch.histogram(x, 4)
    with pytest.raises(fx2xla.InvalidValueError, match="not finite"):
        _compiled(lambda v: torch.histogram(v, 4))(x)


@pytest.mark.parametrize("dtype", [F32, BF16, I64, BOOL, torch.int8, torch.uint8, torch.float64], ids=str)
def test_hash_tensor(dtype):
    """torch.hash_tensor: the xor of the elements' 64-bit patterns (floats widened to float64,
    signed integers sign-extended), over everything, one dim, two dims with keepdim, and an empty
    row: uint64, equal to eager's exactly."""
    x = (torch.randn(4, 5, 3) * 50).to(dtype) if dtype != BOOL else torch.rand(4, 5, 3) > 0.5

    def fn(x):
        return (torch.hash_tensor(x), torch.hash_tensor(x, 1), torch.hash_tensor(x, [0, 2], keepdim=True),
                torch.hash_tensor(x[:, :0], 0))

    for a, e in zip(_compiled(fn)(x), fn(x), strict=True):
        assert a.dtype == e.dtype == torch.uint64 and a.shape == e.shape
        assert torch.equal(a, e)


def test_histogramdd_matches_eager():
    """torch.histogramdd with bin counts (the points' range, a given range, a constant dim),
    with weights and density, and with given edge tensors; 2-d and 3-d points, an empty set:
    edges within 2 ulps of eager's largest edge (float32), counts exact, densities at rtol 1e-6."""
    g = torch.Generator().manual_seed(0)
    pts = torch.randn(200, 3, generator=g)
    pts[:, 2] = 1.5
    w = torch.rand(200, generator=g)
    edges = [torch.tensor([-2., 0., 0.5, 3.]), torch.tensor([-1., 1.])]
    cases = [
        (lambda p: torch.histogramdd(p, [3, 4, 2]), pts),
        (lambda p: torch.histogramdd(p[:, :2], [5, 2], range=[-1., 1., 0., 2.]), pts),
        (lambda p: torch.histogramdd(p.reshape(10, 20, 3), [2, 3, 2], weight=w.reshape(10, 20), density=True), pts),
        (lambda p: torch.histogramdd(p[:, :2], edges, weight=w), pts),
        (lambda p: torch.histogramdd(p[:0], [2, 2, 3]), pts),
    ]
    ulps = 2 * torch.finfo(F32).eps
    for fn, values in cases:
        actual, expected = _compiled(fn)(values), fn(values)
        torch.testing.assert_close(actual.hist, expected.hist, rtol=1e-6, atol=1e-7)
        assert len(actual.bin_edges) == len(expected.bin_edges)
        for a, e in zip(actual.bin_edges, expected.bin_edges):
            torch.testing.assert_close(a, e, rtol=0, atol=ulps * e.abs().max().item())


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
def test_segment_reduce_matches_eager(reduce):
    """torch.segment_reduce by lengths and by offsets, with and without `initial`, an empty
    segment, ties for max/min and zeros for prod; along axis 1 with 2-d lengths; bf16: values
    and the gradients for data as eager's (f32 rtol 1e-5 / atol 1e-6, bf16 1.6e-2 / 1e-2)."""
    data = torch.tensor([1., 3., 3., 0., 2., 5., 0., 0., -1.5])
    lengths, offsets = torch.tensor([3, 2, 0, 4]), torch.tensor([0, 3, 5, 5, 9])
    weights = torch.tensor([1., 2., 3., 4.])
    wide = torch.randn(2, 6, 3)
    cases = [
        (lambda d: torch.segment_reduce(d, reduce, lengths=lengths), data),
        (lambda d: torch.segment_reduce(d, reduce, lengths=lengths, initial=4.), data),
        (lambda d: torch.segment_reduce(d, reduce, offsets=offsets, initial=-2.), data),
        (lambda d: torch.segment_reduce(d, reduce, lengths=torch.tensor([[1, 5], [3, 3]]), axis=1), wide),
        (lambda d: torch.segment_reduce(d, reduce, lengths=lengths), data.to(BF16)),
    ]
    for fn, values in cases:
        torch._dynamo.reset()
        results = []
        for f in (fn, torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})):
            d = values.clone().requires_grad_()
            out = f(d)
            w = weights.reshape((-1,) + (1,) * (out.dim() - 1)) if out.shape[0] == 4 else torch.ones(())
            grad, = torch.autograd.grad((out.float() * w).nansum(), d)
            results.append((out.detach(), grad))
        tol = dict(rtol=1.6e-2, atol=1e-2) if values.dtype == BF16 else dict(rtol=1e-5, atol=1e-6)
        for a, e in zip(results[1], results[0]):
            assert a.dtype == e.dtype and a.shape == e.shape
            torch.testing.assert_close(a, e, equal_nan=True, **tol)


def test_segment_reduce_lengths_checked():
    """Lengths that do not add up to the data's size, or a negative one, raise
    fx2xla.InvalidValueError where eager raises RuntimeError; unsafe=True skips the check."""
    import fx2xla

    data = torch.randn(6)
    f = _compiled(lambda d, n: torch.segment_reduce(d, "sum", lengths=n))
    for bad in (torch.tensor([2, 3]), torch.tensor([7, -1])):
        with pytest.raises(RuntimeError):
            torch.segment_reduce(data, "sum", lengths=bad)
        with pytest.raises(fx2xla.InvalidValueError, match="lengths"):
            f(data, bad)
    ok = torch.tensor([2, 4])
    torch.testing.assert_close(f(data, ok), torch.segment_reduce(data, "sum", lengths=ok))
