"""Indexing ops (advanced indexing, index_put, gather/scatter, embedding) against eager PyTorch.

Index tensors are passed as inputs: their values then come from the call, never from
constants folded at trace time.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fx2xla.compiled_graph import CompiledGraph
from fx2xla.errors import LoweringError
from fx2xla.runtime import default_device

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


def make(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-9, 10, shape, generator=g, dtype=dtype)


def ind(*values):
    return torch.tensor(values, dtype=torch.int64)


def compile_graph(fn, *args):
    """`fn` traced with make_fx (no decompositions, so ops torch's core table would rewrite
    reach their rule) and compiled by fx2xla; returns the outputs of one call."""
    gm = make_fx(fn)(*args)
    fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    return CompiledGraph(gm, fakes, default_device(), "test")(list(args))


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_advanced(check, dtype):
    x = make((4, 5, 6), dtype)
    i, j = ind([0, 3], [-1, 1]), ind(2, -4, 0)

    def fn(x, i, j):
        # adjacent advanced indices stay in place; separated ones move to the front
        return x[i], x[:, i], x[i, :, j[:2]], x[:, i, j[:2]], x[i, j[:2]], x[..., j], x[None, i, None, j[:1]], x[j, 1:3], x[:, :, i]

    check(fn, x, i, j)


def test_index_broadcasting_and_empty(check):
    x = make((4, 5))
    check(lambda x, r, c, e: (x[r[:, None], c], x[r[:, None], c[None, :2]], x[e], x[e, 2], aten.index.Tensor(x, [r[0]])), x, ind(0, 2, -1), ind(4, 1, 0), ind())


def test_index_rejects_boolean_mask():
    x = make((3, 4))
    with pytest.raises(LoweringError, match="data-dependent"):
        compile_graph(lambda x, m: aten.index.Tensor(x, [m]), x, x > 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_index_put(check, dtype):
    x, v = make((4, 5), dtype, 1), make((2, 5), dtype, 2)

    def fn(x, v, i, j):
        a, b, c, d = x + x, x + x, x + x, x + x
        a[i] = v  # rows
        b[:, j] = v[0, :3]  # columns, through a None entry
        c[i, j[:2]] = v[1, 0]  # broadcast scalar value
        d.index_put_((i, j[:2]), v[0, :2], accumulate=True)
        return a, b, c, d

    check(fn, x, v, ind(-1, 1), ind(4, 0, -2))


def test_index_put_accumulates_duplicates(check):
    x, v = make((4, 3)), make((5, 3))
    check(lambda x, v, i: aten.index_put(x, [i], v, True), x, v, ind(1, 1, -3, 0, 1))
    check(lambda x, v, i: aten.index_put(x, [None, i], v[:3, :3], True), x.t().contiguous(), v, ind(2, 2, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_index_put_boolean_mask(check, dtype):
    x = make((3, 4), dtype)

    def fn(x, m, s, row):
        a, b, c, d = x + x, x + x, x + x, x + x
        a[m] = s  # 0-d value
        b[:, m[0]] = s  # mask after a None entry
        c[m[:, 0]] = row  # mask over leading dims, value per remaining row
        d.index_put_((m,), s.reshape(1), accumulate=True)
        return a, b, c, d

    check(fn, x, x > 0, make((), dtype, 1), make((4,), dtype, 2))


def test_index_select_gather(check):
    x = make((4, 5))
    ix = ind([[0, 4, 4], [1, 0, 2]], [[3, 3, 3], [0, 1, 2]])

    def fn(x, i, ix):
        return (
            torch.index_select(x, 0, i), torch.index_select(x, -1, i), torch.index_select(x, 1, i[0]),
            torch.gather(x, 1, ix[0]), torch.gather(x, 0, ix[1]), torch.gather(x, -1, ix[0][:, :0]),
            torch.gather(x[0, 0], 0, i[1]),
        )

    check(fn, x, ind(3, 0, 0, 2), ix)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_dtypes_noncontiguous(check, dtype):
    x = make((5, 4), dtype).t()  # a permuted input
    check(lambda x, i: (torch.gather(x, 1, i), x.index_select(0, i[:, 0])), x, ind([0, 4], [3, 3], [1, 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_scatter_scatter_add(check, dtype):
    x, src = make((3, 5), dtype, 1), make((4, 6), dtype, 2)
    idx = ind([0, 1, 2, 0, 4], [2, 2, 1, 0, 3])  # duplicates only within scatter_add

    def fn(x, src, idx, perm):
        return (
            x.scatter(0, perm, src[:2, :5]), x.scatter(1, perm[:, :3].t(), src), x.scatter(-1, perm[:, :2], 7),
            x.scatter_add(1, idx, src), x.scatter_add(0, idx[:, :3] % 3, src),
        )

    check(fn, x, src, idx, ind([2, 0, 1, 1, 0], [0, 2, 0, 2, 2]))


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_scatter_reduce(check, reduce, dtype):
    x, src = make((3, 4), dtype, 1), make((2, 4), dtype, 2)

    def fn(x, src, idx):
        return (
            x.scatter_reduce(0, idx, src, reduce), x.scatter_reduce(0, idx, src, reduce, include_self=False),
            x.scatter_reduce(1, idx[:, :3].t() % 4, src.t(), reduce, include_self=False),
        )

    check(fn, x, src, ind([0, 2, 2, 0], [2, 2, 1, 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding(check, dtype):
    w = make((10, 4), dtype)
    check(lambda w, i: (F.embedding(i, w), F.embedding(i[0], w, padding_idx=0), F.embedding(i[0, 0], w)), w, ind([1, 9, 0], [3, 3, 7]))


def test_embedding_backward_through_decomposition():
    # The training path: torch decomposes embedding_dense_backward into index_put(accumulate).
    w, i, g = make((10, 4)), ind([1, 9, 3], [3, 1, 7]), make((2, 3, 4))
    grads = []
    for f in (F.embedding, torch.compile(F.embedding, backend="fx2xla", fullgraph=True)):
        weight = w.clone().requires_grad_()
        f(i, weight, padding_idx=3).backward(g)
        grads.append(weight.grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert grads[0][3].abs().sum() == 0 and grads[0][1].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_dense_backward_rule(dtype):
    grad, idx = make((2, 3, 4), dtype), ind([1, 9, 3], [3, 1, 1])
    for padding_idx, by_freq in [(-1, False), (3, False), (1, True)]:
        fn = lambda g, i: aten.embedding_dense_backward(g, i, 10, padding_idx, by_freq)  # noqa: E731
        (actual,) = compile_graph(fn, grad, idx)
        expected = fn(grad, idx)
        assert actual.dtype == expected.dtype
        torch.testing.assert_close(actual, expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_masked_scatter(check, dtype):
    x, src = make((3, 4), dtype, 1), make((20,), dtype, 2)
    m = make((3, 4), torch.bool, 3)
    check(lambda x, m, s: (x.masked_scatter(m, s), x.masked_scatter(m[0], s), x.masked_scatter(m & False, s[:0])), x, m, src)


def test_gather_scatter_zero_dim_and_empty_operands(check):
    """gather and the scatters read a 0-d input, index or source as one element (eager's
    rule): a 0-d index into a 1-d input, a 1-d index into a 0-d input (scatter_add sums both
    sources into the one element); an empty index of higher rank than the input gathers an
    empty result and scatters nothing. Exact at float32."""
    v, s = torch.arange(4.0), torch.tensor(3.0)
    check(lambda v, i: (torch.gather(v, 0, i), v.scatter(0, i, torch.tensor([5.0, 6.0])), v.scatter(0, i, 7.0),
                        v.scatter_add(0, i, torch.tensor([5.0, 6.0])),
                        v.scatter_reduce(0, i, torch.tensor(5.0), "amax")), v, torch.tensor(2))
    check(lambda s, i: (torch.gather(s, 0, i), s.scatter_add(0, i, torch.tensor([5.0, 6.0])),
                        s.scatter_reduce(0, i, torch.tensor([5.0, 6.0]), "mean", include_self=False)),
          s, torch.tensor([0, 0]))
    empty = torch.zeros(2, 0, dtype=torch.long)
    check(lambda v, i: (torch.gather(v, 0, i), v.scatter(0, i, torch.ones(2, 0)), v.scatter_add(0, i, torch.ones(2, 0)),
                        v.scatter_reduce(0, i, torch.ones(2, 0), "mean")), v, empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_scatter_with_reduce_argument(check, dtype):
    """The older `scatter(..., reduce="add" | "multiply")`, with a tensor and with a scalar
    source, along both dims, repeated indices included; exact."""
    x = torch.full((4, 3), 2, dtype=dtype)
    index = torch.tensor([[0, 1, 0], [3, 3, 0]])
    src = torch.arange(1, 7, dtype=dtype).reshape(2, 3)
    check(lambda x, i, s: (x.scatter(0, i, s, reduce="add"), x.scatter(0, i, s, reduce="multiply"),
                           x.scatter(0, i, 3, reduce="multiply"), x.scatter(1, i.clamp(max=2), 3, reduce="add")),
          x, index, src)


def test_repeat_interleave_with_output_size(check):
    """repeat_interleave with output_size (a static result size) lowers: repeats with zeros,
    leading zeros, int32 repeats, and `x.repeat_interleave(repeats, dim, output_size=)`, exact."""
    check(lambda r: torch.repeat_interleave(r, output_size=6), torch.tensor([1, 2, 0, 3]))
    check(lambda r: torch.repeat_interleave(r, output_size=3), torch.tensor([0, 0, 3], dtype=torch.int32))
    check(lambda x, r: torch.repeat_interleave(x, r, dim=1, output_size=6), torch.arange(8.0).reshape(2, 4),
          torch.tensor([1, 2, 0, 3]))


@pytest.mark.parametrize("repeats, size, words", [([1, 2, 0, 3], 5, "does not match the sum"),
                                                  ([3, -1], 2, "can not be negative")])
def test_repeat_interleave_bad_output_size_raises(repeats, size, words):
    """An output_size other than the repeats' sum, or a negative repeat, raises (eager raises
    too), naming the op; never a silently short or padded result."""
    import fx2xla

    f = torch.compile(lambda r: torch.repeat_interleave(r, output_size=size), backend="fx2xla")
    with pytest.raises(fx2xla.InvalidValueError, match=f"repeat_interleave.*{words}"):
        f(torch.tensor(repeats))


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
def test_index_reduce(check, reduce, dtype):
    """Tensor.index_reduce along dims 0 and 1, with and without include_self, repeated and
    unused indices, and a 0-d input: eager's values (integer means rounded down; f32 rtol 1e-4 /
    atol 1e-5, bf16 1.6e-2 / 1e-2, int64 exact)."""
    x, src, src1 = make((4, 3), dtype, 1), make((5, 3), dtype, 2), make((4, 2), dtype, 3)

    def fn(x, src, src1, idx, idx1, s0, s1):
        return (x.index_reduce(0, idx, src, reduce), x.index_reduce(0, idx, src, reduce, include_self=False),
                x.index_reduce(1, idx1, src1, reduce, include_self=False), x.index_reduce(-1, idx1, src1, reduce),
                s0.index_reduce(0, idx[:1] * 0, s1, reduce))

    check(fn, x, src, src1, ind(3, 0, 3, 1, 3), ind(2, 2), make((), dtype, 4), make((), dtype, 5))


def test_index_reduce_rejections():
    """An index outside [0, size) raises fx2xla.IndexOutOfRangeError (eager: IndexError), and a
    reduction index_reduce lacks is rejected with eager's words."""
    import fx2xla

    x, src = make((3, 2)), make((2, 2), seed=1)
    f = torch.compile(lambda x, i, s: x.index_reduce(0, i, s, "amax"), backend="fx2xla")
    for bad in (ind(0, 3), ind(0, -1)):
        with pytest.raises(IndexError):
            x.index_reduce(0, bad, src, "amax")
        with pytest.raises(fx2xla.IndexOutOfRangeError, match="index_reduce"):
            f(x, bad, src)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="Expected reduce to be one of prod, mean, amax or amin"):
        torch.compile(lambda x, i, s: x.index_reduce(0, i, s, "sum"), backend="fx2xla",
                      options={"fallback": "error"})(x, ind(0, 1), src)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.complex64])
def test_put(check, dtype):
    """Tensor.put: x read as 1-d, written at distinct indices (negative ones from the end), or
    added at repeated ones with accumulate; an empty index leaves x as it is. Exact."""
    x, src = make((3, 4), dtype, 1), make((2, 3), dtype, 2)

    def fn(x, src, idx, rep):
        return (x.put(idx, src), x.put(rep, src[0], accumulate=True), x.put(idx[:0], src[:0]),
                x.t().put(idx, src))

    check(fn, x, src, ind([0, -1, 5], [7, 2, -12]), ind(1, 1, -11))


def test_put_index_out_of_range():
    import fx2xla

    f = torch.compile(lambda x, i, s: x.put(i, s), backend="fx2xla")
    with pytest.raises(IndexError, match="out of range"):
        make((3, 3)).put(ind(9), make((1,)))
    with pytest.raises(fx2xla.IndexOutOfRangeError, match="put"):
        f(make((3, 3)), ind(9), make((1,)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_nonzero_static(check, dtype):
    """torch.nonzero_static: the first `size` nonzero coordinates in row-major order, the rest
    filled with fill_value; sizes below and above the count, 0-d, 1-d and 3-d inputs, a NaN
    (nonzero), an all-zero input, an empty one. Exact, int64."""
    x = make((3, 4, 2), dtype, 1)
    if dtype == torch.float32:
        x[x.abs() < 0.8] = 0
        x[1, 2, 0] = float("nan")
    elif dtype == torch.int64:
        x[x.abs() < 5] = 0

    def fn(x, z):
        return (torch.nonzero_static(x, size=30), torch.nonzero_static(x, size=3),
                torch.nonzero_static(x.reshape(-1), size=5, fill_value=-7), torch.nonzero_static(x[0, 0, 0], size=2),
                torch.nonzero_static(z, size=4, fill_value=0), torch.nonzero_static(x, size=0),
                torch.nonzero_static(x[:, :0], size=2))

    check(fn, x, torch.zeros((2, 3), dtype=dtype))
