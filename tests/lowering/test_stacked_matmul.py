"""Folded layers' weights read in place (kernel library `fx2xla_torch_matmul_indexed`;
lowering/linalg.py `_stacked_matmul`, lowering/control_flow.py `_scan`).

A folded loop's body reads each layer's weight as a slice of the stacked weights. Where a
stacked input is read only as matmuls' right operand (nn.Linear's transposed weight, or a weight
stored [in, out] as transformers' Conv1D holds it) and the product has STACKED_MATMUL_MACS
multiply-adds or more, torch's gemm reads the layer's weight where it lies in the stack instead
of XLA copying the slice out on every iteration. What these tests hold it to:
- inference of 8 folded layers (two such matmuls each, one of each weight layout) matches eager
  at conftest's float32 tolerance (rtol 1e-4, atol 1e-5), served or not; each call runs 16
  indexed products; the loop body holds exactly two indexed custom calls and no dot;
- a training step (forward and backward folded) gives eager's loss and gradients at that
  tolerance, with 5 products per layer read in place: the forward's two, the backward's two
  input gradients (one against the transposed copy of `w` the forward saves), and the Linear's
  weight gradient, whose right operand is the layer's saved input;
- float64 runs the same route, at float64's tolerance;
- with the option's kind "stacked_matmul" left out, small products, or bf16 weights, nothing is
  indexed and the results are eager's at their dtype's tolerance;
- four threads calling the folded model at once, ten times each, get exactly the results of
  their inputs' single-threaded calls;
- the handler itself clamps the layer index into [0, L), as XLA's dynamic slice does, and
  computes a . stack[i] (or a . stack[i]^T) exactly as numpy's float64 product within float32
  rounding."""
from __future__ import annotations

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fx2xla import torch_kernels
from fx2xla.lowering.linalg import STACKED_MATMUL_MACS
from fx2xla.metrics import live_graphs

from tests.conftest import assert_loss_and_grads_close, calls_in_threads, tolerance

pytestmark = pytest.mark.skipif(not torch_kernels.available("matmul"), reason=torch_kernels.status())

LAYERS, WIDTH, ROWS = 8, 512, 128


class Layer(torch.nn.Module):
    """nn.Linear (weight [out, in], read transposed), then a weight stored [in, out] (read as
    it is), each with a bias, a GELU between."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.w = torch.nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.b = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return x + torch.addmm(self.b, torch.nn.functional.gelu(self.fc(x)), self.w)


class Stack(torch.nn.Module):
    def __init__(self, layers: int = LAYERS, width: int = WIDTH):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _compile(model, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="fx2xla", fullgraph=True, options=options)


def _new_graphs(before: set) -> list:
    return [g for g in live_graphs if id(g) not in before and g.static is not None]


def _hlo(graph) -> str:
    return "\n".join(m.to_string() for m in graph.static.exe.hlo_modules())


def test_threshold_covers_the_test_products():
    assert ROWS * WIDTH * WIDTH >= STACKED_MATMUL_MACS


@pytest.mark.parametrize("served", [False, True])
def test_folded_inference_reads_weights_in_place(served):
    torch.manual_seed(0)
    model = Stack().eval()
    x = torch.randn(ROWS, WIDTH)
    compiled = _compile(model)
    before_graphs = set(map(id, live_graphs))
    with torch.no_grad(), torch_kernels.serving(served):
        compiled(x)
        (graph,) = _new_graphs(before_graphs)
        before = torch_kernels.indexed_matmul_calls()
        got = compiled(x)
        calls = torch_kernels.indexed_matmul_calls() - before
        want = model(x)
    torch.testing.assert_close(got, want, **tolerance(torch.float32))
    assert calls == 2 * LAYERS
    text = _hlo(graph)
    assert text.count(" while(") == 1
    assert len(re.findall(r'custom_call_target="fx2xla_torch_matmul_indexed"', text)) == 2
    assert " dot(" not in text


def test_folded_training_reads_weights_in_place_forward_and_backward():
    torch.manual_seed(0)
    model = Stack().train()
    twin = copy.deepcopy(model)
    compiled = _compile(model)
    x = torch.randn(ROWS, WIDTH)
    compiled(x).square().mean().backward()  # compiles forward and backward
    model.zero_grad(set_to_none=True)
    before = torch_kernels.indexed_matmul_calls()
    loss = compiled(x).square().mean()
    loss.backward()
    calls = torch_kernels.indexed_matmul_calls() - before
    ref = twin(x).square().mean()
    ref.backward()
    assert_loss_and_grads_close(loss, ref, model, twin)
    # forward: x . fc.weight^T and h . w; backward: g . (saved w^T), g' . fc.weight and
    # g'^T . (saved x), per layer
    assert calls == 5 * LAYERS


def test_many_threads_get_their_own_results():
    torch.manual_seed(0)
    model = Stack().eval()
    compiled = _compile(model)
    inputs = [torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad(), torch_kernels.serving(False):  # sliced, as in the other threads
        alone = [compiled(x) for x in inputs]
        torch.testing.assert_close(alone[0], model(inputs[0]), **tolerance(torch.float32))
    before = torch_kernels.indexed_matmul_calls()
    results = calls_in_threads(compiled, inputs, calls=10)
    assert torch_kernels.indexed_matmul_calls() - before == 4 * 10 * 2 * LAYERS
    for i, outs in results.items():
        for out in outs:
            assert torch.equal(out, alone[i])


def test_float64_takes_the_same_route():
    torch.manual_seed(0)
    model = Stack().double().eval()
    x = torch.randn(ROWS, WIDTH, dtype=torch.float64)
    compiled = _compile(model)
    with torch.no_grad():
        compiled(x)
        before = torch_kernels.indexed_matmul_calls()
        got = compiled(x)
        assert torch_kernels.indexed_matmul_calls() - before == 2 * LAYERS
        torch.testing.assert_close(got, model(x), **tolerance(torch.float64))


@pytest.mark.parametrize("case", ["kind_off", "small", "bf16"])
def test_nothing_indexed_where_the_route_does_not_apply(case):
    torch.manual_seed(0)
    width, rows, dtype, options = WIDTH, ROWS, torch.float32, {}
    if case == "kind_off":
        options = {"torch_kernels": [k for k in torch_kernels.KINDS if k != "stacked_matmul"]}
    elif case == "small":
        width, rows = 64, 16
        assert rows * width * width < STACKED_MATMUL_MACS
    else:
        dtype = torch.bfloat16
    model = Stack(width=width).to(dtype).eval()
    x = torch.randn(rows, width, dtype=dtype)
    compiled = _compile(model, **options)
    with torch.no_grad():
        before = torch_kernels.indexed_matmul_calls()
        got = compiled(x)
        assert torch_kernels.indexed_matmul_calls() == before
        # bf16: eight layers of rounding in different orders
        torch.testing.assert_close(got, model(x), **tolerance(dtype, 4.0 if dtype == torch.bfloat16 else 1.0))


@pytest.mark.parametrize("transpose_b", [0, 1])
def test_handler_clamps_the_index_like_dynamic_slice(transpose_b):
    assert torch_kernels.load()[0]
    rng = np.random.default_rng(0)
    m, k, n, layers = 8, 16, 24, 3
    a = rng.standard_normal((m, k), dtype=np.float32)
    stack = rng.standard_normal((layers, n, k) if transpose_b else (layers, k, n), dtype=np.float32)

    @jax.jit
    def product(a, stack, i):
        return jax.ffi.ffi_call("fx2xla_torch_matmul_indexed", jax.ShapeDtypeStruct((m, n), jnp.float32))(
            a, stack, i, transpose_b=np.int64(transpose_b))

    for i in (-5, -1, 0, 1, 2, 3, 7):
        layer = stack[min(max(i, 0), layers - 1)].astype(np.float64)
        want = a.astype(np.float64) @ (layer.T if transpose_b else layer)
        got = np.asarray(product(a, stack, jnp.int32(i)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"index {i}")
