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

import fx2xla
import fx2xla.partition
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


@pytest.mark.parametrize("order", ["value_first", "views_first"])
def test_outputs_viewing_a_returned_value_share_its_memory(order):
    """`y = x * 2` returned beside views of it (y[1:], y.t()), in either order: as in eager, the
    outputs share one storage, so zeroing one view shows in y and in the other view, and every
    output's values before and after equal eager's exactly (float32)."""
    def fn(x):
        y = x * 2
        return (y, y[1:], y.t()) if order == "value_first" else (y[1:], y.t(), y)

    results = []
    for f in (fn, torch.compile(fn, backend="fx2xla")):
        torch._dynamo.reset()
        outs = f(torch.arange(6.0).reshape(3, 2))
        before = [o.clone() for o in outs]
        outs[1 if order == "value_first" else 0].zero_()
        results.append((before, [o.clone() for o in outs], {o.untyped_storage().data_ptr() for o in outs}))
    (e_before, e_after, e_storages), (a_before, a_after, a_storages) = results
    assert len(e_storages) == 1 and len(a_storages) == 1
    for a, e in zip(a_before + a_after, e_before + e_after):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("fn", [torch.tanh, lambda x: (torch.softmax(x * 2, -1), x.sum())], ids=["tanh", "softmax"])
def test_a_forward_returning_one_value_twice(fn):
    """A training forward whose saved activation is also the user's output returns that value
    twice (and it is viewed by no one else): both outputs reach AOTAutograd, so the compiled
    output and the input's gradient equal eager's (float32, rtol 1e-5, atol 1e-6)."""
    results = []
    for f in (fn, torch.compile(fn, backend="fx2xla")):
        torch._dynamo.reset()
        x = torch.linspace(-2, 2, 32).reshape(4, 8).requires_grad_()
        out = f(x)
        first = out[0] if isinstance(out, tuple) else out
        first.backward(torch.linspace(0, 1, 32).reshape(4, 8))
        results.append((first.detach(), x.grad))
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


VIEW_DTYPES = [(torch.float32, torch.int32), (torch.float32, torch.uint8), (torch.uint8, torch.float32),
               (torch.bfloat16, torch.int16), (torch.int16, torch.float16), (torch.int64, torch.float64),
               (torch.float64, torch.int32), (torch.int32, torch.int64), (torch.float32, torch.complex64),
               (torch.complex64, torch.float32), (torch.complex128, torch.int16), (torch.uint8, torch.bool),
               (torch.bool, torch.int8)]


@pytest.mark.parametrize("src,dst", VIEW_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_view_as_another_dtype(src, dst):
    """`x.view(dtype)` (aten.view.dtype) lowers (fallback="error") for same, smaller and larger
    item sizes, complex and bool among them, on a [4, 16]-byte input, a row-strided slice of a
    larger one, an empty one and (same item size) a 0-d one: dtype, shape and every byte equal
    eager's (bool: every value)."""
    def source(shape):
        if src is torch.bool:
            return torch.rand(shape, generator=torch.Generator().manual_seed(0)) > 0.5
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * src.itemsize), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(0))
        return raw.view(src)

    width = 16 // src.itemsize
    inputs = [source((4, width)), source((8, width))[::2], source((0, width))]
    if src.itemsize == dst.itemsize:
        inputs.append(source((1,)).reshape(()))
    f = torch.compile(lambda x: x.view(dst) if dst is torch.bool else x.view(dst) * 1, backend="fx2xla",
                      options={"fallback": "error"})
    for x in inputs:
        torch._dynamo.reset()
        actual, expected = f(x), x.view(dst)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
        if dst is torch.bool:
            assert torch.equal(actual, expected)
        else:
            assert torch.equal(actual.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


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


def test_as_strided_of_a_non_dense_input_runs_eagerly(monkeypatch):
    """as_strided of a strided slice reads the base's storage outside the slice, which the graph
    does not hold: that node runs eagerly and the result equals eager's exactly (float32), the
    warning saying the rule does not cover these arguments; under fallback="error" it raises
    UnsupportedOpError saying the same. (Not through `check`: its clone would make the input
    contiguous.)"""
    monkeypatch.setattr(fx2xla.partition, "warned_ops", set())
    x = make((4, 6))[:, ::2]
    fn = lambda x: fresh(x.as_strided((2, 2), (1, 1)) * 2)  # noqa: E731
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="as_strided.default has no lowering rule for these arguments"):
        actual = torch.compile(fn, backend="fx2xla", fullgraph=True)(x)
    torch.testing.assert_close(actual, fn(x), rtol=0, atol=0)
    torch._dynamo.reset()
    with pytest.raises(fx2xla.errors.UnsupportedOpError, match="does not cover these arguments"):
        torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})(x)


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
