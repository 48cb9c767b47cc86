"""Grouped matmuls, a mixture-of-experts layer's products (lowering/grouped.py): transformers'
`grouped_mm_fallback` and its backward, and torch's `_grouped_mm`, against eager on the same
inputs, with the kernel library's handler (`fx2xla_grouped_matmul`, counted) and without it
(option torch_kernels=False: XLA's masked dense forms), compiled with fallback="error" so that
no op runs eagerly. Tolerances: float32 rtol 1e-5 / atol 1e-5, float64 1e-12 / 1e-12, bf16
rtol 1.6e-2 / atol 1e-2 (the handler runs eager's own bf16 gemm; the masked forms round once
from float32). Rows past offs[-1] are zero for transformers' op (as eager) and not compared for
torch's, whose eager CPU kernel leaves them unwritten."""
from __future__ import annotations

import pytest
import torch

from fx2xla.torch_kernels import available, grouped_matmul_calls

transformers_moe = pytest.importorskip("transformers.integrations.moe")  # registers transformers' ops
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
PATHS = [pytest.param(True, id="handler"), pytest.param(False, id="xla")]


def compiled(fn, handler: bool):
    torch._dynamo.reset()
    options = {"fallback": "error"} if handler else {"fallback": "error", "torch_kernels": False}
    return torch.compile(fn, backend="fx2xla", options=options)


def expect_calls(handler: bool, before: int) -> None:
    if handler and available("grouped_matmul"):
        assert grouped_matmul_calls() > before
    elif not handler:
        assert grouped_matmul_calls() == before


def operands(dtype, offs_dtype=torch.int32, transposed=False, seed=0):
    """x [24, 16], w [4, 16, 8] (or a [4, 8, 16] buffer's transpose), offs with an empty expert
    and 4 rows past the last end."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 16, generator=g, dtype=dtype)
    w = torch.randn(4, 8, 16, generator=g, dtype=dtype).transpose(1, 2) if transposed else \
        torch.randn(4, 16, 8, generator=g, dtype=dtype)
    offs = torch.tensor([5, 5, 13, 20], dtype=offs_dtype)
    return x, w, offs


@pytest.mark.parametrize("handler", PATHS)
@pytest.mark.parametrize("dtype,offs_dtype,transposed", [(torch.float32, torch.int32, False),
                                                         (torch.float64, torch.int64, True),
                                                         (torch.float32, torch.int64, True)],
                         ids=["f32-i32", "f64-i64-wT", "f32-i64-wT"])
def test_transformers_grouped_mm_fallback_and_backward(handler, dtype, offs_dtype, transposed):
    """transformers' op: the output (zero rows past offs[-1] included) and the gradients of x and
    w (the backward op, zero for the empty expert) equal eager's within TOL; the handler ran where
    asked and the library is built, and never with torch_kernels off."""
    op = torch.ops.transformers.grouped_mm_fallback
    x, w, offs = operands(dtype, offs_dtype, transposed)

    def step(x, w, offs):
        out = op(x, w, offs)
        gx, gw = torch.autograd.grad((out * out).sum(), (x, w))
        return out, gx, gw

    xe, we = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    expected = step(xe, we, offs)
    before = grouped_matmul_calls()
    xc, wc = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = compiled(lambda x, w, offs: op(x, w, offs), handler)(xc, wc, offs)
    gx, gw = torch.autograd.grad((out * out).sum(), (xc, wc))
    for a, e in zip((out, gx, gw), expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, **TOL[dtype])
    assert out[20:].abs().max() == 0 and gw[1].abs().max() == 0
    expect_calls(handler, before)


@pytest.mark.parametrize("handler", PATHS)
def test_aten_grouped_mm_every_layout(handler):
    """torch._grouped_mm in bf16 (the dtype torch's meta function takes under torch.compile), 2-D x 3-D (a weight given as a [E, N, K] buffer's transpose too), 2-D x
    2-D, 3-D x 2-D and 3-D x 3-D: eager's values within TOL (2-D x 3-D: rows up to offs[-1]),
    eager's shapes and dtypes (rows, or columns, past offs[-1] are not compared: eager leaves them
    unwritten); the handler ran where asked and built."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    offs = torch.tensor([8, 8, 24, 40], dtype=torch.int32)
    cases = [(r(48, 16), r(4, 16, 32)), (r(48, 16), r(4, 32, 16).transpose(1, 2)),
             (r(16, 48), r(48, 32)), (r(4, 16, 32), r(32, 48))]
    before = grouped_matmul_calls()
    for a, b in cases:
        f = compiled(lambda a, b, offs: torch._grouped_mm(a, b, offs=offs), handler)
        out, expected = f(a, b, offs), torch._grouped_mm(a, b, offs=offs)
        assert out.dtype == expected.dtype and out.shape == expected.shape
        if (a.dim(), b.dim()) == (2, 3):  # rows past offs[-1]: unwritten by eager
            out, expected = out[:40], expected[:40]
        elif (a.dim(), b.dim()) == (3, 2):  # columns past offs[-1]: the same
            out, expected = out[:, :40], expected[:, :40]
        torch.testing.assert_close(out, expected, **TOL[dtype])
    a, b = r(4, 16, 32), r(4, 32, 16)
    out = compiled(lambda a, b: torch._grouped_mm(a, b), handler)(a, b)
    torch.testing.assert_close(out, torch._grouped_mm(a, b), **TOL[dtype])
    expect_calls(handler, before)


def test_aten_grouped_mm_training_step():
    """Gradients through torch._grouped_mm in bf16 (2-D x 3-D; its backward a 2-D x 3-D and a
    2-D x 2-D grouped product) equal eager's within bf16's TOL, the weight given transposed as
    transformers' bf16 path does."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(48, 16, generator=g).bfloat16()
    w = torch.randn(4, 32, 16, generator=g).bfloat16()
    offs = torch.tensor([8, 8, 24, 48], dtype=torch.int32)

    def loss(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs).pow(2).sum()

    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected = torch.autograd.grad(loss(xe, we), (xe, we))
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    got = torch.autograd.grad(compiled(loss, True)(xc, wc), (xc, wc))
    for a, e in zip(got, expected):
        assert a.dtype == e.dtype and a.shape == e.shape
        torch.testing.assert_close(a, e, **TOL[torch.bfloat16])


def test_grouped_mm_from_threads():
    """Four threads calling one compiled grouped product (the handler where built) at once, each
    with its own operands and offs, 5 calls each: every result equals eager's within float32's
    TOL, rows past offs[-1] zero."""
    from tests.conftest import calls_in_threads

    op = torch.ops.transformers.grouped_mm_fallback
    f = compiled(lambda xw: op(*xw), True)
    inputs = []
    for i in range(4):
        x, w, _ = operands(torch.float32, seed=i)
        inputs.append((x, w, torch.tensor([3 + i, 9, 9 + i, 18 + i], dtype=torch.int32)))
    f(inputs[0])  # compiled before the threads start
    results = calls_in_threads(f, inputs, calls=5)
    for i, outs in results.items():
        expected = op(*inputs[i])
        for out in outs:
            torch.testing.assert_close(out, expected, **TOL[torch.float32])
            assert out[18 + i:].abs().max() == 0
