"""mm / addmm / bmm lowerings (fx2xla/lowering/linalg.py) against eager PyTorch."""
from __future__ import annotations

import glob
import os
import re

import pytest
import torch
import torch.nn.functional as F

from fx2xla import torch_kernels

from tests.conftest import tolerance

FLOATS = [torch.float32, torch.bfloat16, torch.float64]


def _rand(*shape, dtype=torch.float32):
    if dtype.is_floating_point:
        return torch.randn(*shape, dtype=dtype)
    return torch.randint(-4, 5, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64, torch.int32])
def test_mm_addmm_bmm(check, dtype):
    torch.manual_seed(0)
    a, b = _rand(5, 7, dtype=dtype), _rand(7, 3, dtype=dtype)
    bias, bias_row = _rand(3, dtype=dtype), _rand(5, 3, dtype=dtype)
    x, y = _rand(2, 4, 6, dtype=dtype), _rand(2, 6, 3, dtype=dtype)
    beta, alpha = (2, 3) if not dtype.is_floating_point else (0.5, -1.5)

    def fn(a, b, bias, bias_row, x, y):
        return (
            torch.mm(a, b),
            torch.addmm(bias, a, b),
            torch.addmm(bias_row, a, b, beta=beta, alpha=alpha),
            torch.bmm(x, y),
            torch.mm(b.t(), a.t()),  # both operands transposed views: contracted through
            torch.addmm(bias, b.t(), a.t()[:, :3]),
            torch.bmm(y.transpose(1, 2), x.transpose(1, 2)),
        )

    check(fn, a, b, bias, bias_row, x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(check, dtype):
    # nn.Linear arrives as addmm(bias, x, permute(W)) or, for 3-d inputs, view + mm/addmm.
    torch.manual_seed(0)
    x, x3 = _rand(4, 16, dtype=dtype), _rand(2, 3, 16, dtype=dtype)
    w, b = _rand(8, 16, dtype=dtype), _rand(8, dtype=dtype)
    check(lambda x, x3, w, b: (F.linear(x, w, b), F.linear(x, w), F.linear(x3, w, b)), x, x3, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_grads(dtype):
    # The backward graph is mm's of permuted saved tensors (weight and input gradients).
    torch.manual_seed(0)
    x, w, b = _rand(6, 16, dtype=dtype), _rand(8, 16, dtype=dtype), _rand(8, dtype=dtype)

    def grads(fn):
        ins = [t.clone().requires_grad_() for t in (x, w, b)]
        out = fn(*ins)
        (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return [out.detach()] + [t.grad for t in ins]

    fn = lambda x, w, b: F.linear(F.linear(x, w, b).relu(), w.t()[:8, :8])  # noqa: E731
    expected = grads(fn)
    actual = grads(torch.compile(fn, backend="fx2xla", fullgraph=True))
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, **tolerance(e.dtype))


def test_addmm_beta_zero_ignores_self(check):
    # torch does not read `self` when beta == 0, so its NaNs must not reach the result.
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    check(lambda s, a, b: torch.addmm(s, a, b, beta=0), torch.full((3, 2), float("nan")), a, b)


def test_bf16_accumulates_and_adds_bias_in_float32(check):
    # 1 + 256 * 2**-9 is 1.5 in a float32 accumulator (a bf16 one stays at 1.0), and
    # addmm rounds once: 1 + (2**-8 + 2**-16) -> 1.0078125, while rounding the product to
    # bf16 first gives exactly 1 + 2**-8, a tie that rounds to 1.0. Differences of one bf16
    # ulp pass the dtype tolerance, hence the exact asserts.
    a = torch.cat([torch.ones(1, 1), torch.full((1, 256), 2.0**-9)], dim=1).bfloat16()
    b = torch.ones(257, 2, dtype=torch.bfloat16)
    c = torch.tensor([[2.0**-8, 2.0**-16]], dtype=torch.bfloat16)
    one = torch.ones(1, dtype=torch.bfloat16)
    out = check(lambda a, b, c, one: (torch.mm(a, b), torch.bmm(a[None], b[None]), torch.addmm(one, c, b[:2])),
                a, b, c, one)
    assert out[0][0, 0].item() == 1.5 and out[1][0, 0, 0].item() == 1.5
    assert out[2][0, 0].item() == 1.0078125


def test_empty_and_noncontiguous(check):
    torch.manual_seed(0)
    check(
        lambda a, b, c, d, e, f: (torch.mm(a, b), torch.mm(c, d), torch.bmm(e, f)),
        torch.randn(3, 0), torch.randn(0, 4),  # empty contraction: zeros
        torch.randn(0, 3), torch.randn(3, 4),  # empty rows
        torch.randn(2, 6, 4).transpose(1, 2), torch.randn(2, 3, 6).transpose(1, 2),  # strided
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_weight_transpose_is_folded(check, tmp_path, monkeypatch, dtype):
    # nn.Linear's permute(W) must not be materialised: the optimized HLO of an inference MLP
    # transposes or copies no weight, and (bf16) converts none to float32. At 8 rows float32
    # weights reach it as torch holds them, and the kernel library's few-row matmul reads them
    # where it is built (tests/lowering/test_few_rows_matmul.py), else they are the dots' left
    # operands (option linear_weight_lhs: the products are [out, rows], and only those small
    # activations are transposed); bf16 ones as torch holds them too, read transposed by dots
    # of [rows, out], with no transpose or copy at all.
    monkeypatch.setenv("FX2XLA_DUMP_DIR", str(tmp_path))
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).to(dtype)
    with torch.no_grad():
        check(mlp, torch.randn(8, 64, dtype=dtype))
    (hlo_file,) = glob.glob(os.path.join(str(tmp_path), "*.hlo.txt"))
    hlo = open(hlo_file).read()
    ops = re.findall(r"= \w+\[([\d,]*)\]\S* (\w+)\(", hlo)  # `%name = f32[8,128]{1,0} op(`
    assert ("128,64", "parameter") in ops, hlo
    if dtype == torch.float32 and torch_kernels.available("few_rows_matmul"):
        assert hlo.count('custom_call_target="fx2xla_few_rows_matmul"') == 2, hlo
    else:
        assert ("128,8" if dtype == torch.float32 else "8,128", "dot") in ops, hlo
    weights = {"128,64", "64,128", "32,128", "128,32"}
    moved = [(s, op) for s, op in ops if op in ("transpose", "copy")]
    assert not [(s, op) for s, op in moved if s in weights or dtype != torch.float32], hlo
    assert not [(s, op) for s, op in ops if op == "convert" and s in weights], hlo
