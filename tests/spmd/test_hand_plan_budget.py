"""Auto-sharding at a hand plan's own memory (issue 25): language models whose weights outweigh
their activations (GPT-2 and LLaMA shapes: hidden 256, vocab 4000, 2 layers, batch 8 x 16) on a
mesh of 8. The hand Megatron plan (`shard_module`) is compiled and its peak per device read
(XLA's memory analysis, as `explain_sharding` prints it); then `sharding="auto"` with no hints
and `memory_budget` = that peak (k = 1.0) must compile a plan whose compiled peak is within it,
with outputs equal to eager (float32 tolerances). Two hand plans per model: the blocks only
(embeddings replicated), and the blocks with vocab-parallel embeddings (the weights split 8
ways: activations are then most of what differs between plans, and the solver's estimate of
them is off by a few percent either way, so XLA's measure has to decide).

Where nothing fits, `InfeasibleBudget` states the least compiled peak of a real plan, and a
compile at that figure takes that plan."""
from __future__ import annotations

import copy
import re

import pytest
import torch

import fx2xla
from fx2xla.metrics import live_graphs
from fx2xla.passes.auto_sharding import InfeasibleBudget
from fx2xla.runtime.executor import peak_bytes
from fx2xla.sharding import graphs_of
from tests.conftest import tolerance

BLOCKS = {
    "gpt2": {"*.attn.c_attn.weight": (None, "model"), "*.attn.c_attn.bias": ("model",),
             "*.attn.c_proj.weight": ("model", None), "*.mlp.c_fc.weight": (None, "model"),
             "*.mlp.c_fc.bias": ("model",), "*.mlp.c_proj.weight": ("model", None)},
    "llama": {"*.q_proj.weight": ("model", None), "*.k_proj.weight": ("model", None),
              "*.v_proj.weight": ("model", None), "*.o_proj.weight": (None, "model"),
              "*.gate_proj.weight": ("model", None), "*.up_proj.weight": ("model", None),
              "*.down_proj.weight": (None, "model")},
}
VOCAB = {"gpt2": {"*.wte.weight": ("model", None)},  # tied with the LM head: logits split by vocab
         "llama": {"*.embed_tokens.weight": ("model", None), "*lm_head.weight": ("model", None)}}


def build(name: str):
    from fx2xla.testing import LogitsOnly, gpt2, llama

    torch.manual_seed(0)
    make = gpt2 if name == "gpt2" else llama
    return LogitsOnly(make(layers=2, hidden=256, vocab=4000)).eval()


def ids():
    from fx2xla.testing import token_ids

    return token_ids(8, 16, vocab=4000)


def compiled_peak(compiled) -> tuple:
    """(the one graph of a compiled inference module, its peak per device by XLA's memory
    analysis: arguments + outputs not written in place + temporaries)."""
    (g,) = graphs_of(compiled)
    return g, peak_bytes(g.static.exe.get_compiled_memory_stats())


def hand_peak(base, name: str, vocab: bool, mesh) -> int:
    model = copy.deepcopy(base)
    fx2xla.shard_module(model, mesh, {**BLOCKS[name], **(VOCAB[name] if vocab else {})})
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        compiled(ids())
    g, peak = compiled_peak(compiled)
    stats = g.static.exe.get_compiled_memory_stats()
    assert peak == stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    assert "memory per device" in fx2xla.explain_sharding(compiled)
    weights = sum(p.numel() * 4 for p in base.parameters())
    assert weights > 4 * (peak - stats.argument_size_in_bytes)  # weights >> activations
    return peak


@pytest.mark.parametrize("vocab", [False, True], ids=["blocks", "vocab_parallel"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_auto_fits_the_hand_plans_own_peak(name, vocab):
    mesh = fx2xla.Mesh((8,), ("model",))
    base, x = build(name), ids()
    with torch.no_grad():
        expected = base(x)
    budget = hand_peak(base, name, vocab, mesh)
    torch._dynamo.reset()
    auto = torch.compile(copy.deepcopy(base), backend="fx2xla",
                         options={"sharding": "auto", "mesh": mesh, "memory_budget": budget})
    with torch.no_grad():
        out = auto(x)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    g, peak = compiled_peak(auto)
    assert peak <= budget
    assert g.auto_sharding.xla_peak_bytes == peak
    assert "compiled peak" in fx2xla.explain_sharding(auto)


def test_the_least_figure_of_an_infeasible_budget_is_a_real_plans_compiled_peak(monkeypatch):
    """Under 80% of the hand plan's peak nothing fits: the error says so after measuring the
    least-memory plan (and any near the budget), and gives the least compiled peak of the plans
    measured. At that figure the graph compiles (that plan), within it, equal to eager."""
    import fx2xla.backend as backend

    monkeypatch.setattr(backend, "measured_plans", {})  # only this test's measurements
    mesh = fx2xla.Mesh((8,), ("model",))
    base, x = build("llama"), ids()
    with torch.no_grad():
        expected = base(x)
    budget = int(0.8 * hand_peak(base, "llama", True, mesh))
    torch._dynamo.reset()
    before = {id(g) for g in live_graphs}
    with pytest.raises(InfeasibleBudget, match=r"least compiled peak of the plans measured is ([\d,]+) bytes") as err:
        with torch.no_grad():
            torch.compile(copy.deepcopy(base), backend="fx2xla",
                          options={"sharding": "auto", "mesh": mesh, "memory_budget": budget})(x)
    assert not [g for g in live_graphs if id(g) not in before]  # every refused plan left the reports
    text = str(err.value)
    least = int(re.search(r"least compiled peak of the plans measured is ([\d,]+) bytes", text).group(1).replace(",", ""))
    assert err.value.least_compiled == least > budget
    assert f"memory_budget={budget:,.0f}" in text and "XLA's memory analysis gave" in text
    # The solver's own figure is said to be its estimate.
    assert "the least any plan holds by the estimate" in text
    torch._dynamo.reset()
    auto = torch.compile(copy.deepcopy(base), backend="fx2xla",
                         options={"sharding": "auto", "mesh": mesh, "memory_budget": least})
    with torch.no_grad():
        out = auto(x)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    _, peak = compiled_peak(auto)
    assert peak <= least


def test_a_vocab_split_embedding_is_looked_up_where_it_lies():
    """Megatron's vocab-parallel embedding is one of the solver's strategies: with the table
    split by rows (a user annotation, a constraint), the lookup runs on each device's rows and
    the partial results are all-reduced (2 (n-1)/n of the [8, 16, 64] float32 output moved per
    device), rather than the table gathered or moved (an all-to-all holding a second copy). The
    outputs equal eager's exactly (each row is one device's, plus zeros)."""
    from fx2xla.passes.auto_sharding import CostModel, strategies_of
    from fx2xla.runtime.executor import optimized_hlo_text
    from fx2xla.sharding import collectives

    class Lookup(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(4000, 64)

        def forward(self, ids):
            return self.table(ids)

    torch.manual_seed(0)
    model, x = Lookup(), ids()
    with torch.no_grad():
        expected = model(x)
    mesh = fx2xla.Mesh((8,), ("x",))
    fx2xla.mark_sharding(model.table.weight, mesh, ("x", None))
    compiled = torch.compile(model, backend="fx2xla", options={"sharding": "auto", "mesh": mesh})
    with torch.no_grad():
        out = compiled(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (g,) = graphs_of(compiled)
    node = next(n for n in g.gm.graph.nodes if n.target is torch.ops.aten.embedding.default)
    split = [st for st in strategies_of(node, {"x": 8}, CostModel()) if st.needs[0] == (("x",), ())]
    assert split and all(st.out[-1] == () for st in split) and all(st.moved > 0 for st in split)
    sol = g.auto_sharding
    assert sol.collective_bytes == pytest.approx(2 * 8 * 16 * 64 * 4 * 7 / 8)
    found = [(c.op, c.type) for c in collectives(optimized_hlo_text(g.static.exe)) if c.type != "pred[]"]
    assert [op for op, _ in found] == ["all-reduce"]


def _moved(g) -> float:
    from fx2xla.runtime.executor import optimized_hlo_text
    from fx2xla.sharding import collectives

    return sum(c.moved for c in collectives(optimized_hlo_text(g.static.exe)))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)], ids=["1d", "2d"])
@pytest.mark.parametrize("vocab", [False, True], ids=["blocks", "vocab_parallel"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_sweep_of_budgets_near_the_hand_plans_peak(name, vocab, mesh_shape):
    """k x the hand plan's peak for k = 1.05, 1.03, 1.0, on a 1-D mesh ("model") and a 2 x 4
    mesh (the batch over "data" in the hand plan): every auto plan fits its budget by XLA's
    measure and equals eager; at 1.05 it moves at most the hand plan's bytes per device (ring
    traffic of the collectives in the optimized HLO)."""
    mesh = fx2xla.Mesh(mesh_shape, ("model",) if len(mesh_shape) == 1 else ("data", "model"))
    base, x = build(name), ids()
    with torch.no_grad():
        expected = base(x)
    model, xh = copy.deepcopy(base), x.clone()
    fx2xla.shard_module(model, mesh, {**BLOCKS[name], **(VOCAB[name] if vocab else {})})
    if len(mesh_shape) == 2:
        fx2xla.mark_sharding(xh, mesh, ("data", None))
    hand = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        hand(xh)
    hand_graph, peak = compiled_peak(hand)
    for k in (1.05, 1.03, 1.0):
        torch._dynamo.reset()
        auto = torch.compile(copy.deepcopy(base), backend="fx2xla",
                             options={"sharding": "auto", "mesh": mesh, "memory_budget": k * peak})
        with torch.no_grad():
            out = auto(x)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))
        g, auto_peak = compiled_peak(auto)
        assert auto_peak <= k * peak, k
        if k == 1.05:
            assert _moved(g) <= _moved(hand_graph)


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [False, True], ids=["blocks", "vocab_parallel"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_training_steps_at_the_hand_plans_step_peak(name, vocab):
    """A training step (forward, cross-entropy, backward, AdamW step compiled with plain fx2xla),
    budget: the hand plan's forward peak plus its gradients and two AdamW moments per device (as
    bench/autoshard.py takes it); dropout off. The auto forward's step peak fits it; two steps' losses equal
    eager's (float32 tolerances)."""
    import torch.nn.functional as F

    from fx2xla.sharding import per_device_bytes

    mesh = fx2xla.Mesh((8,), ("model",))
    base, x = build(name), ids()
    for m in base.modules():  # losses comparable with eager's
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    y = x.roll(-1, dims=1)

    def train(model, options):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        fwd = torch.compile(model, backend="fx2xla", options=options) if options != "eager" else model
        step = torch.compile(opt.step, backend="fx2xla") if options != "eager" else opt.step
        losses = []
        for _ in range(2):
            out = fwd(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        return torch.stack(losses), fwd

    eager, _ = train(copy.deepcopy(base).train(), "eager")
    hand_model = copy.deepcopy(base).train()
    fx2xla.shard_module(hand_model, mesh, {**BLOCKS[name], **(VOCAB[name] if vocab else {})})
    _, hand = train(hand_model, None)
    fw = next(g for g in graphs_of(hand) if g.name.endswith("forward"))
    params = sum(per_device_bytes(tuple(p.shape), getattr(p, "_fx2xla_sharding").spec if hasattr(p, "_fx2xla_sharding")
                             else ((),) * p.dim(), mesh) * p.element_size() for p in hand_model.parameters())
    budget = peak_bytes(fw.static.exe.get_compiled_memory_stats()) + 3 * params
    torch._dynamo.reset()
    losses, auto = train(copy.deepcopy(base).train(),
                         {"sharding": "auto", "mesh": mesh, "memory_budget": budget})
    torch.testing.assert_close(losses, eager, **tolerance(torch.float32))
    fw = next(g for g in graphs_of(auto) if g.name.endswith("forward"))
    assert fw.auto_sharding.xla_peak_bytes <= budget


def test_a_constraint_on_an_input_is_not_counted_as_a_copy():
    """An annotated parameter reaches the solver as a sharding constraint right after its
    placeholder (the sharding_annotations pass). The constraint holds no memory of its own: the
    estimate of the peak is the same as with the input's spec fixed and no constraint (counted
    as a value, it held every annotated weight twice, from the start to its last reader)."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fx2xla.passes.auto_sharding import solve
    from fx2xla.sharding import encode_spec

    mesh = fx2xla.Mesh((8,), ("d",))
    column = (("d",), ())

    def constrained(x, w1, w2):
        w1 = torch.ops.fx2xla.mark_sharding(w1, mesh.id, encode_spec(column))
        return F.gelu(x @ w1.t()) @ w2.t()

    def plain(x, w1, w2):
        return F.gelu(x @ w1.t()) @ w2.t()

    shapes = [(64, 256), (1024, 256), (256, 1024)]
    graphs = []
    for f in (constrained, plain):
        with FakeTensorMode() as mode:
            graphs.append(make_fx(f)(*[mode.from_tensor(torch.empty(s)) for s in shapes]))
    fixed = [None, column, None]
    with_mark, without = (solve(gm, {"d": 8}, parameters={1, 2}, fixed=fixed) for gm in graphs)
    assert with_mark.memory_bytes == without.memory_bytes
    assert with_mark.input_specs == without.input_specs


@pytest.mark.parametrize("name,vocab", [("gpt2", False), ("llama", False), ("gpt2", True)],
                         ids=["gpt2-blocks", "llama-blocks", "gpt2-vocab_parallel"])
def test_the_same_module_compiled_again_is_solved_afresh(name, vocab):
    """One model object compiled with sharding="auto" at 1.05, 1.03 and 1.0 x the hand plan's
    peak (torch._dynamo.reset() between): an earlier solve's marks on its parameters (kept for
    the optimizer step) are not constraints of the next, so each budget gets its own plan, within
    it, equal to eager; the parameters end marked with the last plan. (Before: the 1.05 plan's
    marks were pinned as constraints at 1.03, each counted as a second copy of its weight, and
    the budget was refused with "the least any plan holds is about 14,020,864 bytes" for GPT-2,
    20,842,752 for LLaMA, twice what the 1.05 plan compiles to.)"""
    mesh = fx2xla.Mesh((8,), ("model",))
    base, x = build(name), ids()
    with torch.no_grad():
        expected = base(x)
    peak = hand_peak(base, name, vocab, mesh)
    model = copy.deepcopy(base)
    for k in (1.05, 1.03, 1.0):
        torch._dynamo.reset()
        auto = torch.compile(model, backend="fx2xla",
                             options={"sharding": "auto", "mesh": mesh, "memory_budget": k * peak})
        with torch.no_grad():
            out = auto(x)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))
        g, auto_peak = compiled_peak(auto)
        assert auto_peak <= k * peak, k
        assert not [n for n in g.gm.graph.nodes if n.target is torch.ops.fx2xla.mark_sharding.default]
    last = {n: s for n, s in zip(g.input_names, g.auto_sharding.input_specs) if s is not None}
    marked = {n: (p._fx2xla_sharding.spec, p._fx2xla_sharding.source) for n, p in model.named_parameters()
              if hasattr(p, "_fx2xla_sharding")}
    assert marked and all(marked[n] == (last[n], "auto") for n in marked)
