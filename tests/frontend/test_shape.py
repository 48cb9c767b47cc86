"""Shape ops (views, cat, slicing, padding, slice scatters, sizes) against eager PyTorch.

A graph output that is a view of a graph input is rebuilt by AOTAutograd from the input,
never read from the executable, so view results are passed through `fresh` (x + x, exact
for every dtype) to make the compiled values the ones compared.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fx2xla.compiled_graph import CompiledGraph
from fx2xla.runtime import default_device

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def make(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-9, 10, shape, generator=g, dtype=dtype)


def fresh(*views):
    out = tuple(v + v for v in views)
    return out if len(out) > 1 else out[0]


@pytest.fixture
def check_graph():
    """Like `check`, for ops torch's core decomposition table rewrites before fx2xla sees
    them: `fn` is traced with make_fx (no decompositions) and compiled by fx2xla directly."""

    def run(fn, *args, tracing_mode="fake"):
        gm = make_fx(fn, tracing_mode=tracing_mode)(*args)
        fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        actual = CompiledGraph(gm, fakes, default_device(), "test")(list(args))
        expected = fn(*args)
        expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            if isinstance(e, torch.Tensor):
                assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, a.shape, e.dtype, e.shape)
                torch.testing.assert_close(a, e, rtol=0, atol=0)
            else:
                assert a == e
        return actual

    return run


@pytest.mark.parametrize("dtype", DTYPES)
def test_view_unsqueeze_squeeze(check, dtype):
    def fn(x):
        y = x.view(2, 1, 3, 1, 4)
        return fresh(
            x.view(6, 4), x.view(-1), x.view(4, -1, 2), x.unsqueeze(0), x.unsqueeze(-1),
            y.squeeze(1), y.squeeze(-2), y.squeeze((0, 1, 3)), y.squeeze(),
        )

    check(fn, make((2, 3, 4), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_expand(check, dtype):
    def fn(x):
        return fresh(
            x.permute(2, 0, 1), x.permute(-1, -3, -2), x.transpose(0, 1),
            x[:, :1].expand(5, -1, 3, -1), x[:1, :, :1].expand(-1, 3, 5),
        )

    check(fn, make((2, 3, 4), dtype))


def test_views_of_noncontiguous_inputs():
    # Not through `check`: its clone of the inputs would make the strided slice contiguous.
    x = make((4, 6)).t()  # a permuted input
    y = make((4, 6))[:, ::2]  # a strided slice input
    fn = lambda x, y: fresh(x.permute(1, 0), x.unsqueeze(1), y[1:, :2], y.select(1, -1), y.flip(0))  # noqa: E731
    actual = torch.compile(fn, backend="fx2xla", fullgraph=True)(x, y)
    for a, e in zip(actual, fn(x, y), strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_zero_dim_and_empty(check):
    s, e = make(()), make((0, 3))
    check(
        lambda s, e: fresh(s.view(1, 1), s.unsqueeze(0), s.expand(3), s.view(1).squeeze(0), e.view(3, 0), e.permute(1, 0), e[:, 1:], e.select(1, -1)),
        s, e,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_cat(check, dtype):
    a, b, c = make((2, 3), dtype, 1), make((2, 1), dtype, 2), make((1, 3), dtype, 3)
    check(lambda a, b, c: (torch.cat([a, b, a], -1), torch.cat([a, c], 0), torch.cat([a])), a, b, c)


def test_cat_skips_legacy_empty_and_promotes(check):
    a, b = make((2, 3)), make((1, 3), torch.int64)
    check(lambda a, b, e: (torch.cat([a, e, b]), torch.cat([e, a.bfloat16(), b], 0), torch.cat([e, e])), a, b, torch.empty(0, dtype=torch.int64))
    check(lambda a, b: (torch.cat([a[:0], b], 0), torch.cat([a[:, :0], b[:, :0]], 1)), a, make((2, 3), torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_slice(check, dtype):
    def fn(x):
        return fresh(
            x[1:], x[:-1], x[-100:100], x[::2], x[1:7:3], x[5:2], x[:, -2:], x[:, 1::2],
            aten.slice.Tensor(x, 1, None, -1), aten.slice.Tensor(x, -1, -3, None, 2),
            aten.slice.Tensor(x, 0, 2, 2**62), aten.slice.Tensor(x, 0, -2**62, 3, 4),
        )

    check(fn, make((8, 5), dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_select_split(check, dtype):
    def fn(x):
        parts = x.split([1, 2, 1], dim=-1) + x.split(2) + x.chunk(3, 1)
        return fresh(x[1], x[:, -1], x.select(-1, -2), x[-3, 0], *parts)

    check(fn, make((3, 4, 4), dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_diagonal(check, dtype):
    def fn(x):
        return fresh(
            x.diagonal(), x.diagonal(1), x.diagonal(-1, 0, 2), x.diagonal(0, -1, 0),
            x.diagonal(7), x[0].diagonal(-2),
        )

    check(fn, make((3, 4, 5), dtype))


def test_as_strided(check):
    def fn(x):
        windows = x.view(-1).as_strided((4, 3), (2, 1))  # overlapping sliding windows
        return fresh(x.as_strided((3, 3), (1, 3)), x.as_strided((2, 2), (4, 1), 5), windows, (x + 1).as_strided((4, 5), (5, 1)), x.as_strided((2, 0), (1, 1)))

    check(fn, make((4, 5)))


def test_as_strided_reads_storage_of_permuted_input(check):
    # The input arrives permuted; as_strided must read torch's storage order, not the logical one.
    x = make((5, 4)).t()
    check(lambda x: fresh(x.as_strided((5, 4), (4, 1)), x.as_strided((3,), (5,), 1)), x)


def test_as_strided_rejects_non_dense_input():
    # torch would read the base's storage outside the slice, which the graph does not have.
    # (Not through `check`: its clone of the input would make it contiguous.)
    x = make((4, 6))[:, ::2]
    with pytest.raises(Exception, match="non-dense view"):
        torch.compile(lambda x: fresh(x.as_strided((2, 2), (1, 1))), backend="fx2xla", fullgraph=True)(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flip_repeat(check, dtype):
    x = make((2, 3, 4), dtype)
    check(lambda x: (x.flip(0), x.flip(-1, 0), x.flip(()), x.repeat(2, 1, 3), x.repeat(2, 1, 1, 2), x.repeat(1, 0, 1), x[0, 0].repeat(2)), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_pad(check, dtype):
    value = True if dtype == torch.bool else (3 if dtype == torch.int64 else 2.5)
    x = make((2, 3, 4), dtype)
    check(lambda x: (F.pad(x, (1, 2)), F.pad(x, (1, -1, 2, 0), value=value), F.pad(x, (0, 0, -1, -2, 1, 1)), F.pad(x, (-2, -2))), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_reflection_replication_pad(check_graph, dtype):
    x1, x2, x3 = make((2, 5), dtype), make((2, 4, 5), dtype), make((1, 2, 3, 4, 5), dtype)

    def fn(x1, x2, x3):
        return (
            aten.reflection_pad1d(x1, [2, 4]), aten.reflection_pad1d(x2, [0, 3]),
            aten.reflection_pad2d(x2, [1, 2, 3, 0]), aten.reflection_pad2d(x3[0], [4, 4, 1, -1]),
            aten.reflection_pad3d(x3, [1, 0, 2, 1, 2, 2]),
            aten.replication_pad1d(x2, [3, 1]), aten.replication_pad2d(x2, [2, 0, 5, 1]),
            aten.replication_pad3d(x3, [0, 2, 1, 1, 3, 0]),
        )

    check_graph(fn, x1, x2, x3)


def test_pads_through_decomposition(check):
    x = make((1, 2, 4, 5))
    check(lambda x: (F.pad(x, (1, 2, 2, 1), mode="reflect"), F.pad(x, (2, 1, 0, 3), mode="replicate"), F.pad(x[0], (3, 1), mode="reflect")), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slice_scatter_select_scatter(check, dtype):
    x, src = make((6, 5), dtype, 1), make((6, 5), dtype, 2)

    def fn(x, src):
        return (
            torch.slice_scatter(x, src[:2], 0, 1, 3), torch.slice_scatter(x, src[:, :2], 1, -2),
            torch.slice_scatter(x, src[:3], 0, None, None, 2), torch.slice_scatter(x, src[:, :2], 1, 1, 100, 3),
            torch.slice_scatter(x, src[:0], 0, 4, 2), torch.slice_scatter(x, src, 0),
            torch.select_scatter(x, src[0], 0, -1), torch.select_scatter(x, src[:, 1], 1, 2),
        )

    check(fn, x, src)


def test_select_scatter_and_squeeze_dim_rules(check_graph):
    x, src = make((3, 1, 4)), make((3, 4))
    check_graph(lambda x, s: (aten.select_scatter(x, s, 1, 0), aten.select_scatter(x, s[0:1], 0, -2), aten.squeeze.dim(x, 1), aten.squeeze.dim(x, -1)), x, src)


def test_slice_scatter_from_inplace_update(check):
    def fn(x, v):
        y = x + x
        y[:, 1:3] = v
        y[::2, 0] = v[0, 0]
        return y

    check(fn, make((4, 5)), make((4, 2)))


def test_sizes_in_dynamic_graphs(check, check_graph):
    x = make((4, 6))
    check(lambda x: (x.view(x.shape[0] * 2, -1) * x.numel(), x.t().contiguous() * x.stride(0)), x, dynamic=True)
    check(lambda x: x[1:].reshape(-1) * x.numel(), make((6, 3)), dynamic=True)
    check_graph(
        lambda x: (x.view(x.size(0) * 3, -1), x.size(1), x.stride(0), x.stride(1), x.storage_offset(), x.numel()),
        make((4, 6)), tracing_mode="symbolic",
    )
