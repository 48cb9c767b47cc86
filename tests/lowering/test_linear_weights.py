"""nn.Linear weights laid out [in, out] in CPU inference graphs (option transposed_linear_weights;
lowering/linalg.py: kn_weights; plan.py).

A float32 resident weight that only matmuls of two rows or more read, transposed, is imported
once as a copy laid out [in, out] (InputKind.RELAID, perm (1, 0)), which XLA:CPU's dot reads
faster. What these tests hold it to:
- results equal eager's, for 2-D and 3-D inputs, with and without bias, static and dynamic
  batch sizes, at float32 rtol 1e-5 / atol 1e-5 (the dot sums in another order than torch's
  GEMM); and the same as the option off, at that tolerance;
- the optimized HLO reads the weight as passed: no transpose is left in the program;
- weights left as they are: one-row matmuls, bf16, a weight the embedding also reads (tied
  lm_head), a weight read untransposed, training graphs (with and without the weight on the
  left), the option off;
- a weight changed in place or replaced is imported again, and results follow eager (also with
  the weight on the left of its matmuls, option linear_weight_lhs);
- a LLaMA forward matches eager with its projections relaid;
- four threads calling one compiled MLP get eager's results (weights relaid, and on the left);
- a bad option value is a clear error.

The helper `run` compiles with option linear_weight_lhs off: at 4-64 rows that option computes
the matmul with the weight as torch holds it instead (tests/lowering/test_weight_lhs.py); and
without the kernel library's few-row matmul (torch_kernels without "few_rows_matmul"), which at
2-8 rows reads the weight as torch holds it too (tests/lowering/test_few_rows_matmul.py)."""
from __future__ import annotations

import copy
import re

import pytest
import torch

from fx2xla.metrics import live_graphs
from fx2xla.plan import InputKind
from fx2xla.runtime.executor import optimized_hlo_text
from fx2xla.testing import llama, mlp

from tests.conftest import calls_in_threads

TOL = dict(rtol=1e-5, atol=1e-5)
# The option torch_kernels with every kind but the few-row float32 matmul.
NO_FEW_ROWS = ["convolution", "skinny_matmul", "attention"]


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def new_graphs(before):
    return [g for g in live_graphs if id(g) not in before]


def laid_count(graphs) -> int:
    return sum(p.kind is InputKind.RELAID and p.perm == (1, 0) for g in graphs for p in g.plan.inputs)


def run(model, *args, **options):
    """Compiled `model` on args under no_grad, options linear_weight_lhs off and torch_kernels
    NO_FEW_ROWS unless given: (result, the new graphs)."""
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla",
                             options={"linear_weight_lhs": False, "torch_kernels": NO_FEW_ROWS, **options})
    with torch.no_grad():
        out = compiled(*args)
    return out, new_graphs(before), compiled


@pytest.mark.parametrize("shape", [(8, 64), (32, 64), (2, 5, 64)], ids=["8x64", "32x64", "2x5x64"])
def test_mlp_weights_are_laid_out_in_out(shape):
    """Both Linear weights relaid; eager's result; the option off gives the same within TOL. The
    optimized HLO takes the weights as [in, out] parameters and has no transpose left (none
    copies a weight back per call)."""
    torch.manual_seed(0)
    model = mlp(64, 256, 48).eval()
    x = torch.randn(*shape)
    out, graphs, _ = run(model, x)
    with torch.no_grad():
        expected = model(x)
    torch.testing.assert_close(out, expected, **TOL)
    assert laid_count(graphs) == 2
    hlo = optimized_hlo_text(graphs[0].static.exe)
    params = set(re.findall(r"= (f32\[[\d,]+\])\{[\d,]*\} parameter\(", hlo))
    assert {"f32[64,256]", "f32[256,48]"} <= params and not {"f32[256,64]", "f32[48,256]"} & params, params
    assert "transpose(" not in hlo, hlo
    torch._dynamo.reset()
    off, off_graphs, _ = run(model, x, transposed_linear_weights=False)
    assert laid_count(off_graphs) == 0
    torch.testing.assert_close(out, off, **TOL)


class TiedHead(torch.nn.Module):
    """An embedding whose weight the output projection reuses (tie_word_embeddings)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.proj = torch.nn.Linear(32, 32, bias=False)

    def forward(self, ids):
        h = torch.relu(self.proj(self.emb(ids)))
        return h @ self.emb.weight.t()


class ReadPlain(torch.nn.Module):
    """A Linear whose weight is also read untransposed."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) + x @ self.lin.weight


@pytest.mark.parametrize("case", ["one_row", "bf16", "tied", "read_plain"])
def test_weights_left_as_they_are(case):
    """One-row matmuls (XLA keeps a transpose there), bf16 (XLA's bf16 dot is slower on
    [in, out]), a weight the embedding also gathers from, and one read untransposed elsewhere
    are not relaid (the tied case relays only its own Linear), and match eager."""
    torch.manual_seed(0)
    if case == "one_row":
        model, x, tol, laid = mlp(64, 128, 32).eval(), torch.randn(1, 64), TOL, 0
    elif case == "bf16":
        model = mlp(64, 128, 32).eval().to(torch.bfloat16)
        x, tol, laid = torch.randn(8, 64, dtype=torch.bfloat16), dict(rtol=1.6e-2, atol=2e-2), 0
    elif case == "tied":
        model, x, tol, laid = TiedHead().eval(), torch.randint(0, 50, (2, 6)), TOL, 1
    else:
        model, x, tol, laid = ReadPlain().eval(), torch.randn(4, 16), TOL, 0
    out, graphs, _ = run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **tol)
    assert laid_count(graphs) == laid


def test_training_graphs_keep_their_weights():
    """A training step reads weights as torch holds them (they change every step): none is
    relaid, whether its matmuls put the weight on the left (option linear_weight_lhs, on by
    default: tests/lowering/test_weight_lhs.py's test_training_steps) or not; gradients match
    eager's at rtol 1e-4 / atol 1e-5 either way."""
    for weight_lhs in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = mlp(32, 64, 16)
        ref = copy.deepcopy(model)
        x = torch.randn(8, 32)
        before = {id(g) for g in live_graphs}
        torch.compile(model, backend="fx2xla", options={"linear_weight_lhs": weight_lhs})(x).sum().backward()
        ref(x).sum().backward()
        assert len(new_graphs(before)) == 2 and laid_count(new_graphs(before)) == 0
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weight_lhs", [False, True], ids=["relaid", "weight_lhs"])
def test_changed_weights_follow(weight_lhs):
    """A weight changed in place, then one replaced: the next calls import the new values,
    relaid, and (option linear_weight_lhs, tests/lowering/test_weight_lhs.py) read as torch
    holds them by matmuls with the weight on the left."""
    torch.manual_seed(0)
    model = mlp(32, 64, 16).eval()
    x = torch.randn(8, 32)
    out, graphs, compiled = run(model, x, linear_weight_lhs=weight_lhs)
    assert laid_count(graphs) == (0 if weight_lhs else 2)
    assert sum(len(g.plan.weight_lhs) for g in graphs) == (2 if weight_lhs else 0)
    with torch.no_grad():
        model[0].weight.mul_(-0.5)
        torch.testing.assert_close(compiled(x), model(x), **TOL)
        model[2].weight = torch.nn.Parameter(torch.randn_like(model[2].weight))
        torch.testing.assert_close(compiled(x), model(x), **TOL)


def test_dynamic_batch():
    """Under dynamic=True the rows are symbolic (Dynamo specializes 0 and 1): weights relaid,
    no matmul with its weight on the left (option linear_weight_lhs, on here: it needs static
    rows), and batch sizes 2, 5, 9 and 40 match eager."""
    torch.manual_seed(0)
    model = mlp(32, 64, 16).eval()
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla", dynamic=True)
    with torch.no_grad():
        for batch in (2, 5, 9, 40):
            x = torch.randn(batch, 32)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert laid_count(new_graphs(before)) == 2
    assert not any(g.plan.weight_lhs for g in new_graphs(before))


def test_llama_forward():
    """A transformers LLaMA (GQA) forward on 2 x 8 tokens: its projections are relaid (the
    tied-free lm_head too) and the logits match eager's. With the linears that read one
    activation merged (option merge_linears, on by default; tests/lowering/test_merge_linears.py),
    q/k/v and gate/up are concatenated instead, and only o, down and lm_head are relaid."""
    torch.manual_seed(0)
    model = llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=100).eval()
    ids = torch.randint(0, 100, (2, 8))
    for merge, laid in ((False, 2 * 7 + 1), (True, 2 * 2 + 1)):
        torch._dynamo.reset()
        out, graphs, _ = run(lambda i: model(input_ids=i, use_cache=False).logits, ids, merge_linears=merge)
        with torch.no_grad():
            torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits, rtol=1e-4, atol=1e-4)
        # unmerged: q, k, v, o, gate, up, down per layer, and lm_head (untied in this config)
        assert laid_count(graphs) == laid


@pytest.mark.parametrize("weight_lhs", [False, True], ids=["relaid", "weight_lhs"])
def test_threads(weight_lhs):
    """Four threads calling one compiled MLP at once, 5 calls each, get eager's results, with
    its weights relaid and with them on the left of its matmuls."""
    torch.manual_seed(0)
    model = mlp(32, 64, 16).eval()
    compiled = torch.compile(model, backend="fx2xla", options={"linear_weight_lhs": weight_lhs})
    inputs = [torch.randn(8, 32) for _ in range(4)]
    with torch.no_grad():
        compiled(inputs[0])
        expected = [model(x) for x in inputs]
    for i, outs in calls_in_threads(compiled, inputs, calls=5).items():
        for out in outs:
            torch.testing.assert_close(out, expected[i], **TOL)


def test_bad_option_value():
    with pytest.raises(Exception, match="option transposed_linear_weights='yes'; expected True, False or 'always'"):  # Dynamo wraps it
        torch.compile(mlp(8, 8, 8), backend="fx2xla", options={"transposed_linear_weights": "yes"})(torch.randn(2, 8))


def test_weights_created_under_inference_mode_stay_as_they_are():
    """A model built under torch.inference_mode has inference-tensor parameters, which carry no
    version: fx2xla imports them on every call, so none is laid out anew (no copy per call),
    neither the Linear weights nor the convolution weights; results match eager. A model built
    normally and called under inference_mode (only its input an inference tensor) keeps both."""
    from fx2xla.testing import SmallCNN

    with torch.inference_mode():
        torch.manual_seed(0)
        built_inside = SmallCNN().eval()
    torch.manual_seed(0)
    built_outside = SmallCNN().eval()
    for model, relaid in ((built_inside, 0), (built_outside, 4)):
        torch._dynamo.reset()
        before = {id(g) for g in live_graphs}
        with torch.inference_mode():
            x = torch.randn(4, 3, 32, 32)
            out = torch.compile(model, backend="fx2xla",
                                options={"linear_weight_lhs": False, "torch_kernels": NO_FEW_ROWS})(x)
            torch.testing.assert_close(out, model(x), **TOL)
        graphs = new_graphs(before)
        assert sum(p.kind is InputKind.RELAID for g in graphs for p in g.plan.inputs) == relaid
