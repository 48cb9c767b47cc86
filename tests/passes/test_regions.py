"""torch.compiler.nested_compile_region with fx2xla: regions lower (no eager fallback), and a
run of calls of one region folds into one loop, found from the calls themselves (no module
numbering needed), for inference and training.

Tolerances (float32): outputs 1e-4 abs / 1e-4 rel against eager; gradients 1e-4 rel / 1e-5
abs (the same per-layer math; XLA fuses differently from eager).
"""
from __future__ import annotations

import copy
import glob
import os
import re
import warnings

import pytest
import torch
import transformers.models.gpt2.modeling_gpt2 as modeling_gpt2

import fx2xla
from fx2xla.passes import run_passes
from fx2xla.testing import LogitsOnly, gpt2, token_ids


def _metric(name):
    return fx2xla.metrics()[name]


def _compile(fn, **options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", fullgraph=True, options=options)


@pytest.fixture
def gpt2_regions(monkeypatch):
    """GPT-2 blocks marked as nested compile regions, as a user following torch's advice for
    deep transformer stacks would do."""
    monkeypatch.setattr(modeling_gpt2.GPT2Block, "forward",
                        torch.compiler.nested_compile_region(modeling_gpt2.GPT2Block.forward))


def _grads_match(model, twin):
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("layers,min_layers,folds", [(3, 8, 0), (3, 2, 1), (8, 8, 1)])
def test_gpt2_regions_match_eager_folded_or_not(gpt2_regions, layers, min_layers, folds):
    """Below scan_min_layers the region calls are lowered as they are (before, they fell back
    to eager); from it on they fold. Forward and gradients match eager either way."""
    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=layers, hidden=64)).eval()  # eval: no dropout
    twin = copy.deepcopy(model)
    ids = token_ids(2, 16)
    expected = model(ids)
    expected.pow(2).mean().backward()
    folds0, fallback0 = _metric("scan_folds"), _metric("fallback_ops")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "runs eagerly" fallback warning
        got = _compile(twin, scan_min_layers=min_layers)(ids)
        got.pow(2).mean().backward()
    assert _metric("fallback_ops") == fallback0
    assert _metric("scan_folds") == folds0 + folds
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    _grads_match(model, twin)


def test_gpt2_region_fold_is_one_loop(gpt2_regions, tmp_path, monkeypatch):
    monkeypatch.setenv("FX2XLA_DUMP_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=8, hidden=64)).eval()
    ids = token_ids(1, 16)
    with torch.no_grad():
        torch.testing.assert_close(_compile(model)(ids), model(ids), rtol=1e-4, atol=1e-4)
    notes = open(glob.glob(str(tmp_path / "*_pass_scan_folding.fx.txt"))[0]).read()
    assert "folded nested_compile_region" in notes and "8 layers" in notes, notes
    (hlo,) = glob.glob(str(tmp_path / "*inference.stablehlo.mlir"))
    assert len(re.findall(r"stablehlo\.while", open(hlo).read())) == 1


@torch.compiler.nested_compile_region
def _layer(x, w, b):
    return x + torch.tanh(x @ w + b)


def _loop(x, ws, bs):
    for w, b in zip(ws, bs):
        x = _layer(x, w, b)
    return x


def _scaled_loop(x, ws, bs):
    for w, b in zip(ws, bs):
        x = _layer(x, w, b) * 0.5  # work between the calls: not a chain of calls
    return x


@pytest.mark.parametrize("fn,folds", [(_loop, 1), (_scaled_loop, 0)])
def test_function_region_in_a_python_loop(fn, folds):
    """A region that is a plain function (no numbered modules to go by) folds when its calls
    follow one another; work between calls keeps them unrolled. Gradients reach every
    layer's own weights."""
    torch.manual_seed(0)
    n, d = 6, 16
    ws = [(torch.randn(d, d) / d ** 0.5).requires_grad_() for _ in range(n)]  # well-conditioned
    bs = [torch.randn(d, requires_grad=True) for _ in range(n)]
    x = torch.randn(4, d, requires_grad=True)
    expected = fn(x, ws, bs)
    expected.sum().backward()
    want = [t.grad.clone() for t in (x, *ws, *bs)]
    for t in (x, *ws, *bs):
        t.grad = None
    folds0, fallback0 = _metric("scan_folds"), _metric("fallback_ops")
    got = _compile(fn, scan_min_layers=2)(x, ws, bs)
    got.sum().backward()
    assert _metric("scan_folds") == folds0 + folds
    assert _metric("fallback_ops") == fallback0  # unfolded calls are lowered, not run eagerly
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for t, g in zip((x, *ws, *bs), want):
        torch.testing.assert_close(t.grad, g, rtol=1e-4, atol=1e-5)


def test_region_runs_are_found_in_dynamo_graph():
    """The pass's own report: one run of six calls, its weights stacked, `x` carried."""
    ws = [torch.randn(8, 8) for _ in range(6)]
    bs = [torch.randn(8) for _ in range(6)]
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_loop, backend=backend, fullgraph=True)(torch.randn(2, 8), ws, bs)
    gm, examples = seen[0]
    new, records = run_passes(gm, examples, {"scan_min_layers": 2}, "test")
    assert new is not gm
    (note,) = [n for n in records[0].notes if n.startswith("folded")]
    assert note.startswith("folded nested_compile_region") and "6 layers" in note, note
    assert "1 carried, 2 stacked" in note, note
    assert sum(n.target is torch.ops.higher_order.invoke_subgraph for n in new.graph.nodes) == 0


def test_dynamic_dropout_rate_stays_unrolled_without_a_failed_compile():
    """A dropout rate changed after the first compile reaches Dynamo's next graph as a 0-d
    tensor read with .item(): a loop body could not trace dropout's check on it, so the pass
    leaves those layers unrolled and says why (no failed compile, no warning)."""
    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=3, hidden=64)).eval()
    ids = token_ids(2, 8)
    compiled = _compile(model, scan_min_layers=2)
    with torch.no_grad():
        compiled(ids)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model.train()
    twin = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = compiled(ids)
    torch.testing.assert_close(got, twin(ids), rtol=1e-4, atol=1e-4)
