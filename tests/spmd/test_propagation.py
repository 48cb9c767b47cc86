"""The sharding propagation pass (passes/sharding.py) on core-ATen graphs, without compiling:
each rule's spec, the backward fill into unannotated inputs, and the sources it records."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fx2xla
from fx2xla.passes.sharding import propagate
from fx2xla.passes.spec_rules import fit_spec, reshape_spec
from fx2xla.sharding import Annotation

aten = torch.ops.aten
SIZES = {"data": 2, "model": 4}


def traced(fn, *shapes):
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(torch.empty(s)) for s in shapes]
        return make_fx(fn, pre_dispatch=False)(*args)


def specs_of(gm, annotations):
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    anns = [None if a is None else Annotation(mesh.id, a) for a in annotations]
    result = propagate(gm, anns, mesh.id)
    return {n.name: (result.spec(n), result.source(n)) for n in gm.graph.nodes if n.op != "output"}, result


def test_fit_drops_axes_that_do_not_divide_or_repeat():
    assert fit_spec((("model",), ()), (8, 3), SIZES) == (("model",), ())
    assert fit_spec((("model",), ()), (6, 3), SIZES) == ((), ())  # 6 % 4
    assert fit_spec((("data", "model"),), (16,), SIZES) == (("data", "model"),)
    assert fit_spec((("data",), ("data",)), (4, 4), SIZES) == (("data",), ())


def test_reshape_keeps_leading_axes_through_splits_and_merges():
    assert reshape_spec((("data",), (), ("model",)), (4, 6, 8), (4, 6, 2, 4)) == (("data",), (), ("model",), ())
    assert reshape_spec((("data",), ()), (4, 6), (24,)) == (("data",),)
    assert reshape_spec(((), ("model",)), (4, 8), (32,)) == ((),)  # a minor dim's shards are not one block


def test_matmul_chain_and_reduction():
    def f(x, w1, w2):
        h = torch.relu(x @ w1)
        return (h @ w2).sum(0)

    gm = traced(f, (8, 16), (16, 32), (32, 16))
    specs, _ = specs_of(gm, [(("data",), ()), ((), ("model",)), (("model",), ())])
    mms = [k for k in specs if k.startswith("mm")]
    assert specs[mms[0]] == ((("data",), ("model",)), "propagated")
    assert specs["relu"][0] == (("data",), ("model",))
    assert specs[mms[1]][0] == (("data",), ())  # contracted over model: a partial sum, then rows
    assert specs["sum_1"][0] == ((),)


def test_backward_fill_reaches_an_unannotated_state():
    """An optimizer-like update: the state is read only by the update of a sharded parameter."""
    def f(p, g, m):
        m2 = m * 0.9 + g * 0.1
        return p - 0.01 * m2, m2

    gm = traced(f, (8, 4), (8, 4), (8, 4))
    specs, result = specs_of(gm, [(("model",), ()), None, None])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [result.spec(n) for n in placeholders] == [(("model",), ())] * 3
    assert [result.source(n) for n in placeholders] == ["user", "propagated", "propagated"]


def test_unknown_ops_default_to_replicated():
    def f(x):
        return torch.flip(x, [0])

    gm = traced(f, (8, 4))
    specs, _ = specs_of(gm, [(("data",), ())])
    flip = next(k for k in specs if k.startswith("flip"))
    assert specs[flip] == (((), ()), "default")
