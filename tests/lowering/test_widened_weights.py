"""bf16/float16 nn.Linear weights multiplied through float32 copies in CPU inference graphs
(option widened_linear_weights; lowering/linalg.py: widened_weights; plan.py InputKind.WIDENED).

XLA:CPU has no half-precision GEMM: its bf16 dot converts the weight to float32 in a pass of its
own on every call. A resident bf16/float16 weight that only matmuls of 16 rows or more read, as
their right operand (transposed, nn.Linear's, or as stored, transformers' Conv1D), is imported
once as a float32 copy instead, and those matmuls multiply the copy with
the activation widened (exactly: every bf16/float16 value is a float32 value). What these tests
hold it to:
- results match eager's at bf16 rtol 1.6e-2 / atol 2e-2 and float16 rtol 2e-3 / atol 2e-3 (one
  rounding of the float32 sum, in another order than torch's kernel), for 2-D and 3-D inputs,
  with and without bias, and the option off at the same tolerances;
- the optimized HLO takes the weights as float32 parameters;
- weights left as they are: fewer than 16 rows, float32 weights, a weight the embedding also
  gathers from (tied), training graphs, weights built under inference_mode, the option off, and
  copies past WIDEN_MAX_BYTES per graph (unless the option says "always");
- a weight changed in place or replaced is imported again, and results follow eager;
- dynamic batch sizes, LLaMA and GPT-2 (Conv1D) forwards and four threads match eager;
- a bad option value is a clear error."""
from __future__ import annotations

import copy
import re

import pytest
import torch

from fx2xla.metrics import live_graphs
from fx2xla.plan import InputKind
from fx2xla.runtime.executor import optimized_hlo_text
from fx2xla.testing import gpt2, llama, mlp

from tests.conftest import calls_in_threads
from tests.lowering.test_linear_weights import TiedHead, new_graphs, fresh  # noqa: F401  (fresh: autouse fixture)

TOL = {torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def widened_count(graphs) -> int:
    return sum(p.kind is InputKind.WIDENED for g in graphs for p in g.plan.inputs)


def run(model, *args, **options):
    """Compiled `model` on args under no_grad: (result, the new graphs, the compiled model)."""
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla", options=options)
    with torch.no_grad():
        out = compiled(*args)
    return out, new_graphs(before), compiled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(16, 64), (32, 64), (2, 12, 64)], ids=["16x64", "32x64", "2x12x64"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_mlp_weights_are_widened(dtype, shape, bias):
    """Both Linear weights widened; eager's result; the HLO's weight parameters are float32;
    the option off gives the same within the dtype's tolerance, its weights as they are. The
    copies stay the dot's right operand (option linear_weight_lhs takes float32 weights only:
    its transposed product, rounded to bf16, can reach a bf16 dot that XLA:CPU cannot run)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256, bias=bias), torch.nn.GELU(),
                                torch.nn.Linear(256, 48, bias=bias)).eval().to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    out, graphs, _ = run(model, x)
    with torch.no_grad():
        expected = model(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOL[dtype])
    assert widened_count(graphs) == 2
    hlo = optimized_hlo_text(graphs[0].static.exe)
    params = set(re.findall(r"= ([a-z0-9]+\[[\d,]+\])\{[\d,]*\} parameter\(", hlo))
    assert {"f32[256,64]", "f32[48,256]"} <= params, params
    assert not any(g.plan.weight_lhs for g in graphs)
    torch._dynamo.reset()
    off, off_graphs, _ = run(model, x, widened_linear_weights=False)
    assert widened_count(off_graphs) == 0
    torch.testing.assert_close(out, off, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("features", [(64, 1), (1, 64)], ids=["out1", "in1"])
def test_weights_with_a_dim_of_one_are_widened(dtype, features):
    """A Linear with one output or one input feature (a gate: weight [1, 64] or [64, 1], whose
    transpose torch also calls contiguous) over 64 and 200 rows: eager's result within the dtype's
    tolerance, and its weight widened. (The copy used to meet the untransposed operand: an error
    naming the dot's contracting dims, Qwen2-MoE's shared-expert gate in bf16.)"""
    torch.manual_seed(0)
    model = torch.nn.Linear(*features).eval().to(dtype)
    for rows in (64, 200):
        torch._dynamo.reset()
        x = torch.randn(rows, features[0], dtype=dtype)
        out, graphs, _ = run(model, x)
        with torch.no_grad():
            expected = model(x)
        assert out.dtype == dtype and out.shape == expected.shape
        torch.testing.assert_close(out, expected, **TOL[dtype])
        assert widened_count(graphs) == 1


@pytest.mark.parametrize("case", ["few_rows", "float32", "tied", "option_off"])
def test_weights_left_as_they_are(case):
    """Matmuls of fewer than 16 rows (XLA's dot converts as it goes there), float32 weights, a
    weight the embedding also gathers from (the tied case widens only its own Linear) and the
    option off keep their weights; results match eager."""
    torch.manual_seed(0)
    options, tol = {}, TOL[torch.bfloat16]
    if case == "few_rows":
        model, x, widened = mlp(64, 128, 32).eval().to(torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16), 0
    elif case == "float32":
        model, x, widened, tol = mlp(64, 128, 32).eval(), torch.randn(32, 64), 0, dict(rtol=1e-5, atol=1e-5)
    elif case == "tied":
        model, x, widened = TiedHead().eval().to(torch.bfloat16), torch.randint(0, 50, (4, 6)), 1
    else:
        model, x, widened = mlp(64, 128, 32).eval().to(torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16), 0
        options = {"widened_linear_weights": False}
    out, graphs, _ = run(model, x, **options)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **tol)
    assert widened_count(graphs) == widened


def test_training_graphs_keep_their_weights():
    """A bf16 training step reads its weights as torch holds them (they change every step), and
    its gradients match eager's."""
    torch.manual_seed(0)
    model = mlp(32, 64, 16).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    before = {id(g) for g in live_graphs}
    torch.compile(model, backend="fx2xla")(x).float().sum().backward()
    ref(x).float().sum().backward()
    assert widened_count(new_graphs(before)) == 0
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=5e-2, atol=5e-2)


def test_changed_weights_follow():
    """A weight changed in place, then one replaced: the next calls import the new values as new
    float32 copies, and match eager."""
    torch.manual_seed(0)
    model = mlp(32, 64, 16).eval().to(torch.bfloat16)
    x = torch.randn(32, 32, dtype=torch.bfloat16)
    out, graphs, compiled = run(model, x)
    assert widened_count(graphs) == 2
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **TOL[torch.bfloat16])
        model[0].weight.mul_(-0.5)
        torch.testing.assert_close(compiled(x), model(x), **TOL[torch.bfloat16])
        model[2].weight = torch.nn.Parameter(torch.randn_like(model[2].weight))
        torch.testing.assert_close(compiled(x), model(x), **TOL[torch.bfloat16])


def test_dynamic_batch():
    """Under dynamic=True the rows are symbolic and count at the size traced (40 here): the
    weights are widened, and batch sizes 40, 20, 3 and 64 all match eager, the small one too."""
    torch.manual_seed(0)
    model = mlp(32, 64, 16).eval().to(torch.bfloat16)
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla", dynamic=True)
    with torch.no_grad():
        for batch in (40, 20, 3, 64):
            x = torch.randn(batch, 32, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), model(x), **TOL[torch.bfloat16])
    assert widened_count(new_graphs(before)) == 2


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_transformers_forward(arch):
    """bf16 forwards on 2 x 8 tokens (16 rows) match eager's logits at the bf16 model tolerance,
    with their projections widened: LLaMA (GQA) q, k, v, o, gate, up and down per layer (bf16
    linears are not merged) and lm_head; GPT-2, whose Conv1D multiplies its weight as stored,
    [in, out] (addmm(b, x, W)), its four weights per layer (lm_head is the tied embedding, not
    widened)."""
    torch.manual_seed(0)
    if arch == "llama":
        model, widened = llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=100), 2 * 7 + 1
    else:
        model, widened = gpt2(layers=2, hidden=64, heads=4, vocab=100, positions=32), 2 * 4
    model = model.eval().to(torch.bfloat16)
    ids = torch.randint(0, 100, (2, 8))
    out, graphs, _ = run(lambda i: model(input_ids=i, use_cache=False).logits, ids)
    with torch.no_grad():
        torch.testing.assert_close(out, model(input_ids=ids, use_cache=False).logits, rtol=5e-2, atol=5e-2)
    assert widened_count(graphs) == widened


def test_threads():
    """Four threads calling one compiled bf16 MLP at once, 5 calls each, get eager's results."""
    torch.manual_seed(0)
    model = mlp(32, 64, 16).eval().to(torch.bfloat16)
    compiled = torch.compile(model, backend="fx2xla")
    inputs = [torch.randn(32, 32, dtype=torch.bfloat16) for _ in range(4)]
    with torch.no_grad():
        compiled(inputs[0])
        expected = [model(x) for x in inputs]
    for i, outs in calls_in_threads(compiled, inputs, calls=5).items():
        for out in outs:
            torch.testing.assert_close(out, expected[i], **TOL[torch.bfloat16])


def test_weights_built_under_inference_mode_stay_as_they_are():
    """Inference-tensor parameters carry no version: fx2xla imports them on every call, so none
    is widened (no copy per call); results match eager."""
    with torch.inference_mode():
        torch.manual_seed(0)
        model = mlp(32, 64, 16).eval().to(torch.bfloat16)
        x = torch.randn(32, 32, dtype=torch.bfloat16)
        before = {id(g) for g in live_graphs}
        out = torch.compile(model, backend="fx2xla")(x)
        torch.testing.assert_close(out, model(x), **TOL[torch.bfloat16])
    assert widened_count(new_graphs(before)) == 0


def test_copies_are_bounded(monkeypatch):
    """A graph makes at most WIDEN_MAX_BYTES of float32 copies, in input order: with room for the
    first weight's copy only (256 x 64 x 4 bytes), the second stays bf16; "always" widens both.
    Results match eager either way."""
    from fx2xla.lowering import linalg

    monkeypatch.setattr(linalg, "WIDEN_MAX_BYTES", 256 * 64 * 4 + 100)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 48)).eval()
    model = model.to(torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
    for value, widened, params in ((True, 1, {"f32[256,64]", "bf16[48,256]"}), ("always", 2, {"f32[256,64]", "f32[48,256]"})):
        torch._dynamo.reset()
        out, graphs, _ = run(model, x, widened_linear_weights=value)
        torch.testing.assert_close(out, expected, **TOL[torch.bfloat16])
        assert widened_count(graphs) == widened
        hlo = optimized_hlo_text(graphs[0].static.exe)
        assert params <= set(re.findall(r"= ([a-z0-9]+\[[\d,]+\])\{[\d,]*\} parameter\(", hlo)), value


def test_bad_option_value():
    with pytest.raises(Exception, match="option widened_linear_weights='yes'; expected True, False or 'always'"):  # Dynamo wraps it
        torch.compile(mlp(8, 8, 8), backend="fx2xla", options={"widened_linear_weights": "yes"})(torch.randn(2, 8))
