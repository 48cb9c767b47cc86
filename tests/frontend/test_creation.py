"""Creation ops (full, full_like, empty*, scalar_tensor, arange) against eager PyTorch."""
from __future__ import annotations

import pytest
import torch

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES)
def test_full_and_full_like(check, dtype):
    x = torch.randn(2, 3)

    def fn(x):
        return (
            torch.full((2, 3), 7, dtype=dtype), torch.full((0, 2), 1.5, dtype=dtype), torch.full((), -2, dtype=dtype),
            torch.full_like(x, 3, dtype=dtype), torch.zeros_like(x, dtype=dtype), torch.ones(4, dtype=dtype),
            x.new_full((3,), -1.25, dtype=dtype), x.new_zeros(2, 2, dtype=dtype),
        )

    check(fn, x)


def test_full_default_dtypes_and_special_values(check):
    def fn(x):
        return (
            torch.full((2,), 1), torch.full((2,), 2.5), torch.full((2,), True), torch.full_like(x, 7),
            torch.full((3,), float("inf")), torch.full((1,), float("nan")), torch.full((2,), -1, dtype=torch.uint8),
            torch.full((2,), 2**40), torch.ones_like(x.t()),
        )

    check(fn, torch.randn(2, 3))


def test_full_like_keeps_input_layout(check):
    out = check(lambda x: torch.full_like(x, 2.0), torch.randn(3, 4).t())
    assert out.stride() == (1, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_empty_has_shape_dtype_and_layout(dtype):
    def fn(x):
        return (
            torch.empty(2, 3, dtype=dtype), torch.empty_like(x, dtype=dtype), torch.empty_like(x.t(), dtype=dtype),
            torch.empty_strided((2, 3), (1, 2), dtype=dtype), x.new_empty((0, 4), dtype=dtype),
        )

    x = torch.randn(3, 4)
    expected = fn(x)
    actual = torch.compile(fn, backend="fx2xla", fullgraph=True)(x)
    for a, e in zip(actual, expected, strict=True):
        assert (a.shape, a.dtype, a.stride()) == (e.shape, e.dtype, e.stride())


@pytest.mark.parametrize("dtype", DTYPES)
def test_scalar_tensor(check, dtype):
    # where(mask, x, scalar) brings scalar_tensor in with the output's dtype.
    x = torch.randn(5)
    check(lambda x: (torch.where(x > 0, x, 0.0), torch.scalar_tensor(3, dtype=dtype), aten.scalar_tensor(-1.5, dtype=dtype)), x)


def test_arange(check):
    def fn(x):
        return (
            torch.arange(5), torch.arange(2, 11, 3), torch.arange(10, -3, -4), torch.arange(0, 1, 0.1),
            torch.arange(-1.5, 2, 0.25, dtype=torch.float64), torch.arange(0, 100, 0.37),
            torch.arange(6, dtype=torch.bfloat16), torch.arange(0.5, 5.2, dtype=torch.int64),
            torch.arange(3, 3), torch.arange(0, 10, 3, dtype=torch.int32), torch.arange(x.shape[0]) + x,
        )

    check(fn, torch.randn(4))


@pytest.mark.parametrize("row, col, offset", [(0, 0, 0), (3, 4, 1), (4, 3, -1), (5, 5, 0), (3, 3, 7), (3, 3, -9),
                                              (1, 6, 2)])
def test_tril_triu_indices(check, row, col, offset):
    """tril_indices / triu_indices for square, wide, tall and empty shapes and offsets beyond
    either corner, int64 and int32, exact (with an input, so the graph has one)."""
    check(lambda x: (torch.tril_indices(row, col, offset) + x, torch.triu_indices(row, col, offset) + x,
                     torch.tril_indices(row, col, offset, dtype=torch.int32) + x.int()), torch.tensor(1))
