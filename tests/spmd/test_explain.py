"""`fx2xla.explain_sharding` takes what the user holds: what `torch.compile(...,
backend="fx2xla")` returned (a compiled module: its forward and backward graphs; a compiled
function; a compiled optimizer step), once it has run, each graph named with what it is and of
what; a CompiledGraph, a list, or None (every live sharded graph) as before. Anything else is a
TypeError; a compiled thing that has not run yet a ValueError saying to call it once first."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fx2xla
from fx2xla.metrics import live_graphs

MEGATRON = {"0.weight": ("d", None), "0.bias": ("d",), "2.weight": (None, "d")}


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def headers(report: str) -> list[str]:
    """Per graph in the report: "<name> (<what it is>)"."""
    return [m.group(1) for m in re.finditer(r"^graph (\S+ \([^)]*\)+)", report, re.M)]


def test_a_training_step_by_its_compiled_module_and_optimizer_step():
    mesh = fx2xla.Mesh((8,), ("d",))
    model = mlp()
    fx2xla.shard_module(model, mesh, MEGATRON)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    compiled, step = torch.compile(model, backend="fx2xla"), torch.compile(opt.step, backend="fx2xla")
    with pytest.raises(ValueError, match="no fx2xla graphs yet: call it once first"):
        fx2xla.explain_sharding(compiled)
    F.mse_loss(compiled(torch.randn(16, 32)), torch.zeros(16, 32)).backward()
    step()
    report = fx2xla.explain_sharding(compiled)
    names = headers(report)
    assert len(names) == 2
    assert re.fullmatch(r"g\S+_forward \(forward of Sequential\)", names[0])
    assert re.fullmatch(r"g\S+_backward \(backward of Sequential\)", names[1])
    assert "('d', None)" in report and "memory per device" in report and "0.weight" in report
    (opt_graph,) = headers(fx2xla.explain_sharding(step))
    assert re.fullmatch(r"g\S+_inference \(optimizer step \(AdamW\.step\)\)", opt_graph)
    # Both at once, and every live sharded graph (None) names the same three.
    assert headers(fx2xla.explain_sharding([compiled, step])) == names + [opt_graph]
    everything = headers(fx2xla.explain_sharding())
    assert all(h in everything for h in names + [opt_graph])


def test_a_compiled_function_and_graph_objects():
    mesh = fx2xla.Mesh((8,), ("d",))

    @torch.compile(backend="fx2xla")
    def f(a, w):
        return torch.relu(a @ w)

    with pytest.raises(ValueError, match="call it once first"):
        fx2xla.explain_sharding(f)
    a = fx2xla.mark_sharding(torch.randn(16, 8), mesh, ("d", None))
    before = {id(g) for g in live_graphs}
    with torch.no_grad():
        f(a, torch.randn(8, 8))
    (g,) = [g for g in live_graphs if id(g) not in before]
    report = fx2xla.explain_sharding(f)
    assert headers(report) == [f"{g.name} (inference of {f._torchdynamo_orig_callable.__qualname__})"]
    assert "('d', None)" in report
    # A CompiledGraph, and a list of them, as before.
    assert fx2xla.explain_sharding(g) == report == fx2xla.explain_sharding([g])


def test_the_graphs_of_one_compiled_object_only():
    """Two compiled copies of one model, the second after torch._dynamo.reset(), which repeats
    the graphs' names: each reports its own graph (the first's kept alive here). A compiled
    object whose graphs are gone says so."""
    mesh = fx2xla.Mesh((8,), ("d",))
    x = torch.randn(16, 32)
    outs, kept = [], []
    for _ in range(2):
        torch._dynamo.reset()
        model = mlp()
        fx2xla.shard_module(model, mesh, MEGATRON)
        compiled = torch.compile(model, backend="fx2xla")
        with torch.no_grad():
            compiled(x)
        outs.append(compiled)
        kept += fx2xla.sharding.graphs_of(compiled)
    first, second = (fx2xla.sharding.graphs_of(c) for c in outs)
    assert first == kept[:1] and second == kept[1:] and first[0].name == second[0].name
    kept.clear()
    first.clear()
    torch._dynamo.reset()
    import gc

    gc.collect()
    with pytest.raises(ValueError, match="graphs are gone"):
        fx2xla.explain_sharding(outs[0])


def test_what_is_not_a_compiled_thing_is_refused():
    for bad in (mlp(), 3, lambda: 1, [mlp()]):
        with pytest.raises(TypeError, match="expected what torch.compile"):
            fx2xla.explain_sharding(bad)
