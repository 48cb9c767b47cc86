"""Linears that read one activation, as one matmul in CPU inference graphs (option merge_linears;
lowering/merge_linears.py; plan._input_concats).

Where a CPU inference graph multiplies one activation of 2-64 rows by two or more resident
float32 nn.Linear weights, the weights are concatenated in torch once per update (a plan
Concat) and one matmul replaces theirs. What these tests hold it to:
- results equal eager's, for 2-D and 3-D activations, with and without biases, at float32
  rtol 1e-5 / atol 1e-5 (a longer dot may sum in another order), and equal the option off at
  that tolerance;
- the plan has one Concat per group (and one per group's biases), and the graph one matmul per
  group instead of one per weight; the weights read only by a Concat are not passed on their own;
- left as they are: one row, more than 64 rows, bf16, a weight something else also reads,
  a product the graph returns (or returns a view of), training graphs, a dynamic batch, the
  option off;
- a weight changed in place is concatenated again, and results follow eager;
- a group whose weight is defined after its first product (a partitioned graph's order) is left;
- a LLaMA decode-sized forward (8 x 1 tokens) equals eager's with its q/k/v and gate/up merged;
- four threads calling one compiled model get eager's results;
- a bad option value is a clear error."""
from __future__ import annotations

import pytest
import torch

from fx2xla.metrics import live_graphs
from fx2xla.testing import llama

from tests.conftest import calls_in_threads

TOL = dict(rtol=1e-5, atol=1e-5)
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Projections(torch.nn.Module):
    """q/k/v without biases and gate/up with biases, all reading the same activation."""

    def __init__(self, width: int = 64, bias_mlp: bool = True):
        super().__init__()
        self.q = torch.nn.Linear(width, width, bias=False)
        self.k = torch.nn.Linear(width, width // 2, bias=False)
        self.v = torch.nn.Linear(width, width // 2, bias=False)
        self.gate = torch.nn.Linear(width, 3 * width, bias=bias_mlp)
        self.up = torch.nn.Linear(width, 3 * width, bias=bias_mlp)

    def forward(self, x):
        attn = self.q(x) + torch.cat([self.k(x), self.v(x)], -1)
        return attn.sum(-1, keepdim=True) + torch.nn.functional.silu(self.gate(x)) * self.up(x)


def _matmuls(graphs) -> int:
    return sum(n.target in (aten.mm.default, aten.addmm.default) for g in graphs for n in g.gm.graph.nodes)


def run(model, *args, **options):
    """Compiled `model` on args under no_grad: (result, the new graphs, the compiled model)."""
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla", options=options or None)
    with torch.no_grad():
        out = compiled(*args)
    return out, [g for g in live_graphs if id(g) not in before], compiled


@pytest.mark.parametrize("shape", [(8, 64), (2, 4, 64), (64, 64)], ids=["8x64", "2x4x64", "64x64"])
def test_projections_are_one_matmul_per_group(shape):
    """q/k/v one matmul, gate/up one addmm: 2 matmuls instead of 5; 3 Concats (the two weight
    groups and the gate/up biases); the merged weights are not passed on their own; eager's
    result, and the option off's within TOL."""
    torch.manual_seed(0)
    model = Projections().eval()
    x = torch.randn(*shape)
    out, graphs, _ = run(model, x)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out, expected, **TOL)
    assert out.stride() == expected.stride()
    (graph,) = graphs
    assert _matmuls(graphs) == 2
    assert sorted(len(c.inputs) for c in graph.plan.concats) == [2, 2, 3]
    merged = {i for c in graph.plan.concats for i in c.inputs}
    assert not any(graph.plan.inputs[i].passed for i in merged)
    torch._dynamo.reset()
    off, off_graphs, _ = run(model, x, merge_linears=False)
    assert _matmuls(off_graphs) == 5 and not off_graphs[0].plan.concats
    torch.testing.assert_close(out, off, **TOL)


def _untouched(model, *args, **options):
    out, graphs, _ = run(model, *args, **options)
    with torch.no_grad():
        expected = model(*args)
    torch.testing.assert_close(out, expected, **TOL)
    assert not any(g.plan.concats for g in graphs)
    return graphs


def test_one_row_and_many_rows_are_left():
    """One row (XLA's matrix-vector path) and 65 rows (past the measured range) keep one
    matmul per weight."""
    torch.manual_seed(0)
    model = Projections().eval()
    assert _matmuls(_untouched(model, torch.randn(1, 64))) == 5
    torch._dynamo.reset()
    assert _matmuls(_untouched(model, torch.randn(65, 64))) == 5


def test_bf16_and_shared_weights_are_left():
    """bf16 (not measured) is left, and equals eager's at bf16's tolerance (rtol 2e-2, atol
    2e-2). A weight also read elsewhere (it must stay passed) is left out of its group; the
    model's other groups are still merged; eager's result."""
    torch.manual_seed(0)
    model = Projections().eval().to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    out, graphs, _ = run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)
    assert not graphs[0].plan.concats and _matmuls(graphs) == 5
    torch._dynamo.reset()

    class Shared(Projections):
        def forward(self, x):
            return super().forward(x) + self.q.weight.sum()

    model = Shared().eval()
    x = torch.randn(8, 64)
    out, graphs, _ = run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **TOL)
    (graph,) = graphs
    # q's weight is read by the sum too: only k/v and gate/up (with their biases) are merged.
    assert sorted(len(c.inputs) for c in graph.plan.concats) == [2, 2, 2]
    assert _matmuls(graphs) == 3


def test_returned_products_are_left():
    """Products the graph returns, themselves or through a view, are not merged (they would come
    back as views of the merged product): eager's values and strides; a view of one can be
    flattened as eager's can."""

    class Returns(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(64, 64, bias=False)
            self.k = torch.nn.Linear(64, 32, bias=False)

        def forward(self, x):
            return self.q(x), self.k(x).view(8, 2, 16)

    torch.manual_seed(0)
    model = Returns().eval()
    x = torch.randn(8, 64)
    (q, k), graphs, _ = run(model, x)
    with torch.no_grad():
        eq, ek = model(x)
    torch.testing.assert_close(q, eq, **TOL)
    torch.testing.assert_close(k, ek, **TOL)
    assert (q.stride(), k.stride()) == (eq.stride(), ek.stride())
    assert q.view(-1).shape == (512,) and not graphs[0].plan.concats


def test_training_and_dynamic_graphs_are_left():
    """A training graph (weights need grads) and a dynamic batch keep their matmuls; results and
    grads follow eager."""
    torch.manual_seed(0)
    model = Projections()
    x = torch.randn(8, 64)
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla")
    compiled(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, e in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(g, e, **TOL)
    assert not any(g.plan.concats for g in live_graphs if id(g) not in before)
    torch._dynamo.reset()
    model.eval()
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla", dynamic=True)
    with torch.no_grad():
        for rows in (4, 8):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert not any(g.plan.concats for g in live_graphs if id(g) not in before)


def _graph_with_late_weight(late: bool):
    """x @ W1.T and x @ W2.T in an FX graph whose W2 placeholder comes after the first product
    (as in a partitioned graph) when `late`, with fake metas; and its real example inputs."""
    from torch._subclasses import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    graph = torch.fx.Graph()
    x, w1 = graph.placeholder("x"), graph.placeholder("w1")
    w2 = None if late else graph.placeholder("w2")
    a = graph.call_function(aten.mm.default, (x, graph.call_function(aten.permute.default, (w1, [1, 0]))))
    if late:
        w2 = graph.placeholder("w2")
    b = graph.call_function(aten.mm.default, (x, graph.call_function(aten.permute.default, (w2, [1, 0]))))
    graph.output((graph.call_function(aten.add.Tensor, (a, b)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    real = [torch.randn(8, 16), torch.randn(24, 16), torch.randn(24, 16)]
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(*[mode.from_tensor(t) for t in real])
    return gm, real


@pytest.mark.parametrize("late", [False, True], ids=["weights-first", "weight-after-product"])
def test_operands_defined_after_the_first_product_are_left(late):
    """merge_linears on an FX graph: merged when both weights are defined before the first
    product, left (no error, graph unchanged in effect) when one comes after it; either way the
    graph computes eager's value (float32 TOL)."""
    from fx2xla.lowering.merge_linears import merge_linears

    gm, real = _graph_with_late_weight(late)
    expected = real[0] @ real[1].T + real[0] @ real[2].T
    fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    assert merge_linears(gm, fakes, {1, 2}) == (0 if late else 1)
    assert any(n.target is aten.cat.default for n in gm.graph.nodes) is not late
    (out,) = gm(*real)
    torch.testing.assert_close(out, expected, **TOL)


def test_weight_changed_in_place_is_concatenated_again():
    """The concatenation follows the weights: after an in-place write to one weight and a
    replaced bias, the next call equals eager's."""
    torch.manual_seed(0)
    model = Projections().eval()
    x = torch.randn(8, 64)
    out, graphs, compiled = run(model, x)
    with torch.no_grad():
        model.k.weight.mul_(-2.0)
        model.up.bias = torch.nn.Parameter(torch.randn(192))
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        model.gate.weight.add_(1.0)
        torch.testing.assert_close(compiled(x), model(x), **TOL)


def test_llama_decode_step_matches_eager():
    """A LLaMA forward on 8 x 1 tokens (a decode step's shape): q/k/v and gate/up merged in
    every layer (2 Concats per layer), eager's logits."""
    torch.manual_seed(0)
    model = llama().eval()
    ids = torch.randint(1, model.config.vocab_size, (8, 1))
    out, graphs, _ = run(model, ids)
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(out.logits, expected, **TOL)
    layers = model.config.num_hidden_layers
    assert sum(len(g.plan.concats) for g in graphs) == 2 * layers


def test_threads_get_eager_results():
    """Four threads calling one compiled model, each on its own input, get eager's results."""
    torch.manual_seed(0)
    model = Projections().eval()
    compiled = torch.compile(model, backend="fx2xla")
    xs = [torch.randn(8, 64) for _ in range(4)]
    with torch.no_grad():
        compiled(xs[0])
        expected = [model(x) for x in xs]
    results = calls_in_threads(compiled, xs, 20)
    for i, outs in results.items():
        assert len(outs) == 20
        for out in outs:
            torch.testing.assert_close(out, expected[i], **TOL)


def test_bad_option_is_a_clear_error():
    with pytest.raises(Exception, match="merge_linears"):
        torch.compile(Projections().eval(), backend="fx2xla", options={"merge_linears": "yes"})(torch.randn(8, 64))
