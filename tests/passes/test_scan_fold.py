"""Scan-folding (passes/scan_fold.py): repeated layers compile as one loop, results unchanged.

Tolerances (float32): outputs 1e-4 abs / 1e-4 rel against eager; gradients 1e-4 rel / 1e-5 abs
(the loop reorders nothing inside a layer, so the only difference is XLA's own fusion).
"""
from __future__ import annotations

import copy
import glob
import os
import re

import pytest
import torch

import fx2xla
from fx2xla.passes import run_passes
from fx2xla.testing import LogitsOnly, NormBlock, bert, gpt2, llama, token_ids

BUILDERS = {"gpt2": gpt2, "bert": bert, "llama": llama}


def _folds() -> int:
    return fx2xla.metrics()["scan_folds"]


def _compile(model, **options):
    """Compiled with folding from two layers on (the default folds stacks of 8 or more)."""
    torch._dynamo.reset()
    return torch.compile(model, backend="fx2xla", fullgraph=True, options={"scan_min_layers": 2, **options})


def _dynamo_graph(fn, *inputs):
    """Dynamo's graph of `fn` and its example inputs (what the pass manager receives)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return seen[0]


@pytest.mark.parametrize("name,layers", [("gpt2", 2), ("gpt2", 12), ("bert", 3), ("llama", 2), ("llama", 6)])
def test_folded_inference_matches_eager(name, layers):
    torch.manual_seed(0)
    model = LogitsOnly(BUILDERS[name](layers=layers)).eval()
    ids = token_ids(2, 32)
    with torch.no_grad():
        expected = model(ids)
        before = _folds()
        got = _compile(model)(ids)
    assert _folds() == before + 1, "the layers were not folded"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,layers", [("gpt2", 3), ("gpt2", 12), ("bert", 2), ("llama", 2)])
def test_folded_gradients_match_eager(name, layers):
    torch.manual_seed(0)
    model = LogitsOnly(BUILDERS[name](layers=layers)).eval()  # eval: no dropout (see below)
    twin = copy.deepcopy(model)
    ids = token_ids(2, 16)
    expected = model(ids)
    expected.pow(2).mean().backward()
    before = _folds()
    got = _compile(twin)(ids)
    got.pow(2).mean().backward()
    assert _folds() == before + 1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if p.grad is None:  # unused by the loss (BERT's pooler): None in both
            assert q.grad is None, n
            continue
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=n)


def _count(pattern: str, folder) -> int:
    (path,) = [p for p in glob.glob(os.path.join(folder, "*inference.stablehlo.mlir"))]
    return len(re.findall(pattern, open(path).read()))


def test_folded_module_has_one_loop_and_one_body(tmp_path, monkeypatch):
    counts = {}
    for layers in (2, 12):
        folder = tmp_path / f"l{layers}"
        monkeypatch.setenv("FX2XLA_DUMP_DIR", str(folder))
        torch.manual_seed(0)
        model = LogitsOnly(gpt2(layers=layers)).eval()
        with torch.no_grad():
            _compile(model)(token_ids(1, 16))
        counts[layers] = (_count(r"stablehlo\.while", folder), _count(r"stablehlo\.dot_general", folder))
        notes = open(glob.glob(os.path.join(folder, "*_pass_scan_folding.fx.txt"))[0]).read()
        assert f"folded L['self'].model.transformer.h.0..{layers - 1}" in notes
    assert counts[12][0] == 1, counts
    # One copy of the layer body whatever the depth: as many matmuls at 12 layers as at 2.
    assert counts[12][1] == counts[2][1], counts
    monkeypatch.setenv("FX2XLA_DUMP_DIR", str(tmp_path / "unfolded"))
    with torch.no_grad():
        _compile(LogitsOnly(gpt2(layers=12)).eval(), scan_folding=False)(token_ids(1, 16))
    assert _count(r"stablehlo\.while", tmp_path / "unfolded") == 0
    assert _count(r"stablehlo\.dot_general", tmp_path / "unfolded") > 5 * counts[12][1]


def test_option_turns_folding_off():
    model = LogitsOnly(gpt2(layers=3)).eval()
    ids = token_ids(1, 8)
    before = _folds()
    with torch.no_grad():
        got = _compile(model, scan_folding=False)(ids)
        torch.testing.assert_close(got, model(ids), rtol=1e-4, atol=1e-4)
    assert _folds() == before


def test_default_folds_deep_stacks_only():
    """Default scan_min_layers (8): a 4-layer stack stays unrolled, an 8-layer one folds."""
    for layers, folds in ((4, 0), (8, 1)):
        model = Stack([Block(16) for _ in range(layers)])
        x = torch.randn(2, 16)
        torch._dynamo.reset()
        before = _folds()
        with torch.no_grad():
            out = torch.compile(model, backend="fx2xla", fullgraph=True)(x)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
        assert _folds() == before + folds, layers
    with pytest.raises(Exception, match="scan_min_layers=1"):  # Dynamo wraps backend errors
        torch.compile(model, backend="fx2xla", options={"scan_min_layers": 1})(x)


def test_pass_is_timed_in_metrics():
    with torch.no_grad():
        _compile(LogitsOnly(gpt2(layers=2)).eval())(token_ids(1, 8))
    assert fx2xla.metrics()["pass_seconds"]["scan_folding"] > 0


def test_per_layer_outputs_are_stacked():
    """Every layer's hidden state read after the loop (output_hidden_states): stacked ys."""
    torch.manual_seed(0)
    model = gpt2(layers=4).eval()

    def run(ids):
        return model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states

    ids = token_ids(2, 8)
    with torch.no_grad():
        expected = run(ids)
        gm, examples = _dynamo_graph(run, ids)
        _, records = run_passes(gm, examples, {"scan_min_layers": 2}, "test")
        assert any(n.startswith("folded") and "1 per-layer outputs" in n for n in records[0].notes), records
        before = _folds()
        got = _compile(run)(ids)
        assert _folds() == before + 1
    assert len(got) == len(expected) == 5
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


class Block(torch.nn.Module):
    def __init__(self, width, act=torch.nn.GELU, p=0.0):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.act = act()
        self.drop = torch.nn.Dropout(p)

    def forward(self, x, extra=None):
        y = x + self.drop(self.act(self.fc(x)))
        return y if extra is None else y + extra


class Stack(torch.nn.Module):
    def __init__(self, blocks, skip=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.skip = skip

    def forward(self, x):
        if not self.skip:
            for b in self.blocks:
                x = b(x)
            return x
        outs = [x * 0.5, x]
        for b in self.blocks:  # each block also reads the output of the block two before it
            outs.append(b(outs[-1], outs[-2]))
        return outs[-1]


def _notes(model, x):
    gm, examples = _dynamo_graph(model, x)
    gm2, records = run_passes(gm, examples, {"scan_min_layers": 2}, "test")
    return gm2 is not gm, records[0].notes if records else []


@pytest.mark.parametrize("case", ["different_activation", "different_width", "skip_connection"])
def test_blocks_that_differ_are_not_folded(case):
    torch.manual_seed(0)
    if case == "different_activation":
        model = Stack([Block(16), Block(16), Block(16, torch.nn.ReLU), Block(16)])
    elif case == "different_width":
        model = torch.nn.Sequential(Stack([Block(16), Block(16)]), torch.nn.Linear(16, 8), Stack([Block(8), Block(8)]))
    else:
        model = Stack([Block(16) for _ in range(5)], skip=True)
    x = torch.randn(4, 16)
    with torch.no_grad():
        changed, notes = _notes(model, x)
        if case == "different_activation":
            assert not changed and any("differs from layer 0" in n for n in notes), notes
        elif case == "different_width":  # each homogeneous run folds on its own
            assert changed and sum(n.startswith("folded") for n in notes) == 2, notes
        else:
            assert not changed and any("layer other than the previous one" in n for n in notes), notes
        torch.testing.assert_close(_compile(model)(x), model(x), rtol=1e-5, atol=1e-5)


def test_layers_updating_their_buffers_stay_unrolled_without_a_failed_compile():
    """BatchNorm layers in training update their running statistics in place, which a scan body
    cannot do to its per-layer inputs: the pass leaves them unrolled with a note saying why (no
    compile of a folded graph that fails and warns). Outputs, running statistics and gradients
    match eager (fp32: rtol 1e-4, atol 1e-5; statistics atol 1e-6); in eval mode they fold."""
    import warnings

    torch.manual_seed(0)
    model = Stack([NormBlock(16) for _ in range(4)]).train()
    twin = copy.deepcopy(model)
    x = torch.randn(8, 16)
    changed, notes = _notes(copy.deepcopy(model), x)
    assert not changed and any("updates its own input" in n and "in place" in n for n in notes), notes
    folds = _folds()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "failed to compile ... without them"
        compiled = _compile(twin)
        got = compiled(x)
    assert _folds() == folds
    expected = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    got.sum().backward()
    expected.sum().backward()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=n)
    for (n, a), b in zip(model.named_buffers(), twin.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=n)
    model.eval(), twin.eval()
    with torch.no_grad():
        changed, notes = _notes(copy.deepcopy(model), x)
        assert changed, notes
        torch.testing.assert_close(_compile(twin)(x), model(x), rtol=1e-4, atol=1e-5)


class ScaleDrop(torch.nn.Module):
    def __init__(self, width, p):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(width) + 0.5)
        self.drop = torch.nn.Dropout(p)

    def forward(self, x):
        return self.drop(x * self.w)


def test_dropout_in_training_folds_and_backward_uses_the_forward_masks():
    """out = x * prod_k(w_k * mask_k / keep): the gradient w.r.t. x is that product, so
    x * grad == out exactly when the backward reuses the forward's masks (redrawn masks would
    put zeros elsewhere). Each layer draws its own mask: the keep rate of the product is
    keep**layers, not keep."""
    torch.manual_seed(0)
    layers, p = 3, 0.3
    model = Stack([ScaleDrop(4096, p) for _ in range(layers)]).train()
    x = torch.randn(8, 4096).abs() + 0.1
    x.requires_grad_(True)
    changed, notes = _notes(model, x)
    assert changed, notes
    before = _folds()
    out = _compile(model)(x)
    out.sum().backward()
    assert _folds() == before + 1
    torch.testing.assert_close(x.detach() * x.grad, out.detach(), rtol=1e-5, atol=1e-6)
    kept = (out != 0).float().mean().item()
    assert abs(kept - (1 - p) ** layers) < 0.01, kept
    assert all(b.w.grad is not None and b.w.grad.abs().sum() > 0 for b in model.blocks)


def test_mlp_stack_folds_and_trains_like_eager():
    torch.manual_seed(0)
    model = Stack([Block(32) for _ in range(8)])
    twin = copy.deepcopy(model)
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = _compile(twin)
    before = _folds()
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        for m, f, opt in ((model, model, opt_a), (twin, compiled, opt_b)):
            opt.zero_grad()
            f(x).pow(2).mean().backward()
            opt.step()
    assert _folds() == before + 1  # compiled once (first step), folded
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


def test_folded_graph_keeps_weights_resident_and_stacks_them_once():
    """The folded graph still tells AOTAutograd which inputs are parameters: they stay
    resident, the per-layer weights (read only by their stack) never reach the executable,
    and the stacks are built once, then again only after a weight changes."""
    from fx2xla.metrics import live_graphs

    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=3, hidden=64)).eval()
    ids = token_ids(1, 16)
    compiled = _compile(model)
    older = set(live_graphs)  # graphs of earlier tests may still be alive
    with torch.no_grad():
        compiled(ids)
        graph, = [g for g in live_graphs if g not in older and g.static is not None and g.static.lowered.input_concats]
        executor = graph.executor
        stacks = executor.cached_stacks()
        # Parameters resident; the layers' weights only checked for changes, never passed.
        assert any(step.slot >= 0 for step in executor.import_steps) and executor.check_steps
        passed = {step.position for step in executor.import_steps}
        assert all(i not in passed for group in stacks for i in group)
        compiled(ids)
        assert all(executor.cached_stacks()[k] is v for k, v in stacks.items())  # not rebuilt
        w = model.model.transformer.h[1].mlp.c_fc.weight
        w.mul_(0.5)  # a weight update renews the stacks
        got = compiled(ids)
    assert any(executor.cached_stacks()[k] is not v for k, v in stacks.items())
    with torch.no_grad():
        torch.testing.assert_close(got, model(ids), rtol=1e-4, atol=1e-4)
