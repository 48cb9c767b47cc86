"""Lowering returns its index-check records as data: the traced function hands back a
CheckVerdict (a jax pytree: the int32 code its one child, the records its static aux data), and
lower_graph reads the records from the traced output's tree. Nothing is collected on the side,
so lowering a graph again, or jax tracing it more than once, gives the same records, never more.
"""
import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fx2xla
from fx2xla.lowering.checks import CheckRecord, CheckVerdict, RuntimeChecks
from fx2xla.lowering.graph import lower_graph
from fx2xla.metrics import live_graphs
from fx2xla.plan import build_plan
from fx2xla.runtime import Device

W = torch.randn(10, 3)


def _lowered(fn, *specs, **options):
    """`fn` traced on FakeTensors (specs: (shape, dtype)), planned and lowered for the CPU."""
    with FakeTensorMode():
        fakes = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
    gm = make_fx(torch.func.functionalize(fn))(*fakes)
    return lower_graph(gm, build_plan(gm, fakes, Device("cpu", 0)), fakes, **options)


def _two_index_ops(w, ids, x, rows):
    return F.embedding(ids, w), x.index_select(0, rows)


TWO_SPECS = [((10, 3), torch.float32), ((2,), torch.int64), ((5, 3), torch.float32), ((1,), torch.int64)]
EXPECTED_HEADS = [
    "fx2xla: aten.embedding.default: embedding index out of range: every embedding index must lie in [0, 10) (size 10)",
    "fx2xla: aten.index_select.default: index out of range: every index must lie in [0, 5) for dimension 0 of size 5",
]


def _heads(records):
    return [r.message.splitlines()[0] for r in records]


def _verdict_fn(n_checks):
    """A traced function recording `n_checks` checks (the k-th fails when x[k] < 0)."""
    def f(x):
        checks = RuntimeChecks()
        for k in range(n_checks):
            checks.add(CheckRecord(f"check {k}"), x[k] < 0)
        return x * 2, checks.verdict()
    return f


def test_verdict_is_a_pytree_whose_records_are_static():
    x = jax.ShapeDtypeStruct((3,), jnp.float32)
    jitted = jax.jit(_verdict_fn(2))
    first, again = jitted.trace(x), jitted.trace(x)  # the second from jax's cache
    for traced in (first, again):
        _, verdict = traced.out_info
        assert isinstance(verdict, CheckVerdict)
        assert verdict.records == (CheckRecord("check 0"), CheckRecord("check 1"))
        assert [o.shape for o in jax.tree.leaves(traced.out_info)] == [(3,), ()]  # the code last
    # Run, the verdict comes back with its code (1 + the first failed check) and its records.
    y, verdict = jitted(jnp.array([1.0, -1.0, -2.0]))
    assert int(verdict.code) == 2 and verdict.records[1].message == "check 1"
    assert int(jitted(jnp.ones(3))[1].code) == 0
    # No check recorded: an empty verdict, no result at all.
    _, empty = jax.jit(_verdict_fn(0)).trace(x).out_info
    assert empty == CheckVerdict() and jax.tree.leaves(empty) == []


def test_verdict_takes_a_sharding_prefix():
    """spmd_shardings' out_shardings=(outs, replicated): one sharding for the whole verdict."""
    mesh = jax.sharding.Mesh(jax.devices("cpu")[:2], ("d",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    for n in (2, 0):
        traced = jax.jit(_verdict_fn(n), out_shardings=(replicated, replicated)).trace(
            jax.ShapeDtypeStruct((4,), jnp.float32))
        assert len(traced.out_info[1].records) == n
        assert "stablehlo" in traced.lower().as_text()


def test_two_index_ops_give_two_records_in_graph_order():
    lowered = _lowered(_two_index_ops, *TWO_SPECS)
    assert _heads(lowered.checks) == EXPECTED_HEADS
    assert all("inputs:" in r.message and "check_indices" in r.message for r in lowered.checks)
    assert lowered.result_shapes == [(2, 3), (1, 3), ()]  # the verdict's code last


def test_lowering_again_gives_equal_records_not_more():
    first, second = _lowered(_two_index_ops, *TWO_SPECS), _lowered(_two_index_ops, *TWO_SPECS)
    assert first.checks == second.checks and len(second.checks) == 2
    assert first.module_text == second.module_text


def test_records_survive_a_jax_retrace(monkeypatch):
    """jax may trace a function more than once (or not at all, from its cache): the records are
    those of the output tree jax keeps, whatever number of traces ran."""
    real_jit, traces = jax.jit, []

    def retracing_jit(fun, **kwargs):
        def counted(*args):
            traces.append(1)
            return fun(*args)
        jitted = real_jit(counted, **kwargs)

        class Retraced:
            def trace(self, *avals):
                jax.make_jaxpr(lambda *args: counted(*args))(*avals)  # a trace of its own
                jitted.trace(*avals)
                return jitted.trace(*avals)  # found in jax's cache: the function does not run
        return Retraced()

    expected = _lowered(_two_index_ops, *TWO_SPECS).checks
    monkeypatch.setattr(jax, "jit", retracing_jit)
    lowered = _lowered(_two_index_ops, *TWO_SPECS)
    assert len(traces) == 2
    assert lowered.checks == expected and _heads(lowered.checks) == EXPECTED_HEADS


def test_no_index_op_no_record_no_result():
    lowered = _lowered(lambda x: x * 2 + 1, ((3,), torch.float32))
    assert lowered.checks == () and lowered.result_shapes == [(3,)]
    off = _lowered(_two_index_ops, *TWO_SPECS, check_indices=False)
    assert off.checks == () and off.result_shapes == [(2, 3), (1, 3)]


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})


def _new_graphs(older):
    return [g for g in live_graphs if g not in older]


def test_records_of_a_scanned_body_and_the_graph_compiled_twice():
    """A check inside a scan body and one outside it: two records, body's op and graph's op, the
    same ones for a second compilation of the function."""
    table = torch.randn(6, 4)

    def run(ids, tok):
        def body(carry, i):
            return carry + table[i][0], carry.sum()
        carry, ys = fx2xla.scan(body, torch.zeros(4), ids)
        return carry + F.embedding(tok, W)[0, 0], ys

    good = (torch.tensor([[0], [5], [-6]]), torch.tensor([9]))
    expected = run(*good)
    heads = []
    for _ in range(2):
        older = set(live_graphs)
        torch.testing.assert_close(_compiled(run)(*good), expected, rtol=1e-6, atol=1e-6)
        (graph,) = _new_graphs(older)
        heads.append(_heads(graph.static.checks))
    assert heads[0] == heads[1] and len(heads[0]) == 2
    assert "aten.index.Tensor" in heads[0][0] and "aten.embedding.default" in heads[0][1]


def test_out_of_range_embedding_raises_naming_the_op():
    def embed(ids):
        return F.embedding(ids, W)

    compiled = _compiled(embed)
    ok = torch.tensor([[0, 9], [3, 3]])
    torch.testing.assert_close(compiled(ok), embed(ok), rtol=0, atol=0)  # a gather: exact
    with pytest.raises(IndexError):
        embed(torch.tensor([1, 12]))
    with pytest.raises(fx2xla.IndexOutOfRangeError) as info:
        compiled(torch.tensor([1, 12]))
    msg = str(info.value)
    assert "aten.embedding" in msg and "out of range" in msg and "test_check_records.py" in msg
