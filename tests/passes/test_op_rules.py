"""The table of per-op sharding rules (passes/op_rules.py) that propagation and auto-sharding
both read: which ops have which direction, and that both passes dispatch through it."""
from __future__ import annotations

import operator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fx2xla.passes import op_rules
from fx2xla.passes.auto_sharding import CostModel, strategies_of
from fx2xla.passes.op_rules import POINTWISE, PROPAGATION_ONLY, RULES, STRATEGIES_ONLY, OpRule, rule_of
from fx2xla.passes.spec_rules import is_pointwise

aten = torch.ops.aten


def test_every_entry_has_a_direction():
    assert all(isinstance(r, OpRule) and (r.propagate or r.strategies) for r in RULES.values())
    assert POINTWISE.propagate is not None and POINTWISE.strategies is not None


def test_ops_with_one_direction_are_the_listed_ones():
    """An op given only one direction must be named in PROPAGATION_ONLY or STRATEGIES_ONLY
    (and the module doc says why): a new rule cannot silently serve one pass only."""
    assert {op for op, r in RULES.items() if r.strategies is None} == PROPAGATION_ONLY
    assert {op for op, r in RULES.items() if r.propagate is None} == STRATEGIES_ONLY
    assert not PROPAGATION_ONLY & STRATEGIES_ONLY


def test_an_entry_of_its_own_overrides_the_pointwise_family_only_for_copy_():
    """An op tagged pointwise with an entry of its own is served by that entry, not the family:
    only copy_, which keeps one layout for its written input."""
    assert {op for op in RULES if is_pointwise(op)} == {aten.copy_.default}
    assert rule_of(aten.copy_.default) is RULES[aten.copy_.default]
    assert rule_of(aten.add.Tensor) is POINTWISE
    assert rule_of(aten.mm.default) is RULES[aten.mm.default]
    assert rule_of(operator.getitem) is RULES[operator.getitem]
    assert rule_of(aten.sort.default) is None


def test_both_passes_read_the_table(monkeypatch):
    """A rule replaced in the table is what propagation and the solver see."""
    from fx2xla.passes.sharding import propagate
    from fx2xla.sharding import Annotation, Mesh

    with FakeTensorMode() as mode:
        gm = make_fx(lambda x: torch.cumsum(x, 0))(mode.from_tensor(torch.empty(8, 4)))
    node = next(n for n in gm.graph.nodes if n.target is aten.cumsum.default)
    mesh = Mesh((2,), ("d",))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")

    def propagated():
        return propagate(gm, [Annotation(mesh.id, (("d",), ()))], mesh.id).spec(node)

    def strategies():
        return [st.out for st in strategies_of(node, {"d": 2}, CostModel())]

    assert propagated() == ((), ())  # the dim it runs along whole
    assert strategies() == [((), ())]  # no strategies: whole
    monkeypatch.setitem(RULES, aten.cumsum.default, OpRule(
        lambda n, specs: specs[x], lambda n, sizes, model: [op_rules.Strategy((("d",), ()), [(("d",), ())])]))
    assert propagated() == (("d",), ())
    assert strategies() == [(("d",), ())]
