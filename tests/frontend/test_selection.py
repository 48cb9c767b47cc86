"""Order statistics and binary search (fx2xla/lowering/selection.py) against eager.

Every comparison is exact (rtol=0, atol=0; NaN equal to NaN): values, indices, dtypes and
shapes. Each function is compiled with fallback="error", so an op without a rule fails.
"""
from __future__ import annotations

import math

import pytest
import torch

nan = math.nan
F32, F64, BF16, I64 = torch.float32, torch.float64, torch.bfloat16, torch.int64
FLOATS = [F32, F64, BF16]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    torch._dynamo.reset()


def compiled(fn):
    return torch.compile(fn, backend="fx2xla", options={"fallback": "error"})


def assert_exact(fn, *args):
    """fn compiled against fn eager: every output equal (NaN == NaN), same dtype and shape."""
    expected, actual = fn(*args), compiled(fn)(*args)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def ties(dtype, *shape, values=4):
    """Small integers in [0, values): many equal values per row."""
    return torch.randint(0, values, shape).to(dtype)


def with_nans(x, p=0.2):
    x = x.clone()
    x[torch.rand(x.shape) < p] = nan
    return x


@pytest.mark.parametrize("dtype", FLOATS + [I64])
def test_median_nanmedian_dims_and_ties(dtype):
    """median/nanmedian over all elements and along dims (negative, keepdim) of a tensor with
    many ties, even and odd lengths: values and indices exact (eager's index among ties is the
    stable-sort one)."""
    def fn(x):
        return (x.median(), x.nanmedian(), x.median(0), x.median(-1), x.nanmedian(1, keepdim=True),
                torch.median(x, -2, keepdim=True), x[:, :5].median(1), x[:, :5].nanmedian(-1))

    assert_exact(fn, ties(dtype, 6, 8))


@pytest.mark.parametrize("dtype", FLOATS)
def test_median_nan(dtype):
    """median: a row with a NaN gives NaN and its first NaN's index; nanmedian ignores NaNs (the
    lower median of the rest) and for an all-NaN row gives NaN with eager's index. Exact."""
    x = with_nans(ties(dtype, 7, 9))
    x[2] = nan  # all NaN
    x[3, 4:] = nan
    def fn(x):
        return x.median(1), x.nanmedian(1), x.median(0), x.nanmedian(0, keepdim=True), x.median(), x.nanmedian()

    assert_exact(fn, x)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13, 17, 40, 100])
def test_nanmedian_all_nan_index(n):
    """nanmedian of all-NaN rows of length n: NaN, and the index eager's nth_element leaves
    in front (a function of n). Exact."""
    assert_exact(lambda x: x.nanmedian(-1), torch.full((2, n), nan))


@pytest.mark.parametrize("dtype", FLOATS + [I64])
def test_median_zero_dim_and_empty(dtype):
    """0-d inputs (dim 0 and -1) and empty inputs: median/nanmedian of no elements (NaN for
    floats), and a reduction along a non-empty dim of a tensor empty along another. Exact."""
    z = torch.tensor(3, dtype=dtype)
    assert_exact(lambda z: (z.median(), z.nanmedian(), z.median(0), z.nanmedian(-1, keepdim=True),
                            z.kthvalue(1), z.mode(), z.mode(-1, keepdim=True)), z)
    torch._dynamo.reset()
    e = torch.zeros(0, 4, dtype=dtype)
    assert_exact(lambda e: (e.median(), e.nanmedian(), e.median(1), e.nanmedian(1, keepdim=True),
                            e.kthvalue(2, 1), e.mode(1)), e)


@pytest.mark.parametrize("dtype", FLOATS + [I64])
def test_non_contiguous(dtype):
    """Transposed and strided inputs: values and indices exact (indices of the rows as seen;
    kthvalue on distinct values, where its index is defined)."""
    x = ties(dtype, 6, 10).t()[::2]
    distinct = torch.randperm(60).reshape(6, 10).to(dtype).t()[::2]
    assert_exact(lambda x, d: (x.median(0), x.nanmedian(1), d.kthvalue(2, 0), d.kthvalue(3, 1), x.mode(1), x.mode(0)),
                 x, distinct)


@pytest.mark.parametrize("dtype", FLOATS + [I64])
def test_kthvalue(dtype):
    """kthvalue for every k along a dim of distinct values (so indices are defined), negative
    dims, keepdim: values and indices exact."""
    x = torch.randperm(60).reshape(3, 4, 5).to(dtype)  # distinct, exact in bf16 too
    def fn(x):
        return tuple(x.kthvalue(k, 1) for k in range(1, 5)) + (x.kthvalue(3), x.kthvalue(2, -3, keepdim=True),
                                                               torch.kthvalue(x, 5, -1, True))

    assert_exact(fn, x)


@pytest.mark.parametrize("dtype", FLOATS)
def test_kthvalue_nan_sorts_last(dtype):
    """kthvalue with NaNs (distinct other values): NaN counts as the largest, as in sort.
    Values exact; indices exact (each NaN row position here has a single NaN)."""
    x = torch.randperm(30).reshape(5, 6).to(dtype)
    x[1, 2] = nan
    x[3, 0] = nan
    assert_exact(lambda x: (x.kthvalue(6, 1), x.kthvalue(5, 1), x.kthvalue(1, 1), x.kthvalue(5, 0)), x)


@pytest.mark.parametrize("dtype", FLOATS + [I64])
def test_kthvalue_ties_values(dtype):
    """kthvalue with ties: values exact; the index (unspecified among equal values: eager's
    quickselect is not stable) points at an element equal to the value."""
    x = ties(dtype, 5, 9)
    values, indices = compiled(lambda x: x.kthvalue(4, 1))(x)
    expected = x.kthvalue(4, 1)
    torch.testing.assert_close(values, expected.values, rtol=0, atol=0)
    torch.testing.assert_close(x.gather(1, indices[:, None])[:, 0], expected.values, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", FLOATS + [I64, torch.bool])
def test_mode(dtype):
    """mode along dims of up to 16 elements with ties between values: the smallest most
    frequent value, and eager's index (last occurrence). Exact."""
    x = ties(dtype, 4, 7, 9, values=3) if dtype != torch.bool else torch.rand(4, 7, 9) > 0.5
    assert_exact(lambda x: (x.mode(), x.mode(0), x.mode(1, keepdim=True), x.mode(-3), torch.mode(x, -2)), x)


@pytest.mark.parametrize("dtype", FLOATS)
def test_mode_nan(dtype):
    """mode of short rows with NaNs: exact, as eager (a NaN equals nothing, and where eager's
    insertion sort leaves NaNs decides the runs)."""
    x = with_nans(ties(dtype, 300, 9, values=3), p=0.3)
    assert_exact(lambda x: x.mode(1), x)


def test_mode_long_rows():
    """mode of rows longer than 16 (eager's sort is not stable there): values exact, and the
    index points at an element equal to the value."""
    x = ties(F32, 6, 50)
    values, indices = compiled(lambda x: x.mode(1))(x)
    expected = x.mode(1)
    torch.testing.assert_close(values, expected.values, rtol=0, atol=0)
    torch.testing.assert_close(x.gather(1, indices[:, None])[:, 0], expected.values, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", FLOATS + [I64])
def test_searchsorted(dtype):
    """searchsorted with a 1-D and a batched sequence, duplicates in it, left/right/side,
    out_int32, sorter, Python scalar values and 0-d values: exact, int64 or int32."""
    seq = torch.sort(ties(dtype, 3, 10, values=6), dim=-1).values
    flat = seq[0]
    v = ties(dtype, 3, 5, values=7) - 1
    perm = torch.randperm(10)
    unsorted = flat[perm]
    sorter = torch.argsort(unsorted, stable=True)

    def fn(seq, flat, v, unsorted, sorter):
        return (torch.searchsorted(flat, v), torch.searchsorted(flat, v, right=True),
                torch.searchsorted(seq, v, side="right"), torch.searchsorted(seq, v, out_int32=True),
                torch.searchsorted(flat, 2), torch.searchsorted(flat, 2.5, right=True),
                torch.searchsorted(flat, v[0, 0]), torch.searchsorted(unsorted, v, sorter=sorter),
                torch.searchsorted(unsorted, v, sorter=sorter, side="right"))

    assert_exact(fn, seq, flat, v, unsorted, sorter)


@pytest.mark.parametrize("dtype", FLOATS + [I64])
def test_bucketize(dtype):
    """bucketize of tensors, 0-d tensors and Python scalars, left and right, out_int32: exact."""
    boundaries = torch.tensor([-1, 0, 0, 2, 3, 3, 3, 5], dtype=dtype)
    v = ties(dtype, 4, 6, values=8) - 2

    def fn(v, b):
        return (torch.bucketize(v, b), torch.bucketize(v, b, right=True), torch.bucketize(v, b, out_int32=True),
                torch.bucketize(v[0, 0], b), torch.bucketize(3, b), torch.bucketize(0.5, b, right=True),
                torch.bucketize(v.t(), b))

    assert_exact(fn, v, boundaries)


@pytest.mark.parametrize("dtype", FLOATS)
def test_search_nan(dtype):
    """NaN values land past the end; NaN (and unsorted) entries in the sequence give eager's
    binary-search answer (it depends on the positions probed). Exact."""
    seq = torch.tensor([1., 2., nan, 3., 4., 4., nan], dtype=dtype)
    v = torch.tensor([0., 1.5, 3.5, 5., nan, 2., 4.], dtype=dtype)
    assert_exact(lambda s, v: (torch.searchsorted(s, v), torch.searchsorted(s, v, right=True),
                               torch.bucketize(v, s), torch.bucketize(v, s, right=True),
                               torch.searchsorted(s[:4], v), torch.searchsorted(s.flip(0), v)), seq, v)


def test_search_mixed_dtypes_and_empty():
    """Sequence and values of different dtypes compare in their promoted dtype; an empty
    sequence gives zeros and empty values an empty result. Exact."""
    ints = torch.tensor([1, 2, 3, 5])
    floats = torch.tensor([0.5, 2.0, 2.5, 7.0])
    empty = torch.zeros(0)
    assert_exact(lambda i, f, e: (torch.searchsorted(i, f), torch.searchsorted(f, i, right=True),
                                  torch.bucketize(f, i), torch.searchsorted(i, 2.5), torch.searchsorted(e, f),
                                  torch.searchsorted(f, e), torch.bucketize(e, i)), ints, floats, empty)


def test_searchsorted_sorter_out_of_range_raises():
    """An out-of-range sorter index is rejected (eager raises RuntimeError; fx2xla its
    run-time index check)."""
    seq, sorter = torch.tensor([1., 2., 3.]), torch.tensor([0, 1, 5])
    with pytest.raises(RuntimeError, match="sorter index out of range"):
        torch.searchsorted(seq, seq, sorter=sorter)
    with pytest.raises(Exception, match="sorter index out of range"):
        compiled(lambda s, v, o: torch.searchsorted(s, v, sorter=o))(seq, seq, sorter)
