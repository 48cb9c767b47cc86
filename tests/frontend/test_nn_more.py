"""More nn lowerings (fx2xla/lowering/nn.py, indexing.py) against eager PyTorch: 3-d pooling,
cdist/pdist, grid sampling (2-d and 3-d, and their backward), col2im, embedding_bag, adaptive and fractional max pooling,
antialiased resizing and nn.Embedding(max_norm). Ops the core-ATen table decomposes (col2im) or
whose auxiliary outputs eager code never returns (_embedding_bag) are checked on make_fx graphs
with test_nn's `check_graph`."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import tolerance
from test_nn import HALF_AND_FLOAT, check_grads, check_graph, make  # noqa: F401 (fixtures)

aten = torch.ops.aten
INF = float("inf")


# ---------------------------------------------------------------------------------------------
# 3-d pooling
# ---------------------------------------------------------------------------------------------

def test_max_pool3d(check):
    def fn(x):
        return (
            *F.max_pool3d(x, 2, return_indices=True),
            *F.max_pool3d(x, 3, 2, 1, ceil_mode=True, return_indices=True),
            *F.max_pool3d(x, (2, 3, 2), (1, 2, 2), (1, 1, 0), dilation=(1, 2, 1), return_indices=True),
            *F.max_pool3d(x[0], 2, return_indices=True),  # unbatched
        )

    check(fn, make(2, 2, 4, 7, 5))


def test_max_pool3d_bf16(check):
    check(lambda x: (*F.max_pool3d(x, (2, 3, 2), (1, 2, 2), 1, return_indices=True),),
          make(2, 2, 4, 7, 5, dtype=torch.bfloat16))


def test_max_pool3d_nan_and_ties(check):
    x = torch.zeros(1, 1, 3, 4, 4)
    x[0, 0, 1, 2, 1] = float("nan")
    x[0, 0, 2, 3, 3] = -INF
    check(lambda x: (*F.max_pool3d(x, 2, return_indices=True),
                     *F.max_pool3d(x, 3, 1, 1, return_indices=True)), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # eager has no bf16 kernel
def test_avg_pool3d(check, dtype):
    def fn(x):
        return (
            F.avg_pool3d(x, 2), F.avg_pool3d(x, 3, 2, 1),
            F.avg_pool3d(x, 3, 2, 1, count_include_pad=False),
            F.avg_pool3d(x, 3, 3, 1, ceil_mode=True),
            F.avg_pool3d(x, 3, 3, 1, ceil_mode=True, count_include_pad=False),
            F.avg_pool3d(x, (2, 3, 1), 2, (1, 1, 0), divisor_override=5),
        )

    check(fn, make(2, 3, 5, 7, 6, dtype=dtype))


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT)
def test_adaptive_avg_pool3d(check, dtype):
    def fn(x):
        return tuple(F.adaptive_avg_pool3d(x, s) for s in (1, (5, 2, 3), (3, 4, 5), (7, 8, 2)))

    check(fn, make(2, 3, 5, 8, 6, dtype=dtype))


def test_pool3d_backward(check_grads):
    # max_pool3d_with_indices_backward, avg_pool3d_backward, _adaptive_avg_pool3d_backward.
    def fn(x):
        y = F.max_pool3d(x, 3, 1, 1, ceil_mode=True)
        return y, F.avg_pool3d(y, 3, 2, 1, count_include_pad=False), F.adaptive_avg_pool3d(x, (3, 5, 2))

    check_grads(fn, make(2, 2, 4, 7, 5))


# ---------------------------------------------------------------------------------------------
# Distances
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cdist(check, dtype):
    def fn(a, b, big):
        return (
            torch.cdist(a, b), torch.cdist(a, b, p=1), torch.cdist(a, b, p=INF),
            torch.cdist(a, b, p=0.5), torch.cdist(a, b, p=3), torch.cdist(a, b, p=0),
            torch.cdist(a, big),  # > 25 rows: the matmul form
            # The matmul form cancels catastrophically at zero distance (error ~ sqrt(eps)|x|,
            # in eager too), so it is compared on pairs that are apart.
            torch.cdist(a, b[:, 2:], compute_mode="use_mm_for_euclid_dist"),
            torch.cdist(a, big, compute_mode="donot_use_mm_for_euclid_dist"),
            torch.cdist(a[0], b[1]), torch.cdist(a, b[:1]),  # unbatched; broadcast batch
        )

    a = make(2, 5, 4, dtype=dtype)
    b = torch.cat([a[:, :2], make(2, 4, 4, dtype=dtype, seed=1)], 1)  # some zero distances
    check(fn, a, b, make(2, 30, 4, dtype=dtype, seed=2))


def test_cdist_pdist_edges(check):
    check(lambda a, b, c: (torch.cdist(a, b), torch.cdist(a, b, p=1), torch.cdist(c, c),
                           F.pdist(c), F.pdist(a[0]), F.pdist(b[0])),
          torch.randn(1, 3, 0), torch.randn(1, 0, 0), torch.randn(4, 3).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_pdist(check, dtype):
    x = make(7, 5, dtype=dtype)
    x[3] = x[1]  # a zero distance
    check(lambda x: (F.pdist(x), F.pdist(x, 1), F.pdist(x, INF), F.pdist(x, 0), F.pdist(x, 2.5),
                     F.pdist(x[:1])), x)


# ---------------------------------------------------------------------------------------------
# grid sampling, col2im
# ---------------------------------------------------------------------------------------------

# (mode, padding_mode, align_corners) combinations, chosen so each value meets the others.
GRID_CASES = [("bilinear", "zeros", False), ("bilinear", "border", True), ("bilinear", "reflection", False),
              ("bilinear", "reflection", True), ("nearest", "zeros", True), ("nearest", "border", False),
              ("nearest", "reflection", False), ("bicubic", "zeros", False), ("bicubic", "border", True),
              ("bicubic", "reflection", False), ("bicubic", "reflection", True)]
GRID_CASES_3D = [c for c in GRID_CASES if c[0] != "bicubic"]  # eager: bicubic is 2-d only


def _grid_samples(x, grid, cases=GRID_CASES):
    return tuple(F.grid_sample(x, grid, mode=m, padding_mode=p, align_corners=a) for m, p, a in cases)


def _grid(*shape, seed=1, spread=3.2, dtype=torch.float32):
    """Grid points uniform in [-spread/2, spread/2]: inside, near and beyond the borders."""
    g = torch.rand(*shape, generator=torch.Generator().manual_seed(seed))
    return (g * spread - spread / 2).to(dtype)


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT)
def test_grid_sample(check, dtype):
    """2-d sampling, every mode (bicubic included) and padding: f32 rtol 1e-4 / atol 1e-5; bf16
    (coordinates rounded in bf16 as eager's kernel does) rtol 1.6e-2 / atol 1e-2."""
    cases = GRID_CASES if dtype == torch.float32 else GRID_CASES[::2]  # bf16: fewer, for time
    check(lambda x, g: _grid_samples(x, g, cases), make(2, 3, 5, 6, dtype=dtype), _grid(2, 4, 7, 2, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_grid_sample_3d(check, dtype):
    """3-d (trilinear and nearest) sampling in every padding mode; an empty output grid."""
    cases = GRID_CASES_3D if dtype != torch.bfloat16 else GRID_CASES_3D[::2]
    x = make(2, 3, 4, 5, 6, dtype=dtype)
    check(lambda x, g, e: _grid_samples(x, g, cases) + (F.grid_sample(x, e, align_corners=False),),
          x, _grid(2, 3, 4, 5, 3, dtype=dtype), _grid(2, 0, 4, 5, 3, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grid_sample_grads(check_grads, dtype):
    """Gradients for the input and the grid (eager's hand-written backward kernels), 2-d in
    every case and 3-d: f32 rtol 1e-4 / atol 1e-5, f64 1e-7."""
    check_grads(lambda x, g: _grid_samples(x, g), make(2, 3, 5, 6, dtype=dtype), _grid(2, 4, 7, 2, dtype=dtype))
    torch._dynamo.reset()
    check_grads(lambda x, g: _grid_samples(x, g, GRID_CASES_3D), make(1, 2, 4, 5, 3, dtype=dtype),
                _grid(1, 3, 2, 4, 3, dtype=dtype))


def test_grid_sample_grads_bf16():
    """bf16 gradients are those of the points the bf16 forward sampled (coordinates rounded in
    bf16, as eager's kernel rounds them; a float64 run samples elsewhere): within 5% of the
    largest element of eager's, for the input and the grid, 2-d (every mode) and 3-d."""
    from test_nn import grads

    cases = [(make(2, 3, 6, 7, dtype=torch.bfloat16), _grid(2, 4, 5, 2, dtype=torch.bfloat16), GRID_CASES[::2]),
             (make(1, 2, 4, 5, 3, dtype=torch.bfloat16), _grid(1, 3, 2, 4, 3, dtype=torch.bfloat16), GRID_CASES_3D[::2])]
    for x, grid, cases_ in cases:
        def fn(x, g):
            return _grid_samples(x, g, cases_)

        torch._dynamo.reset()
        actual = grads(torch.compile(fn, backend="fx2xla", fullgraph=True), x, grid)
        for a, e in zip(actual, grads(fn, x, grid), strict=True):
            assert a.dtype == e.dtype == torch.bfloat16 and a.shape == e.shape
            torch.testing.assert_close(a.float(), e.float(), rtol=0, atol=0.05 * e.float().abs().max().item() + 1e-3)


def test_grid_sample_grads_at_borders(check_grads):
    """Grid points on pixel centres, on the borders and far outside, where eager's gradient
    for the grid is 0 on and beyond a clipped border and flips sign with each reflection: the
    same gradients as eager's (float64, 1e-7), in every case, 2-d and 3-d."""
    pts = torch.tensor([-1.0, 1.0, 0.0, 5.0, -7.0, -0.25, 0.6, -1.0 - 1 / 3, 1 + 1 / 3], dtype=torch.float64)
    g2 = torch.stack(torch.meshgrid(pts, pts, indexing="ij"), -1)[None]
    check_grads(lambda x, g: _grid_samples(x, g), make(1, 2, 3, 4, dtype=torch.float64), g2)
    torch._dynamo.reset()
    g3 = torch.stack(torch.meshgrid(pts[:5], pts[4:], pts[2:7], indexing="ij"), -1)[None]
    check_grads(lambda x, g: _grid_samples(x, g, GRID_CASES_3D), make(1, 2, 3, 4, 2, dtype=torch.float64), g3)


def test_grid_sample_grad_input_only(check_grads):
    """A grid that needs no gradient (the backward op's output_mask asks for the input's
    only), and a spatial transformer's affine grid that needs one for its parameters."""
    grid = _grid(2, 4, 7, 2)

    def stn(x, theta):
        g = F.affine_grid(theta, (2, 3, 4, 7), align_corners=False)
        return F.grid_sample(x, g, mode="bilinear", padding_mode="border", align_corners=False)

    check_grads(lambda x: _grid_samples(x, grid, GRID_CASES[::3]), make(2, 3, 5, 6))
    torch._dynamo.reset()
    theta = torch.tensor([[[0.9, -0.2, 0.1], [0.3, 1.1, -0.2]], [[1.2, 0.0, 0.3], [0.1, 0.8, 0.0]]])
    check_grads(stn, make(2, 3, 5, 6), theta)


def test_grid_sample_exact_points(check):
    # Grid points on pixel centres, corners and far outside; a 1-pixel-wide input.
    grid = torch.tensor([[[[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], [5.0, -7.0], [-3.0, 0.25]]]])
    check(lambda x, w, g: _grid_samples(x, g) + _grid_samples(w, g, GRID_CASES[1::3]),
          make(1, 2, 4, 4), make(1, 2, 3, 1, seed=1), grid)


@pytest.mark.parametrize("dtype", HALF_AND_FLOAT)
def test_col2im(check_graph, dtype):
    def fn(a, b, c):
        return (F.fold(a, (5, 7), (2, 3), padding=1, stride=(1, 2)),
                F.fold(b, (7, 8), (2, 3), dilation=2, stride=2, padding=(1, 2)),
                F.fold(c, (4, 4), 2, stride=2))  # unbatched, non-overlapping

    check_graph(fn, make(2, 18, 24, dtype=dtype), make(2, 18, 16, dtype=dtype, seed=1),
                make(12, 4, dtype=dtype, seed=2), ops=[aten.col2im.default])


# ---------------------------------------------------------------------------------------------
# Embedding bag
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF_AND_FLOAT)
def test_embedding_bag(check, dtype):
    def fn(w, idx, off, idx2, psw):
        return (
            F.embedding_bag(idx, w, off, mode="sum"), F.embedding_bag(idx, w, off, mode="mean"),
            F.embedding_bag(idx, w, off, mode="max"),
            F.embedding_bag(idx, w, off, mode="mean", padding_idx=4),
            F.embedding_bag(idx, w, off, mode="sum", per_sample_weights=psw),
            F.embedding_bag(idx, w, torch.cat([off, off.new_tensor([8])]), mode="max",
                            include_last_offset=True),
            F.embedding_bag(idx2, w, mode="mean"),  # 2-d input: fixed-size bags
        )

    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    off = torch.tensor([0, 2, 2, 5])  # bag 1 is empty
    check(fn, make(10, 3, dtype=dtype), idx, off, idx.reshape(4, 2), make(8, dtype=dtype, seed=1))


@pytest.mark.parametrize("op", [aten._embedding_bag.default, aten._embedding_bag_forward_only.default])
def test_embedding_bag_aux_outputs(check_graph, op):
    # offset2bag, bag_size and max_indices against the CPU kernel, for modes sum, mean, max
    # (ties in max keep the first index).
    def fn(w, idx, off):
        last = torch.cat([off, off.new_tensor([8])])
        # With include_last_offset, forward_only's meta gives bag_size one more entry than the
        # CPU kernel; the registry follows the meta, so only the first two outputs compare.
        n = 4 if op is aten._embedding_bag.default else 2
        out = ()
        for mode in (0, 1, 2):
            out += (*op(w, idx, off, False, mode),
                    *op(w, idx, off, False, mode, False, None, False, 4),  # padding_idx
                    *op(w, idx, off, False, mode, False, None, False, 1),
                    *op(w.double(), idx, off, False, mode),
                    *op(w, idx, last, False, mode, False, None, True)[:n])
        return out

    w = make(10, 3)
    w[5] = w[4]  # a tie
    check_graph(fn, w, torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5]), ops=[op])


# ---------------------------------------------------------------------------------------------
# Adaptive max pooling
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF_AND_FLOAT)
def test_adaptive_max_pool(check, dtype):
    """adaptive_max_pool1d/2d/3d with indices: equal windows, overlapping ones (7 of 10), more
    outputs than inputs (13 of 10), global (1x1) and unbatched, exact values and indices at
    float32 and bfloat16 (a max is one of its inputs)."""
    x = make(2, 3, 10, 7, dtype=dtype)

    def fn(x):
        return (*(t for o in [(1, 1), (5, 7), (3, 4), (7, 5), (13, 9)]
                  for t in F.adaptive_max_pool2d(x, o, return_indices=True)),
                *F.adaptive_max_pool2d(x[0], (4, 3), return_indices=True),
                *F.adaptive_max_pool1d(x[:, :, 0], 4, return_indices=True))

    check(fn, x)
    check(lambda x: F.adaptive_max_pool3d(x, (2, 3, 2), return_indices=True), make(2, 2, 5, 7, 3, dtype=dtype))


def test_adaptive_max_pool_nan_ties_and_infinities(check):
    """Eager's scan order: the last NaN of a window wins (value NaN), ties keep the first
    maximum, a window of -inf returns its first element's index."""
    x = make(2, 3, 10, 7)
    x[0, 1, 2, 3] = x[0, 1, 2, 5] = float("nan")
    x[1, 2] = -INF
    x[1, 0, 0, 0:3] = 5.0
    check(lambda x: tuple(t for o in [(1, 1), (3, 4), (4, 3)]
                          for t in F.adaptive_max_pool2d(x, o, return_indices=True)), x)


@pytest.mark.parametrize("nd, out", [(2, (3, 4)), (2, (1, 1)), (2, (7, 5)), (3, (2, 3, 2))])
def test_adaptive_max_pool_backward(nd, out):
    """The gradient of nn.AdaptiveMaxPool2d/3d, overlapping windows included (an element that
    is the maximum of two windows gathers both gradients), against eager's at float32 (rtol /
    atol 1e-6), with the forward and backward lowered whole (fallback="error")."""
    x = make(2, 3, 10, 7) if nd == 2 else make(2, 2, 5, 7, 3)
    x.requires_grad_()
    pool = torch.nn.AdaptiveMaxPool2d(out) if nd == 2 else torch.nn.AdaptiveMaxPool3d(out)

    def loss(x):
        return (pool(x) * torch.arange(1.0, 1.0 + math.prod(out)).reshape(out)).square().sum()

    actual, = torch.autograd.grad(torch.compile(loss, backend="fx2xla", options={"fallback": "error"})(x), x)
    expected, = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def test_adaptive_max_pool_rejects_integers():
    """An integer input is eager's error, named with the op, not a silent result."""
    import fx2xla

    f = torch.compile(lambda x: F.adaptive_max_pool2d(x, 2), backend="fx2xla")
    with pytest.raises(fx2xla.errors.InvalidInputError, match="adaptive_max_pool2d.*not implemented"):
        f(torch.ones(1, 1, 4, 4, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Antialiased resizing
# ---------------------------------------------------------------------------------------------

AA_SIZES = [dict(size=(5, 7)), dict(size=(40, 11)), dict(size=(17, 9)), dict(scale_factor=0.37),
            dict(scale_factor=(2.5, 0.5)), dict(size=(6, 8), align_corners=True), dict(size=(1, 1))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_interpolate_antialias(check, mode, dtype):
    """F.interpolate(antialias=True) (torchvision's Resize on tensors): down- and upsampling,
    one axis unchanged, scale factors, align_corners, to 1x1, against eager at conftest's
    tolerance for the dtype, lowered whole."""
    x = make(2, 3, 17, 23, dtype=dtype, scale=3)
    check(lambda x: tuple(F.interpolate(x, mode=mode, antialias=True, **kw) for kw in AA_SIZES), x)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_interpolate_antialias_backward(mode):
    """The gradient of antialiased resizing (down, up, by a scale factor) against eager's at
    float32 (rtol 1e-4 / atol 1e-5), forward and backward lowered whole."""
    x = make(2, 3, 17, 23).requires_grad_()

    def loss(x):
        return sum(F.interpolate(x, mode=mode, antialias=True, **kw).square().sum() for kw in AA_SIZES[:4])

    actual, = torch.autograd.grad(torch.compile(loss, backend="fx2xla", options={"fallback": "error"})(x), x)
    expected, = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_interpolate_antialias_other_dtypes_run_eagerly():
    """uint8 (eager's fixed-point kernel) runs eagerly with eager's exact values (under
    fallback="error" it is an UnsupportedOpError); bf16, which eager rejects, raises eager's
    error."""
    import fx2xla

    x = torch.randint(0, 256, (1, 3, 17, 23), dtype=torch.uint8)

    def resize(x):
        return F.interpolate(x, size=(5, 7), mode="bilinear", antialias=True)

    fn = torch.compile(resize, backend="fx2xla")
    torch.testing.assert_close(fn(x), resize(x), rtol=0, atol=0)
    with pytest.raises(Exception, match="not implemented for 'BFloat16'"):
        fn(x.to(torch.bfloat16))
    torch._dynamo.reset()
    strict = torch.compile(resize, backend="fx2xla", options={"fallback": "error"})
    with pytest.raises(fx2xla.errors.UnsupportedOpError, match="_upsample_bilinear2d_aa"):
        strict(x)


# ---------------------------------------------------------------------------------------------
# nn.Embedding(max_norm=...)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_embedding_max_norm(norm_type, dtype):
    """nn.Embedding(max_norm=...) renormalizes the rows it reads in place
    (`embedding_renorm_`), lowered whole: the lookup and the weight after two calls (rows
    read twice, rows never read, rows under the limit) match eager's, float64 at 1e-12 and
    float32 at 1e-6 (the norm's summation order)."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(12, 5, max_norm=1.5, norm_type=norm_type).to(dtype)
    with torch.no_grad():
        model.weight[3] *= 0.1  # under the limit: left as it is
    twin = torch.nn.Embedding(12, 5, max_norm=1.5, norm_type=norm_type).to(dtype)
    twin.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="fx2xla", options={"fallback": "error"})
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)
    for idx in (torch.tensor([[1, 2, 2], [5, 1, 3]]), torch.tensor([7, 1])):
        with torch.no_grad():
            torch.testing.assert_close(compiled(idx), twin(idx), **tol)
        torch.testing.assert_close(model.weight, twin.weight, **tol)
    assert torch.equal(model.weight[0], twin.weight[0])  # never read: untouched


def test_embedding_max_norm_training():
    """A training step through nn.Embedding(max_norm=...): output, the renormalized weight and
    its gradient match eager's at float32 (rtol / atol 1e-6)."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(10, 4, max_norm=1.0)
    twin = torch.nn.Embedding(10, 4, max_norm=1.0)
    twin.load_state_dict(model.state_dict())
    idx = torch.tensor([[1, 2, 2], [5, 1, 9]])
    out = torch.compile(model, backend="fx2xla", options={"fallback": "error"})(idx)
    (out * torch.arange(4.0)).sum().backward()
    ref = twin(idx)
    (ref * torch.arange(4.0)).sum().backward()
    for a, e in [(out, ref), (model.weight, twin.weight), (model.weight.grad, twin.weight.grad)]:
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Fractional max pooling
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_fractional_max_pool(check, dtype):
    """fractional_max_pool2d/3d given their random samples: eager's window starts, values and
    indices exactly, for overlapping and tiling windows, an unbatched input, an empty batch and a
    1x1 output; in bf16/float16 too (window starts rounded at each step as eager's kernel rounds them)."""
    x2, x3 = make(2, 3, 9, 11, dtype=dtype), make(2, 2, 7, 8, 9, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    s2, s3 = torch.rand(2, 3, 2, generator=g, dtype=dtype), torch.rand(2, 2, 3, generator=g, dtype=dtype)
    check(lambda x, s: (*aten.fractional_max_pool2d(x, (3, 2), (4, 5), s),
                        *aten.fractional_max_pool2d(x, (2, 2), (1, 1), s),
                        *aten.fractional_max_pool2d(x[0], (2, 3), (3, 2), s[:1]),
                        *aten.fractional_max_pool2d(x[:0], (2, 2), (3, 3), s[:0])), x2, s2)
    check(lambda x, s: tuple(aten.fractional_max_pool3d(x, (2, 3, 2), (3, 3, 4), s)), x3, s3)
    if dtype in (torch.bfloat16, torch.float16):  # long rows, where rounding the starts matters
        torch._dynamo.reset()
        big, s_big = make(1, 2, 300, 129, dtype=dtype), torch.rand(1, 2, 2, generator=g).to(dtype)
        f = torch.compile(lambda x, s: aten.fractional_max_pool2d(x, (3, 3), (150, 43), s), backend="fx2xla",
                          options={"fallback": "error"})
        for a, e in zip(f(big, s_big), aten.fractional_max_pool2d(big, (3, 3), (150, 43), s_big), strict=True):
            assert torch.equal(a, e)


def test_fractional_max_pool_module_backward():
    """nn.FractionalMaxPool2d with fixed samples (`_random_samples`) in a training step: output
    and input gradient equal eager's (float32, rtol / atol 1e-6), lowered whole; with its own
    samples (drawn in the graph) two calls pick different windows, each of eager's shapes."""
    x = make(2, 3, 10, 12).requires_grad_()
    samples = torch.rand(2, 3, 2, generator=torch.Generator().manual_seed(1))
    pool = torch.nn.FractionalMaxPool2d(3, output_size=(4, 5), _random_samples=samples)

    def loss(x):
        return (pool(x) * torch.arange(20.0).reshape(4, 5)).sum()

    actual, = torch.autograd.grad(torch.compile(loss, backend="fx2xla", options={"fallback": "error"})(x), x)
    expected, = torch.autograd.grad(loss(x), x)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    free = torch.compile(torch.nn.FractionalMaxPool2d(3, output_size=(4, 5), return_indices=True), backend="fx2xla",
                         options={"fallback": "error"})
    (a, ia), (b, ib) = free(x.detach()), free(x.detach())
    assert a.shape == b.shape == (2, 3, 4, 5) and not torch.equal(ia, ib)


# ---------------------------------------------------------------------------------------------
# Batch norm as export graphs carry it
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_norm_with_update_functional(check, dtype):
    """aten._batch_norm_with_update_functional (training batch norm in torch.export and
    pre-dispatch graphs): the output, the batch mean and 1/std, the empty CPU reserve and the
    updated running statistics, against eager's kernel (f32 rtol 1e-4 / atol 1e-5, f64 1e-7),
    for 3-d and 4-d inputs."""
    op = torch.ops.aten._batch_norm_with_update_functional.default

    def fn(x, x4, w, b, rm, rv):
        return (*op(x, w, b, rm, rv, 0.1, 1e-5), *op(x4, w, b, rm, rv, 0.3, 1e-3))

    check(fn, make(4, 3, 5, dtype=dtype), make(2, 3, 4, 4, dtype=dtype, seed=1), make(3, dtype=dtype, seed=2),
          make(3, dtype=dtype, seed=3), make(3, dtype=dtype, seed=4), make(3, dtype=dtype, seed=5).abs())


# ---------------------------------------------------------------------------------------------
# Weight normalization
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 2, None])
def test_weight_norm_training(dtype, dim):
    """A training step through a Conv1d under `parametrizations.weight_norm` (as HuBERT's and
    WavLM's position embeddings: dim 2, the last; also dim 0, the fused kernel's other case, and
    None, the whole tensor, which eager computes without the fused op), with `fallback="error"`:
    the output, the loss and the grads of the direction `v` and the magnitude `g` match eager's
    at the dtype's tolerance (conftest: float32 rtol 1e-4 / atol 1e-5, bfloat16 rtol 1.6e-2 /
    atol 1e-2; eager's fused backward computes bf16 in float32, as fx2xla does)."""
    def model():
        torch.manual_seed(0)
        conv = torch.nn.Conv1d(8, 6, 5, padding=2).to(dtype)
        return torch.nn.utils.parametrizations.weight_norm(conv, dim=dim)

    m, twin = model(), model()
    x = torch.randn(3, 8, 11, generator=torch.Generator().manual_seed(1)).to(dtype)
    w = torch.rand(3, 6, 11, generator=torch.Generator().manual_seed(2)).to(dtype)
    compiled = torch.compile(m, backend="fx2xla", fullgraph=True, options={"fallback": "error"})
    out, ref = compiled(x), twin(x)
    loss, ref_loss = (out * w).float().square().mean(), (ref * w).float().square().mean()
    loss.backward()
    ref_loss.backward()
    tol = tolerance(dtype)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(loss, ref_loss, **tol)
    grads = dict(m.named_parameters())
    assert {"parametrizations.weight.original0", "parametrizations.weight.original1", "bias"} <= set(grads)
    for name, p in twin.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, **tol, msg=name)
