"""fx2xla.scan_layers(model): marking a model's stacks of identical layers, without changing its
code, so that Dynamo traces one layer once per stack and scan-folding makes the stack one loop.

Tolerances (float32): outputs 1e-4 rel / 1e-4 abs against eager, gradients 1e-4 rel / 1e-5 abs
(the same per-layer math; XLA fuses differently from eager). Eager calls of a marked model are
bitwise equal to the unmarked model's (the same forward runs)."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

import fx2xla
from fx2xla.testing import LogitsOnly, NormBlock, gpt2, llama, token_ids

scan_module = importlib.import_module("fx2xla.scan")  # `fx2xla.scan` is the function


def _grads_match(model, twin):
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=n)


def _region_calls(gm: torch.fx.GraphModule):
    """(calls of invoke_subgraph, distinct bodies they call) in a Dynamo graph."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]
    return len(calls), len({n.args[0].target for n in calls})


@pytest.mark.parametrize("make", [gpt2, llama], ids=["gpt2", "llama"])
def test_marked_model_traces_one_layer_and_folds(make):
    """8 identical transformer blocks, marked: Dynamo's graph calls one traced body 8 times, the
    stack folds into one loop, and the training step's logits and every gradient match eager;
    no op falls back to eager."""
    torch.manual_seed(0)
    model = LogitsOnly(make(layers=8, hidden=64)).eval()  # eval: no dropout
    twin = copy.deepcopy(model)
    assert fx2xla.scan_layers(twin) is twin
    blocks = [m for m in twin.modules() if scan_module.is_marked(m)]
    assert len(blocks) == 8 and len({type(b) for b in blocks}) == 1
    ids = token_ids(2, 16)
    expected = model(ids)
    expected.pow(2).mean().backward()

    seen = []

    def backend(gm, example_inputs):
        seen.append(_region_calls(gm))
        return torch._dynamo.backends.registry.lookup_backend("fx2xla")(gm, example_inputs)

    torch._dynamo.reset()
    before = fx2xla.metrics()
    got = torch.compile(twin, backend=backend)(ids)
    got.pow(2).mean().backward()
    after = fx2xla.metrics()
    assert seen == [(8, 1)], seen
    assert after["scan_folds"] - before["scan_folds"] >= 1
    assert after["fallback_ops"] == before["fallback_ops"]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    _grads_match(model, twin)


def test_marking_changes_no_eager_result_and_can_be_undone():
    """A marked model's eager call is bitwise the unmarked one's; marking twice is a no-op;
    `del layer.forward` unmarks a layer."""
    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=3, hidden=32)).eval()
    ids = token_ids(1, 8)
    with torch.no_grad():
        plain = model(ids)
        fx2xla.scan_layers(model)
        blocks = [m for m in model.modules() if scan_module.is_marked(m)]
        forwards = [b.forward for b in blocks]
        fx2xla.scan_layers(model)
        assert [b.forward for b in blocks] == forwards  # not wrapped twice
        assert torch.equal(model(ids), plain)
        for b in blocks:
            del b.forward
        assert not any(scan_module.is_marked(m) for m in model.modules())
        assert torch.equal(model(ids), plain)


class _Configured(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x, cfg: dict):
        return torch.tanh(self.lin(x)) * cfg["scale"]


def test_layers_owning_buffers_in_training_run_their_own_forward():
    """Identical layers with BatchNorm in training mode (running statistics: torch's regions
    cannot write buffers under autograd) run their own forward: outputs, running statistics and
    gradients match eager; in eval mode they are regions again and still match."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[NormBlock(16) for _ in range(4)]).train()
    twin = copy.deepcopy(model)
    fx2xla.scan_layers(twin)
    assert all(scan_module.is_marked(m) for m in twin)
    x = torch.randn(8, 16)
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="fx2xla")
    expected = model(x)
    expected.sum().backward()
    got = compiled(x)
    got.sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    for a, b in zip(model.modules(), twin.modules()):
        if isinstance(a, torch.nn.BatchNorm1d):
            torch.testing.assert_close(b.running_mean, a.running_mean, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(b.running_var, a.running_var, rtol=1e-4, atol=1e-6)
    _grads_match(model, twin)
    model.eval(), twin.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_call_with_other_arguments_runs_the_layer_itself():
    """A marked layer called with an argument that is not a tensor, number, string, None or a
    tuple/list of those (here a dict) runs its own forward under torch.compile: results equal
    eager's."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([_Configured(8) for _ in range(3)])

    def run(x):
        for layer in layers:
            x = layer(x, {"scale": 0.5})
        return x

    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = run(x)
        fx2xla.scan_layers(torch.nn.Sequential(layers))  # any module holding the stack
        assert all(scan_module.is_marked(m) for m in layers)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(run, backend="fx2xla")(x), expected, rtol=1e-4, atol=1e-5)


def test_what_is_left_alone_and_bad_calls():
    """Stacks of torch.nn's own modules, stacks of differing layers, a single layer and a
    forward set on the instance by the user are not marked; marking takes an nn.Module and no
    other argument, and not inside compiled code."""
    torch.manual_seed(0)
    own = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mixed = torch.nn.ModuleList([_Configured(4), _Configured(8)])
    single = torch.nn.ModuleList([_Configured(4)])
    users = torch.nn.ModuleList([_Configured(4), _Configured(4)])
    users[0].forward = lambda x, cfg: x
    root = torch.nn.ModuleDict({"own": own, "mixed": mixed, "single": single, "users": users})
    fx2xla.scan_layers(root)
    assert not any(scan_module.is_marked(m) for m in root.modules())
    with pytest.raises(TypeError, match="nn.Module"):
        fx2xla.scan_layers([_Configured(4), _Configured(4)])
    with pytest.raises(TypeError, match="takes no other arguments"):
        fx2xla.scan_layers(root, attention_mask=None)  # x forgotten: not a call on x

    def inside(x):
        fx2xla.scan_layers(root)
        return x + 1

    with pytest.raises(Exception, match="outside the compiled function"):
        torch.compile(inside, backend="fx2xla", fullgraph=True)(torch.randn(2))
