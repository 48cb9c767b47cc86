"""Graphs that write their inputs (optimizer steps, in-place ops on arguments): the new values
come out of the executable and are installed in the inputs. A tensor that alone owns a dense
storage gets the result's storage swapped in (no copy); views, aliased, strided or subclass
tensors get the data copied in. Either way the caller sees what eager would have written."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo

import fx2xla
from fx2xla import plan_executor
from fx2xla.metrics import live_graphs
from tests.conftest import tolerance


def _compiled(fn, **options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error", **options})


def _bump(x, y):
    x.add_(y)
    x.mul_(2)
    return x.sum() + y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_sole_owner_gets_the_new_storage(dtype):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(dtype).clone()  # owns its storage
    y = torch.ones(3, 4, dtype=dtype)
    ref_x = x.clone()
    expected = _bump(ref_x, y)
    f = _compiled(_bump)
    ptr, version, obj = x.data_ptr(), x._version, x
    out = f(x, y)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    torch.testing.assert_close(x, ref_x, **tolerance(dtype))
    assert x is obj and x.data_ptr() != ptr  # swapped, not copied
    assert x._version > version  # autograd and caches see the write


def test_0d_and_empty_inputs():
    def f(a, b):
        a.add_(1)
        b.mul_(3)
        return a * 2

    a, b = torch.tensor(2.0), torch.empty(0, 5)
    ra, rb = a.clone(), b.clone()
    exp = f(ra, rb)
    out = _compiled(f)(a, b)
    torch.testing.assert_close(out, exp)
    torch.testing.assert_close(a, ra)
    assert b.shape == (0, 5)


def test_views_and_aliases_are_copied_into():
    base = torch.zeros(4, 6)
    view = base[1:3]  # a view: its storage is the base's
    alias_owner = torch.randn(2, 6)
    alias = alias_owner.view(12)  # someone else holds the same storage
    transposed = torch.randn(6, 2).t()  # strided, not row-major

    def f(a, b, c):
        a.add_(1)
        b.sub_(1)
        c.mul_(2)
        return a + b + c

    exp_base, exp_owner, exp_t = base.clone(), alias_owner.clone(), transposed.clone()
    exp = f(exp_base[1:3], exp_owner, exp_t)
    ptrs = (view.data_ptr(), alias_owner.data_ptr(), transposed.data_ptr())
    out = _compiled(f)(view, alias_owner, transposed)
    torch.testing.assert_close(out, exp)
    torch.testing.assert_close(base, exp_base)  # written through the view
    torch.testing.assert_close(alias, exp_owner.view(12))  # the other holder sees it
    torch.testing.assert_close(transposed, exp_t)
    assert (view.data_ptr(), alias_owner.data_ptr(), transposed.data_ptr()) == ptrs


def _train(model, opt, step, x, steps=4):
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("foreach", [True, False])
def test_optimizer_step_swaps_parameters_and_state(foreach, in_place, monkeypatch):
    """AdamW's parameters and moments after 4 compiled steps match eager's. The first step swaps
    new storages in (zero copy). From the second on, XLA writes them in place (the default,
    runtime/inplace.py), or swaps again (FX2XLA_INPLACE=0). Neither recompiles, and no graph keeps
    a device buffer of a replaced storage."""
    monkeypatch.setenv("FX2XLA_INPLACE", "1" if in_place else "0")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    x = torch.randn(5, 8)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=foreach)
    expected = _train(ref, ref_opt, ref_opt.step, x)

    torch._dynamo.reset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=foreach)
    compiled_model = torch.compile(model, backend="fx2xla")
    step = torch.compile(opt.step, backend="fx2xla")
    params = list(model.parameters())
    ptrs = [p.data_ptr() for p in params]
    _train(compiled_model, opt, step, x, steps=1)
    graphs = fx2xla.metrics()["graphs"]
    # The first step's results are allocated while the old storages still live, so a swapped
    # parameter's address must differ (over more steps the allocator may hand one back).
    assert all(p.data_ptr() != q for p, q in zip(params, ptrs))  # swapped, not copied
    ptrs = [p.data_ptr() for p in params]
    versions = [p._version for p in params]
    losses = _train(compiled_model, opt, step, x, steps=1)
    if in_place:
        assert [p.data_ptr() for p in params] == ptrs
        assert all(p._version > v for p, v in zip(params, versions))  # a write autograd sees
    else:
        assert all(p.data_ptr() != q for p, q in zip(params, ptrs))
    losses = torch.cat([losses, _train(compiled_model, opt, step, x, steps=2)])
    assert fx2xla.metrics()["graphs"] == graphs  # new storages trigger no recompile
    torch.testing.assert_close(losses, expected[1:], rtol=1e-4, atol=1e-5)
    for p, q in zip(params, ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    for p, q in zip(params, ref.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][k], ref_opt.state[q][k], rtol=1e-4, atol=1e-6)
    # No compiled graph keeps a device buffer of a replaced (old) parameter storage alive.
    for g in list(live_graphs):
        for slot in g.resident_buffers():
            if slot is not None and any(slot.tensor is p for p in params):
                assert slot.data_ptr == slot.tensor.data_ptr()


def test_parameter_with_outside_alias_is_copied_into():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    held = model.weight.data  # shares the weight's storage
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 4)
    expected = _train(ref, ref_opt, ref_opt.step, x, steps=3)
    torch._dynamo.reset()
    losses = _train(model, opt, torch.compile(opt.step, backend="fx2xla"), x, steps=3)
    torch.testing.assert_close(losses, expected)
    torch.testing.assert_close(held, ref.weight.detach())  # the alias saw every update
    assert held.data_ptr() == model.weight.data_ptr()


def test_public_use_count_copies(monkeypatch):
    """Without torch's private storage counter every write-back is a copy, still correct."""
    public = plan_executor.make_storage_use_count(public=True)
    assert public(torch.randn(2)) == 2  # "shared": always copy
    monkeypatch.setattr(plan_executor, "storage_use_count", public)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    rx = x.clone()
    exp = _bump(rx, y)
    ptr = x.data_ptr()
    out = _compiled(_bump)(x, y)
    torch.testing.assert_close(out, exp)
    torch.testing.assert_close(x, rx)
    assert x.data_ptr() == ptr  # copied in place


def test_private_use_count_counts_holders():
    count = plan_executor.make_storage_use_count(public=False)
    assert count is not plan_executor.make_storage_use_count(public=True)
    t = torch.randn(4)
    assert count(t) == 1
    alias = t.view(2, 2)
    assert count(t) == 2
    del alias
    assert count(t) == 1


def test_batch_buckets_never_pad_a_writing_graph():
    def f(x):
        x.mul_(2)
        return x + 1

    torch._dynamo.reset()
    g = torch.compile(f, backend="fx2xla", dynamic=True, options={"batch_buckets": [4, 8]})
    for n in (3, 5):
        x = torch.randn(n, 2)
        rx = x.clone()
        exp = f(rx)
        torch.testing.assert_close(g(x), exp)
        torch.testing.assert_close(x, rx)  # the write reached the caller's tensor, not a padded copy


@pytest.mark.parametrize("partitioner", ["min_cut", "default"])
def test_partitioners_give_eager_gradients(partitioner):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.GELU(), torch.nn.LayerNorm(12), torch.nn.Linear(12, 3))
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6)
    ref(x).square().sum().backward()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fx2xla", options={"partitioner": partitioner, "fallback": "error"})
    compiled(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_bad_partitioner_is_rejected():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="partitioner='nope'"):
        torch.compile(lambda x: x + 1, backend="fx2xla", options={"partitioner": "nope"})(torch.ones(2))


def test_swapped_parameters_checkpoint_and_reload():
    """Parameters and optimizer state living in swapped-in storages save, load and keep
    training like any tensor."""
    import io

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 6)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch._dynamo.reset()
    step = torch.compile(opt.step, backend="fx2xla")
    _train(model, opt, step, x, steps=3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    clone = copy.deepcopy(model)
    clone.load_state_dict(saved["model"])
    clone_opt = torch.optim.Adam(clone.parameters(), lr=1e-2)
    clone_opt.load_state_dict(saved["opt"])
    for p, q in zip(model.parameters(), clone.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    a = _train(model, opt, step, x, steps=2)  # compiled, continuing
    b = _train(clone, clone_opt, clone_opt.step, x, steps=2)  # eager, from the checkpoint
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
