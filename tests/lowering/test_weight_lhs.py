"""Matmuls of a few rows with the weight on the dot's left (option linear_weight_lhs;
lowering/linalg.py: weight_lhs_matmuls, _weight_on_the_left; plan.GraphPlan.weight_lhs).

A CPU graph, inference or training, computes a float32 matmul x[M, K] @ W.T of 4 to 64 (static)
rows, W a dense [N, K] tensor (nn.Linear's weight, or merge_linears' concatenation), as
(W . x^T)^T, with W passed as torch holds it. What these tests hold it to:
- results equal eager's at float32 rtol 1e-5 / atol 1e-5 (the dot sums in another order than
  torch's GEMM; logits of a LLaMA at 1e-4), for 2-D and 3-D inputs, with and without bias, at
  4, 8, 10 and 64 rows, and the option off gives the same within that tolerance;
- the plan lists the matmuls and relays none of their weights; the optimized HLO takes the
  weights [out, in] and computes products laid out [out, rows] (none with the option off);
- left as x . W^T: 1-3 and 65+ rows, bf16, a transposed activation (a dynamic row count:
  tests/lowering/test_linear_weights.py's test_dynamic_batch);
- training steps (forward, backward and an SGD step, each compiled): the forward's matmuls
  take it and the backward's none; after three steps the losses and parameters match eager's
  and the option off's, at rtol 1e-4 / atol 1e-5;
- LLaMA's merged q/k/v and gate/up matmuls take it too, and its logits match eager's;
- a model whose parameters are inference tensors takes it too;
- a bad option value is a clear error.
A weight changed in place or replaced, and four threads calling one compiled model, are
tests/lowering/test_linear_weights.py's test_changed_weights_follow and test_threads, run with
the option on and off. Here the kernel library's few-row matmul is off (its helper `run`), as it
would take the matmuls of 4-8 rows (tests/lowering/test_few_rows_matmul.py)."""
from __future__ import annotations

import copy
import re

import pytest
import torch

from fx2xla.metrics import live_graphs
from fx2xla.runtime.executor import optimized_hlo_text
from fx2xla.testing import llama, mlp

from tests.lowering.test_linear_weights import NO_FEW_ROWS, TOL, fresh, laid_count  # noqa: F401  (fresh: autouse)
from tests.lowering.test_linear_weights import run as _run


def run(model, *args, **options):
    """`model` compiled (option linear_weight_lhs on unless given) and called on args under
    no_grad: (result, the new graphs, compiled)."""
    return _run(model, *args, **{"linear_weight_lhs": True, **options})


def _on_the_left(graphs) -> int:
    return sum(len(g.plan.weight_lhs) for g in graphs)


@pytest.mark.parametrize("shape", [(4, 64), (8, 64), (64, 64), (2, 5, 64)], ids=["4x64", "8x64", "64x64", "2x5x64"])
def test_mlp(shape):
    """Both Linears of an MLP: eager's result; the plan lists both matmuls and relays neither
    weight; the HLO takes them [out, in] and has products [out, rows]. The option off relays
    them instead, has no such product, and agrees within TOL."""
    torch.manual_seed(0)
    model = mlp(64, 256, 48).eval()
    x = torch.randn(*shape)
    rows = x.numel() // 64
    out, graphs, _ = run(model, x)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out, expected, **TOL)
    assert _on_the_left(graphs) == 2 and laid_count(graphs) == 0
    hlo = optimized_hlo_text(graphs[0].static.exe)
    params = set(re.findall(r"= (f32\[[\d,]+\])\{[\d,]*\} parameter\(", hlo))
    assert {"f32[256,64]", "f32[48,256]"} <= params, params
    products = {f"f32[256,{rows}]", f"f32[48,{rows}]"}
    assert all(p in hlo for p in products), hlo
    torch._dynamo.reset()
    off, off_graphs, _ = run(model, x, linear_weight_lhs=False)
    assert _on_the_left(off_graphs) == 0 and laid_count(off_graphs) == 2
    assert not any(p in optimized_hlo_text(off_graphs[0].static.exe) for p in products)
    torch.testing.assert_close(out, off, **TOL)


class NoBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 96, bias=False)
        self.b = torch.nn.Linear(96, 16, bias=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_without_bias():
    """mm instead of addmm: both matmuls on the left, eager's result."""
    torch.manual_seed(0)
    model, x = NoBias().eval(), torch.randn(12, 32)
    out, graphs, _ = run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **TOL)
    assert _on_the_left(graphs) == 2


class TransposedActivation(torch.nn.Module):
    """A Linear applied to the transpose of its input: x is read as a transposed buffer."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 24)

    def forward(self, x):
        return torch.nn.functional.linear(x.t(), self.lin.weight, self.lin.bias)


@pytest.mark.parametrize("case", ["1_row", "3_rows", "65_rows", "128_rows", "bf16", "transposed_activation"])
def test_left_as_it_is(case):
    """Outside 4-64 rows, bf16, and an activation read transposed, the matmul stays x . W^T;
    results match eager (bf16: rtol 1.6e-2 / atol 2e-2)."""
    torch.manual_seed(0)
    tol = TOL
    if case == "bf16":
        model = mlp(64, 128, 32).eval().to(torch.bfloat16)
        x, tol = torch.randn(8, 64, dtype=torch.bfloat16), dict(rtol=1.6e-2, atol=2e-2)
    elif case == "transposed_activation":
        model, x = TransposedActivation().eval(), torch.randn(16, 8)
    else:
        model, x = mlp(64, 128, 32).eval(), torch.randn(int(case.split("_")[0]), 64)
    out, graphs, _ = run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **tol)
    assert _on_the_left(graphs) == 0


def test_weights_created_under_inference_mode():
    """A model built under torch.inference_mode (its parameters inference tensors, imported on
    every call, so never relaid): the weight on the left copies nothing, so its matmuls take
    it all the same, and results match eager."""
    with torch.inference_mode():
        torch.manual_seed(0)
        model = mlp(32, 64, 16).eval()
        x = torch.randn(8, 32)
        out, graphs, _ = run(model, x)
        torch.testing.assert_close(out, model(x), **TOL)
    assert _on_the_left(graphs) == 2 and laid_count(graphs) == 0


def test_llama_merged_linears():
    """A transformers LLaMA (GQA) forward on 2 x 8 tokens: per layer the merged q/k/v and
    gate/up matmuls, o and down, and the lm_head are on the left (2 * 4 + 1), no weight is
    relaid, and the logits match eager's at rtol 1e-4 / atol 1e-4, as with the option off."""
    torch.manual_seed(0)
    model = llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=100).eval()
    ids = torch.randint(0, 100, (2, 8))

    def logits(i):
        return model(input_ids=i, use_cache=False).logits

    out, graphs, _ = run(logits, ids)
    with torch.no_grad():
        expected = logits(ids)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert _on_the_left(graphs) == 2 * 4 + 1 and laid_count(graphs) == 0
    torch._dynamo.reset()
    off, off_graphs, _ = run(logits, ids, linear_weight_lhs=False)
    assert _on_the_left(off_graphs) == 0
    torch.testing.assert_close(out, off, rtol=1e-4, atol=1e-4)


def _trained(model, x, y, steps: int, options: dict | None):
    """`model` trained `steps` SGD steps on (x, y), forward and optimizer step compiled with
    `options` (eagerly with options None): (losses, the new graphs). SGD moves a parameter by
    lr x its gradient, so the gradients' rounding stays rounding in the parameters (AdamW's
    first steps move every parameter by about lr, a near-zero gradient's sign included)."""
    before = {id(g) for g in live_graphs}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fwd, step = model, opt.step
    if options is not None:
        fwd = torch.compile(model, backend="fx2xla", options=options)
        step = torch.compile(opt.step, backend="fx2xla", options=options)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(fwd(x), y)
        loss.backward()
        step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [g for g in live_graphs if id(g) not in before]


@pytest.mark.parametrize("shape", [(4, 64), (32, 64), (64, 64), (2, 5, 64)], ids=["4x64", "32x64", "64x64", "2x5x64"])
def test_training_steps(shape):
    """Three SGD steps of an MLP, each graph compiled: the forward graph computes both matmuls
    with the weight on the left and relays no weight, the backward none (its matmuls read the
    weight untransposed or multiply two activations); the three losses and the parameters after
    the last step match eager's at rtol 1e-4 / atol 1e-5, and the option off's (which puts no
    weight on the left) at that tolerance."""
    torch.manual_seed(0)
    model = mlp(64, 256, 48)
    x, y = torch.randn(*shape), torch.randint(0, 48, shape[:-1])
    if x.dim() == 3:
        y = y.reshape(-1)
        model = torch.nn.Sequential(model, torch.nn.Flatten(0, 1))
    on_model, off_model = copy.deepcopy(model), copy.deepcopy(model)
    expected, _ = _trained(model, x, y, 3, options=None)
    tol = dict(rtol=1e-4, atol=1e-5)
    on, graphs = _trained(on_model, x, y, 3, options={"torch_kernels": NO_FEW_ROWS})
    forward = [g for g in graphs if g.training and g.plan.weight_lhs]
    assert len(forward) == 1 and len(forward[0].plan.weight_lhs) == 2, [len(g.plan.weight_lhs) for g in graphs]
    assert _on_the_left(graphs) == 2 and laid_count(graphs) == 0
    torch.testing.assert_close(on, expected, **tol)
    torch._dynamo.reset()
    off, off_graphs = _trained(off_model, x, y, 3, options={"torch_kernels": NO_FEW_ROWS, "linear_weight_lhs": False})
    assert _on_the_left(off_graphs) == 0
    torch.testing.assert_close(on, off, **tol)
    for p, q, r in zip(on_model.parameters(), model.parameters(), off_model.parameters()):
        torch.testing.assert_close(p, q, **tol)
        torch.testing.assert_close(p, r, **tol)


def test_bad_option_value():
    with pytest.raises(Exception, match="option linear_weight_lhs='yes'; expected True or False"):  # Dynamo wraps it
        torch.compile(mlp(8, 8, 8), backend="fx2xla", options={"linear_weight_lhs": "yes"})(torch.randn(4, 8))
