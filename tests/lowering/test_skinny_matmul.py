"""Skinny bfloat16 matmuls on the CPU (fx2xla/torch_kernels.py, `fx2xla_skinny_matmul`).

A bf16 mm/addmm of one row runs the library's streaming kernel instead of XLA's dot: nn.Linear's
weight ([N, K], handed over as stored) and a plain `x @ W` ([K, N]) alike, K and N with and
without remainders of the kernel's 4-row and 16-column blocks, weights large enough to be cut
across XLA's threads, a non-contiguous x and W, with a bias and alpha/beta. Every result is
within one bf16 rounding of eager's (both accumulate in float32 and round once; only the order
of the sums differs): rtol 8e-3 (2^-7), atol 1e-3. Two rows, float32 and an empty contraction
keep XLA's dot. Where the kernel may not run (options={"torch_kernels": "convolution"},
FX2XLA_TORCH_KERNELS=0, a program over a mesh), one row becomes XLA's dot of two (a zero row
added), also within one bf16 rounding of eager; ["skinny_matmul"] keeps the kernel alone; an
unknown kind is an error that names it. Four
threads calling one compiled module get eager's results on every call. A transformers LLaMA in
bf16, one decode token, gives eager's logits within bf16's tolerance of tests/conftest.py, with
the kernel. Called directly, the handler computes several rows (one after another) within
float32 rounding of a float64 reference, and refuses float32 operands with a message that says
what it takes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import fx2xla
from fx2xla import torch_kernels
from fx2xla.metrics import live_graphs

from tests.conftest import calls_in_threads, llama_decode_step, tolerance

TARGET = "fx2xla_skinny_matmul"
BF16 = dict(rtol=8e-3, atol=1e-3)  # one bf16 rounding apart
needs_kernels = pytest.mark.skipif(not torch_kernels.available("skinny_matmul"), reason=torch_kernels.status())
pytestmark = needs_kernels


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn, *args, **options):
    """fn compiled with fx2xla (and `options`) and called on args: (result, StableHLO of each new
    graph, handler calls it made)."""
    before = {id(g) for g in live_graphs}
    calls = torch_kernels.skinny_calls()
    with torch.no_grad():
        out = torch.compile(fn, backend="fx2xla", fullgraph=True, options=options or None)(*args)
    texts = [g.static.lowered.module_text for g in live_graphs if id(g) not in before]
    return out, texts, torch_kernels.skinny_calls() - calls


def bf16(*shape):
    return torch.randn(*shape).bfloat16()


# rows, K, N: weights with every remainder of the kernel's blocks, and large enough (512 KiB and
# more) to be cut across XLA's threads.
SHAPES = [(1, 37, 50), (1, 256, 688), (1, 64, 16), (1, 1000, 1001), (1, 1024, 4096)]


@pytest.mark.parametrize("rows,k,n", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_matches_eager(rows, k, n, bias):
    """nn.Linear (addmm or mm of a transposed weight): the kernel, within one bf16 rounding."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=bias).bfloat16()
    x = bf16(rows, k)
    out, texts, calls = compiled(lin, x)
    assert calls == 1 and TARGET in texts[0]
    with torch.no_grad():
        torch.testing.assert_close(out, lin(x), **BF16)


@pytest.mark.parametrize("rows,k,n", SHAPES, ids=lambda v: str(v))
def test_plain_matmul_matches_eager(rows, k, n):
    """x @ W with W stored [K, N] (mm of a row-major weight)."""
    torch.manual_seed(0)
    x, w = bf16(rows, k), bf16(k, n)
    out, texts, calls = compiled(lambda x, w: x @ w, x, w)
    assert calls == 1 and TARGET in texts[0]
    torch.testing.assert_close(out, x @ w, **BF16)


def test_addmm_scalars_and_strided_operands():
    """addmm's alpha and beta, on x and W passed in as strided views."""
    torch.manual_seed(0)
    bias, x, w = bf16(300), bf16(1, 1024)[:, ::2], bf16(512, 600)[:, ::2]
    assert not x.is_contiguous() and not w.is_contiguous()

    def fn(bias, x, w):
        return torch.addmm(bias, x, w, beta=0.5, alpha=2.0)

    out, texts, calls = compiled(fn, bias, x, w)
    assert calls == 1
    torch.testing.assert_close(out, fn(bias, x, w), **BF16)


@pytest.mark.parametrize("case", ["two_rows", "float32", "empty_k"])
def test_left_to_xla(case):
    """What the kernel is not for keeps XLA's dot, and matches eager."""
    torch.manual_seed(0)
    x, w = {"two_rows": (bf16(2, 1024), bf16(1024, 1024)),
            "float32": (torch.randn(1, 256), torch.randn(256, 512)),
            "empty_k": (bf16(1, 0), bf16(0, 64))}[case]
    out, texts, calls = compiled(lambda x, w: x @ w, x, w)
    assert calls == 0 and TARGET not in texts[0]
    torch.testing.assert_close(out, x @ w, **(BF16 if x.dtype == torch.bfloat16 else tolerance(torch.float32)))


def test_env_off_gives_two_rows(monkeypatch):
    """FX2XLA_TORCH_KERNELS=0: nn.Linear of one row is XLA's dot of two rows, as eager within one
    bf16 rounding."""
    monkeypatch.setenv("FX2XLA_TORCH_KERNELS", "0")
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(256, 512).bfloat16(), bf16(1, 256)
    out, texts, calls = compiled(lin, x)
    assert calls == 0 and TARGET not in texts[0] and "tensor<2x512xf32>" in texts[0]
    with torch.no_grad():
        torch.testing.assert_close(out, lin(x), **BF16)


def test_not_in_programs_over_a_mesh():
    """A matmul sharded over a mesh is XLA's (its partitioner cannot split a custom call), of two
    rows."""
    mesh = fx2xla.Mesh((4,), ("tp",))
    torch.manual_seed(0)
    x, w = bf16(1, 256), bf16(256, 512)

    def fn(x, w):
        return x @ fx2xla.mark_sharding(w, mesh, (None, "tp"))

    out, texts, calls = compiled(fn, x, w)
    assert calls == 0 and TARGET not in texts[0] and "tensor<2x512xf32>" in texts[0]
    torch.testing.assert_close(out, fn(x, w), **BF16)


def test_option_selects_kinds():
    """torch_kernels="convolution" keeps XLA's dot; ["skinny_matmul"] keeps the kernel and drops
    torch's convolution; an unknown kind is refused by name."""
    torch.manual_seed(0)
    x, w = bf16(1, 256), bf16(256, 512)
    out, texts, calls = compiled(lambda x, w: x @ w, x, w, torch_kernels="convolution")
    assert calls == 0 and TARGET not in texts[0] and "tensor<2x512xf32>" in texts[0]
    torch.testing.assert_close(out, x @ w, **BF16)
    torch._dynamo.reset()
    conv, img = torch.nn.Conv2d(3, 4, 3).bfloat16(), bf16(1, 3, 8, 8)

    def fn(img, x, w):
        return conv(img).sum() + (x @ w).sum()

    out, texts, calls = compiled(fn, img, x, w, torch_kernels=["skinny_matmul"])
    assert calls == 1 and "fx2xla_torch_convolution" not in texts[0]
    with torch.no_grad():
        torch.testing.assert_close(out, fn(img, x, w), **tolerance(torch.bfloat16))
    with pytest.raises(Exception, match="unknown kind.*'gemm'"):  # Dynamo wraps the ValueError
        torch.compile(lambda x: x + 1, backend="fx2xla", options={"torch_kernels": ["gemm"]})(x)


def test_many_threads():
    """Four threads calling one compiled Linear whose weight is cut across XLA's threads each get
    eager's result, on every call."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 1024).bfloat16()
    fn = torch.compile(lin, backend="fx2xla")
    inputs = [bf16(1, 1024) for _ in range(4)]
    with torch.no_grad():
        refs = [lin(x) for x in inputs]
        fn(inputs[0])
    calls = torch_kernels.skinny_calls()
    results = calls_in_threads(fn, inputs, 20)
    assert torch_kernels.skinny_calls() - calls == 80
    for i in range(4):
        for out in results[i]:
            torch.testing.assert_close(out, refs[i], **BF16)


def test_llama_decode_token():
    """A transformers LLaMA in bf16, one token after a cached prompt: the kernel runs its linear
    layers, and the logits match eager's within bf16's tolerance."""
    from fx2xla.testing import llama

    torch.manual_seed(0)
    model = llama(layers=2).eval().bfloat16()
    step, token, mask, expected = llama_decode_step(model, 1)
    out, texts, calls = compiled(step, token, mask)
    assert calls >= 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))


@pytest.mark.parametrize("w_nk", [1, 0], ids=["nk", "kn"])
def test_handler_rows(w_nk):
    """Three rows, one after another, against W either way round: float32 rounding of a float64
    reference (rtol 1e-5, atol 1e-5: K = 300 products of bf16 values, summed in float32)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 300)).astype(jnp.bfloat16)
    w = rng.standard_normal((700, 300) if w_nk else (300, 700)).astype(jnp.bfloat16)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((3, 700), jnp.float32))
    out = np.asarray(jax.jit(lambda x, w: call(x, w, w_nk=np.int64(w_nk)))(x, w))
    ref = x.astype(np.float64) @ (w.astype(np.float64).T if w_nk else w.astype(np.float64))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_handler_refuses_float32():
    """The handler takes bf16 x and W and returns float32; anything else is a clear error."""
    x, w = jnp.ones((1, 8), jnp.float32), jnp.ones((8, 4), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((1, 4), jnp.float32))
    with pytest.raises(Exception, match="x and W must be bfloat16, y float32"):
        jax.block_until_ready(jax.jit(lambda x, w: call(x, w, w_nk=np.int64(0)))(x, w))
