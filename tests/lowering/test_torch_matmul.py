"""torch's matmul in CPU training graphs (fx2xla/torch_kernels.py, `fx2xla_torch_matmul`;
lowering/linalg.py: TORCH_MATMUL_MACS, _torch_matmul).

Float32 and float64 matmuls of at least TORCH_MATMUL_MACS multiply-adds in CPU training graphs
(forward and backward) run torch's gemm inside the executable, their output's columns cut across
XLA's threads. What these tests hold it to:
- called directly, the handler computes op(a) . op(b) for the four transpose combinations, in
  float32 (rtol/atol 1e-5 against numpy's float64 product, relative to the largest entry) and
  float64 (1e-12), at sizes cut into slices with a remainder column group and at sizes one thread
  computes whole; an empty M or N gives an empty result and K = 0 gives zeros;
- it refuses bf16 operands, operands of two dtypes, and shapes that do not chain, with messages
  that say so;
- a product that large is cut into slices (where two cores are usable), and four threads calling
  it at once get, on every call, the bits one call gives;
- an MLP training step (forward, loss, backward) compiled with fx2xla (option linear_weight_lhs
  off: at 32 rows its forward's matmuls would be XLA's with the weight on the left) calls it for
  every large matmul (the forward's 2, the backward's 3: no input gradient for the first layer), and its loss
  and every gradient match eager's within conftest's float32 tolerance; small matmuls and the
  inference graph of the same model (and a package's, which lowers with the same kinds) keep XLA's
  dots; the option torch_kernels without "matmul"
  keeps XLA's dots with the same results within that tolerance."""
from __future__ import annotations

import copy
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fx2xla import torch_kernels
from fx2xla.lowering.linalg import TORCH_MATMUL_MACS
from fx2xla.metrics import live_graphs

from tests.conftest import assert_loss_and_grads_close, calls_in_threads, tolerance

TARGET = "@fx2xla_torch_matmul("
WITHOUT = [k for k in torch_kernels.KINDS if k != "matmul"]
pytestmark = pytest.mark.skipif(not torch_kernels.available("matmul"), reason=torch_kernels.status())


def kernel(a, b, ta: bool, tb: bool):
    m = a.shape[1] if ta else a.shape[0]
    n = b.shape[0] if tb else b.shape[1]
    return jax.ffi.ffi_call("fx2xla_torch_matmul", jax.ShapeDtypeStruct((m, n), a.dtype), vmap_method="sequential")(
        a, b, transpose_a=np.int64(ta), transpose_b=np.int64(tb))


def operands(m, k, n, ta, tb, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
    return a, b


def expected(a, b, ta, tb):
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64.T if ta else a64) @ (b64.T if tb else b64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("m,k,n", [(33, 70, 130), (32, 1024, 1000), (3, 5, 7)], ids=["odd", "sliced", "small"])
def test_handler_matches_numpy(m, k, n, ta, tb, dtype):
    """op(a) . op(b) within 1e-5 (float32) / 1e-12 (float64) of the largest entry of numpy's
    float64 product."""
    a, b = operands(m, k, n, ta, tb, dtype)
    with jax.enable_x64(True):  # float64 arrays stay float64 (fx2xla lowers under it too)
        out = np.asarray(jax.jit(kernel, static_argnums=(2, 3))(a, b, ta, tb))
    ref = expected(a, b, ta, tb)
    assert out.shape == (m, n) and out.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    scale = np.abs(ref).max()
    np.testing.assert_allclose(out / scale, ref / scale, rtol=tol, atol=tol)


def test_empty_and_k_zero():
    """An empty M or N gives an empty result; K = 0 gives zeros."""
    f = jax.jit(kernel, static_argnums=(2, 3))
    assert np.asarray(f(np.zeros((0, 8), np.float32), np.ones((8, 5), np.float32), False, False)).shape == (0, 5)
    assert np.asarray(f(np.ones((4, 8), np.float32), np.ones((8, 0), np.float32), False, False)).shape == (4, 0)
    z = np.asarray(f(np.ones((4, 0), np.float32), np.ones((0, 5), np.float32), False, False))
    assert z.shape == (4, 5) and not z.any()


@pytest.mark.parametrize("case", ["bf16", "mixed", "chain"])
def test_handler_refuses(case):
    """bf16 operands, two dtypes, or shapes that do not chain: an error naming the kernel and
    the reason."""
    a, b = np.ones((4, 8), np.float32), np.ones((8, 5), np.float32)
    if case == "bf16":
        a, b, why = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), "float32 or float64"
    elif case == "mixed":
        a, why = a.astype(jnp.float16), "float32 or float64, all one"
    else:
        b, why = np.ones((7, 5), np.float32), "shapes do not chain"
    with pytest.raises(Exception, match=rf"fx2xla_torch_matmul: .*{why}"):
        out = jax.jit(lambda a, b: jax.ffi.ffi_call(
            "fx2xla_torch_matmul", jax.ShapeDtypeStruct((4, 5), jnp.float32), vmap_method="sequential")(
            a, b, transpose_a=np.int64(0), transpose_b=np.int64(0)))(a, b)
        np.asarray(out)


def test_threads_get_one_calls_bits():
    """Four threads, 10 calls each, of a product cut into slices: every result equals, bit for
    bit, the one a single call gives."""
    f = jax.jit(lambda a, b: kernel(a, b, False, True))
    inputs = [operands(32, 512, 1024, False, True, np.float32, seed=i) for i in range(4)]
    sliced = torch_kernels.sliced_calls()
    alone = [np.asarray(f(a, b)) for a, b in inputs]
    assert torch_kernels.sliced_calls() - sliced == (4 if len(os.sched_getaffinity(0)) > 1 else 0)
    results = calls_in_threads(lambda ab: np.asarray(f(*ab)), inputs, calls=10)
    for i, outs in results.items():
        for out in outs:
            np.testing.assert_array_equal(out, alone[i])


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 1024)
        self.down = torch.nn.Linear(1024, 256)
        self.small = torch.nn.Linear(256, 8)  # 32 x 256 x 8 multiply-adds: XLA's dot

    def forward(self, x):
        return self.small(self.down(torch.relu(self.up(x))))


def _texts(before) -> list[str]:
    return [g.static.lowered.module_text for g in live_graphs if id(g) not in before and g.static is not None]


def _step(options):
    """One compiled training step (forward, loss, backward) of MLP against eager's: (the new
    graphs' StableHLO, handler calls it made)."""
    torch.manual_seed(0)
    model = MLP()
    twin = copy.deepcopy(model)
    x = torch.randn(32, 256)
    before = {id(g) for g in live_graphs}
    calls = torch_kernels.matmul_calls()
    loss = torch.compile(model, backend="fx2xla", options=options)(x).square().mean()
    loss.backward()
    made = torch_kernels.matmul_calls() - calls
    ref = twin(x).square().mean()
    ref.backward()
    assert_loss_and_grads_close(loss, ref, model, twin)
    return _texts(before), made


def test_training_step_calls_torchs_matmul():
    """With the option linear_weight_lhs off, the forward's two large matmuls and the backward's
    three run in the handler, with eager's loss and gradients; the small one stays XLA's. With
    the option on (the default), the forward's two, of 32 rows against nn.Linear's weight, are
    XLA's dots with the weight on the left (tests/lowering/test_weight_lhs.py) and the
    backward's three the handler's, with eager's loss and gradients too."""
    assert 32 * 256 * 1024 >= TORCH_MATMUL_MACS > 32 * 256 * 8
    texts, made = _step({"linear_weight_lhs": False})
    assert sum(t.count(TARGET) for t in texts) == 5, texts
    assert made == 5
    torch._dynamo.reset()
    texts, made = _step(None)
    assert sum(t.count(TARGET) for t in texts) == 3, texts
    assert made == 3


def test_option_without_matmul_keeps_xlas_dots():
    """torch_kernels without "matmul": no handler calls, eager's results all the same."""
    texts, made = _step({"torch_kernels": WITHOUT, "linear_weight_lhs": False})
    assert not any(TARGET in t for t in texts) and made == 0


def test_inference_keeps_xlas_dots():
    """The same model's inference graph multiplies in XLA's dots, within float32 tolerance of
    eager."""
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(32, 256)
    before = {id(g) for g in live_graphs}
    with torch.no_grad():
        out = torch.compile(model, backend="fx2xla")(x)
        torch.testing.assert_close(out, model(x), **tolerance(torch.float32))
    texts = _texts(before)
    assert texts and not any(re.search(r"fx2xla_torch_matmul", t) for t in texts)
    assert "matmul" not in torch_kernels.for_graph(True, training=False)  # packages lower with this too
    assert "matmul" in torch_kernels.for_graph(True, training=True)
