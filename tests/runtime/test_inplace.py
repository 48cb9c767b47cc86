"""Written inputs updated in place (runtime/inplace.py): on one CPU device, XLA writes the new
contents of a graph's written inputs (an optimizer's parameters and moments, a cache, a
counter) into the input's own memory from the second call on, as eager does. The CUDA route's
order and ownership rules run here with torch's side stood in (tests/gpu runs them for real).

Tolerances: elementwise updates of float32, bfloat16 and int64 tensors are compared exactly
(rtol=atol=0: the same IEEE operations in the same order); after AdamW steps, parameters within
ADAMW_TOL of eager's: rtol 1e-4, atol 1e-4, 1% of one step at lr 1e-2. Adam's step divides a
gradient's first moment by the square root of its second, so for a gradient element near zero it
is a ratio of two roundings of that element, which differ between eager and XLA (another order
of sums): once in CI, with an unseeded input, one element of 256 was 5e-5 apart after four steps
(others ~1e-6). Inputs are seeded. fx2xla in place and fx2xla with FX2XLA_INPLACE=0 must agree
exactly: the same executables compute the same bytes, only where they land differs."""
from __future__ import annotations

import copy
import gc
import re

import pytest
import torch

import fx2xla
from fx2xla.metrics import live_graphs
from fx2xla.runtime import inplace

from tests.conftest import calls_in_threads


@pytest.fixture(autouse=True)
def _every_input_imported(monkeypatch):
    """These tests count and watch imports: small CPU inputs that arrive afresh are imported
    here, not staged (tests/runtime/test_staged_inputs.py covers staging)."""
    monkeypatch.setenv("FX2XLA_STAGE_INPUTS", "0")


ADAMW_TOL = dict(rtol=1e-4, atol=1e-4)


def _input(seed: int = 0):
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla")


def _graph_of(before: set):
    """The one compiled graph made since `before` (ids of live graphs)."""
    new = [g for g in live_graphs if id(g) not in before]
    assert len(new) == 1, new
    return new[0]


def test_each_written_input_is_aliased_with_its_own_result():
    """Three written inputs of one shape and an output of that shape returned before them: the
    module aliases each input with the result it is written back from (jax's own pairing would
    put the first result of a shape in the first donated input of that shape), every written
    input keeps its address from the second call on, and every value equals eager's."""
    def f(a, b, c, x):
        c.add_(x)
        a.mul_(2)
        b.sub_(x)
        return a + b + c

    torch.manual_seed(0)
    args = [torch.randn(16, 8) for _ in range(4)]
    ref = [t.clone() for t in args]
    before = {id(g) for g in live_graphs}
    run = _compiled(f)
    for call in range(3):
        exp = f(*ref)
        if call == 1:
            ptrs = [t.data_ptr() for t in args[:3]]
        torch.testing.assert_close(run(*args), exp, rtol=0, atol=0)
        for got, want in zip(args, ref):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert [t.data_ptr() for t in args[:3]] == ptrs  # written where they are
    graph = _graph_of(before)
    plan = graph.plan
    hlo = graph.static.exe.hlo_modules()[0].to_string()
    aliases = dict((int(o), int(p)) for o, p in re.findall(r"\{(\d+)\}: \((\d+), \{\}, may-alias\)", hlo))
    passed = [i for i, p in enumerate(plan.inputs) if p.passed]
    expected = {r: passed.index(i) for i, r in plan.mutations}
    assert len(expected) == 3 and aliases == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_dtypes_and_zero_dim_inputs_are_written_in_place(dtype):
    """A written tensor of `dtype`, a written 0-d counter and an empty written tensor: values
    equal eager's exactly after each of 4 calls, and from the second call the non-empty ones
    keep their address and their version moves once per call."""
    def f(t, step, empty, x):
        t.add_(x)
        step.add_(1)
        empty.mul_(2)
        return t * step

    x = torch.arange(12, dtype=dtype).reshape(3, 4)
    t, step, empty = torch.ones(3, 4, dtype=dtype), torch.zeros((), dtype=dtype), torch.zeros(0, 4, dtype=dtype)
    rt, rstep, rempty = t.clone(), step.clone(), empty.clone()
    run = _compiled(f)
    for call in range(4):
        exp = f(rt, rstep, rempty, x)
        if call == 1:
            ptrs, versions = (t.data_ptr(), step.data_ptr()), (t._version, step._version)
        torch.testing.assert_close(run(t, step, empty, x), exp, rtol=0, atol=0)
        torch.testing.assert_close((t, step, empty), (rt, rstep, rempty), rtol=0, atol=0)
    assert (t.data_ptr(), step.data_ptr()) == ptrs
    assert t._version > versions[0] and step._version > versions[1]


class _Trainer:
    """AdamW steps of `model` on the mean square of its output, compiled with `backend` (None:
    eager)."""

    def __init__(self, model, backend):
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.fwd = torch.compile(model, backend=backend) if backend else model
        self.step = torch.compile(self.opt.step, backend=backend) if backend else self.opt.step

    def __call__(self, x, steps):
        for _ in range(steps):
            self.fwd(x).square().mean().backward()
            self.step()
            self.opt.zero_grad(set_to_none=True)
        return self


def _adamw(model, x, steps, backend):
    return _Trainer(model, backend)(x, steps)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def test_an_alias_of_a_parameter_sees_the_update_like_eager(monkeypatch):
    """A tensor sharing a parameter's memory (`p.detach()`) taken after the first step sees the
    later steps' updates, as it does in eager, where AdamW updates in place; after the model and
    optimizer are gone, the alias still reads those values (its memory stays alive). With
    FX2XLA_INPLACE=0 the parameters are swapped to new storages instead and the parameters
    agree exactly with the in-place run."""
    x = _input()
    ref = _mlp()
    ref_train = _Trainer(ref, None)(x, 1)
    ref_alias = [p.detach() for p in ref.parameters()]
    ref_train(x, 3)

    torch._dynamo.reset()
    model = _mlp()
    train = _Trainer(model, "fx2xla")(x, 1)
    alias = [p.detach() for p in model.parameters()]
    train(x, 3)
    for a, p, r_a, r in zip(alias, model.parameters(), ref_alias, ref.parameters()):
        torch.testing.assert_close(p, r, **ADAMW_TOL)
        torch.testing.assert_close(a, r_a, **ADAMW_TOL)
        assert a.data_ptr() == p.data_ptr()
    final = [p.detach().clone() for p in model.parameters()]
    del model, train
    gc.collect()
    junk = [torch.randn(64, 64) for _ in range(64)]  # memory freed too early would be reused here
    for a, f in zip(alias, final):
        torch.testing.assert_close(a, f, rtol=0, atol=0)
    del junk

    monkeypatch.setenv("FX2XLA_INPLACE", "0")
    torch._dynamo.reset()
    swapped = _mlp()
    _adamw(swapped, x, 4, "fx2xla")
    for p, f in zip(swapped.parameters(), final):
        torch.testing.assert_close(p, f, rtol=0, atol=0)


def test_index_check_failure_after_an_in_place_write_keeps_the_tensor_usable():
    """A written cache whose update index is out of range in the third call: the call raises
    IndexOutOfRangeError naming index_copy, the cache holds what eager's holds (the
    out-of-range row is not written), and the next calls go on matching eager."""
    def f(cache, idx, row):
        cache.index_copy_(0, idx, row)
        return cache.sum(0)

    cache, ref = torch.zeros(6, 4), torch.zeros(6, 4)
    run = _compiled(f)
    for i in (0, 1):
        row = torch.full((1, 4), float(i + 1))
        torch.testing.assert_close(run(cache, torch.tensor([i]), row), f(ref, torch.tensor([i]), row), rtol=0, atol=0)
    with pytest.raises(fx2xla.IndexOutOfRangeError, match="index_copy"):
        run(cache, torch.tensor([9]), torch.full((1, 4), 7.0))
    torch.testing.assert_close(cache, ref, rtol=0, atol=0)
    for i in (2, 3):
        row = torch.full((1, 4), float(i + 1))
        torch.testing.assert_close(run(cache, torch.tensor([i]), row), f(ref, torch.tensor([i]), row), rtol=0, atol=0)
    torch.testing.assert_close(cache, ref, rtol=0, atol=0)


def test_a_shared_written_input_is_copied_into():
    """A written input whose storage another tensor shares (a view's base) is written through
    (copied into) on every call: the other holder sees every update, the address never moves,
    and values equal eager's."""
    def f(a, x):
        a.add_(x)
        return a * 2

    base, ref_base = torch.zeros(4, 3), torch.zeros(4, 3)
    view, ref_view = base[1:3], ref_base[1:3]
    owner = torch.zeros(2, 3)
    other = owner.view(6)  # shares owner's storage
    ref_owner = torch.zeros(2, 3)
    run = _compiled(f)
    ptr = owner.data_ptr()
    for k in range(3):
        x = torch.full((2, 3), float(k + 1))
        torch.testing.assert_close(run(view, x), f(ref_view, x), rtol=0, atol=0)
        torch.testing.assert_close(run(owner, x), f(ref_owner, x), rtol=0, atol=0)
    torch.testing.assert_close(base, ref_base, rtol=0, atol=0)
    torch.testing.assert_close(other, ref_owner.view(6), rtol=0, atol=0)
    assert owner.data_ptr() == ptr


def test_training_in_threads_matches_eager():
    """Four threads each train their own model with compiled AdamW steps at once (the same
    graphs, each thread's own tensors written in place): every model's parameters match its
    eager twin's after 3 steps."""
    torch._dynamo.reset()
    xs = [_input(k) for k in range(4)]
    refs = []
    for x in xs:
        ref = _mlp()
        _adamw(ref, x, 3, None)
        refs.append(ref)
    models = [_mlp() for _ in xs]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    fwd = torch.compile(lambda m, x: m(x).square().mean(), backend="fx2xla")
    steps = [torch.compile(o.step, backend="fx2xla") for o in opts]
    # Compile first, one thread: Dynamo's compile is not the subject here.
    k0 = 0
    with torch.enable_grad():
        fwd(models[k0], xs[k0]).backward()
    steps[k0]()
    opts[k0].zero_grad(set_to_none=True)

    def train(k):
        with torch.enable_grad():
            for _ in range(3 if k != k0 else 2):
                fwd(models[k], xs[k]).backward()
                steps[k]()
                opts[k].zero_grad(set_to_none=True)
        return True

    calls_in_threads(train, list(range(4)), 1)
    for m, r in zip(models, refs):
        for p, q in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p, q, **ADAMW_TOL)


def test_own_view_holds_the_array_and_follows_it():
    """`own_view` makes a tensor over a jax Array's memory for each dtype a written input can
    have (bfloat16 through a same-width integer view); the tensor keeps the Array alive,
    `rehome` moves it to the Array XLA wrote there, and `consumed` tells when the Array was
    deleted under the view."""
    import jax
    import numpy as np

    for dtype, jdt in ((torch.float32, np.float32), (torch.int64, np.int64), (torch.bool, np.bool_),
                       (torch.bfloat16, jax.numpy.bfloat16), (torch.float16, np.float16)):
        src = torch.arange(6).reshape(2, 3).to(dtype)
        with jax.enable_x64(True):  # int64 stays int64, as in fx2xla's executables
            a = jax.jit(lambda v: (v + 0).astype(v.dtype))(jax.numpy.asarray(src.double().numpy()).astype(jdt))
        t = inplace.own_view(a, dtype)
        assert t.dtype == dtype and t.shape == (2, 3) and t.data_ptr() == a.unsafe_buffer_pointer()
        torch.testing.assert_close(t, src, rtol=0, atol=0)
        del a
        gc.collect()
        torch.testing.assert_close(t, src, rtol=0, atol=0)  # still alive through the view
    assert inplace.rehome(t.data_ptr() + 1, None) is False  # no holder there
    assert not inplace.consumed(t.data_ptr())
    with jax.enable_x64(True):
        b = jax.jit(lambda v: v * 2)(jax.numpy.ones(4))
    u = inplace.own_view(b, torch.float64)
    ptr = u.data_ptr()
    b.delete()  # as a donation that left no result at this address would (never expected)
    assert inplace.consumed(ptr)
    del u  # never read: its memory is gone
    assert inplace.viewable(torch.complex64) and inplace.viewable(torch.float64)


def test_off_switch_keeps_written_inputs_resident(monkeypatch):
    """FX2XLA_INPLACE=0: no input is donated, so parameters written by a step stay resident
    candidates as before; the default donates exactly the written dense inputs."""
    def f(a, b):
        a.add_(b)
        return b * 2

    for env, donated in (("0", []), ("1", [0])):
        monkeypatch.setenv("FX2XLA_INPLACE", env)
        before = {id(g) for g in live_graphs}
        run = _compiled(f)
        run(torch.zeros(3), torch.ones(3))
        plan = _graph_of(before).plan
        assert [i for i, p in enumerate(plan.inputs) if p.donated] == donated


def test_copied_model_after_in_place_steps():
    """`copy.deepcopy` and `state_dict` of a model trained in place copy its values (its
    storages are views over XLA's memory), and the copies stay valid after the original and its
    memory are gone."""
    x = _input()
    torch._dynamo.reset()
    model = _mlp()
    _adamw(model, x, 3, "fx2xla")
    clone, state = copy.deepcopy(model), {k: v.clone() for k, v in model.state_dict().items()}
    values = [p.detach().clone() for p in model.parameters()]
    del model
    gc.collect()
    for p, v in zip(clone.parameters(), values):
        torch.testing.assert_close(p, v, rtol=0, atol=0)
    torch.testing.assert_close(list(state.values()), values, rtol=0, atol=0)


def test_gpu_route_orders_waits_and_donates_only_owned_arrays(monkeypatch):
    """The CUDA route (runtime/inplace.py), on the CPU client with torch's side stood in (results
    recorded as a GPU's, the stream order, the stream wait and the fence events watched):
    - a step whose every input is a twin imports its one unwritten input again, so that it is
      ordered after torch's stream before XLA writes in place;
    - torch's stream waits for each call's execution once, since every result stays XLA's;
    - a written input that is an exported result (a DLPack external reference, which a GPU
      refuses to donate) is imported and copied into a buffer XLA owns, never donated as is;
    - from the second call on every written input keeps its address;
    - read right after each call (the stream wait stood in by a block), the values equal
      eager's (float32 rtol 1e-6, atol 1e-6)."""
    from fx2xla import plan_executor
    from fx2xla.runtime import twins

    waits, copies = [], []

    def stream_wait(a):
        # torch's stream would wait for the execution before its next kernel; torch's CPU
        # kernels run at once, so the stand-in waits here (without it, reading p right after a
        # call raced the execution on XLA's thread: it failed once in CI, under load).
        waits.append(a)
        a.block_until_ready()

    monkeypatch.setattr(plan_executor, "GPU_PLATFORMS", ("cpu", "cuda", "rocm"))
    monkeypatch.setattr(plan_executor, "make_stream_wait", lambda index: stream_wait)
    real_copy = plan_executor.owned_copy
    monkeypatch.setattr(plan_executor, "owned_copy", lambda buf, d: copies.append(buf) or real_copy(buf, d))

    def step(p, m, g):
        m.mul_(0.9).add_(g)
        p.sub_(m * 0.1)

    torch.manual_seed(0)
    double = _compiled(lambda x: x * 2)
    # Large enough that the execution is still running when the call returns (a read that is not
    # ordered after it sees the old values).
    shape = (1024, 512)
    g = double(torch.randn(shape))  # an exported result: its twin is not owned
    m = double(torch.randn(shape))  # the same, and written by the step
    p = torch.randn(shape)
    ref = [p.clone(), m.clone(), g.clone()]
    before = {id(g_) for g_ in live_graphs}
    run = torch.compile(step, backend="fx2xla")
    m_record = twins.records()[m.data_ptr()]
    assert not m_record.owned
    run(p, m, g)
    step(*ref)
    executor = _graph_of(before).executor
    assert executor.writes_in_place and waits and waits[-1].unsafe_buffer_pointer() in (p.data_ptr(), m.data_ptr())
    # p (torch's memory) and m (an exported result) were imported and copied, not donated as is.
    assert len(copies) == 2 and not m_record.array.is_deleted()
    events, fences = [], []
    real_import = executor.import_tensor
    executor.import_tensor = lambda t, d: events.append(("import", tuple(t.shape), t.data_ptr())) or real_import(t, d)
    executor.stream_order = lambda dev, index: events.append("order")

    class Event:
        def query(self):
            return True

    executor.fence = lambda: twins.fence(lambda: fences.append(Event()) or fences[-1])
    ptrs = None
    for call in range(3):
        events.clear()
        waits.clear()
        step(*ref)
        run(p, m, g)  # then read at once, as torch's next kernel would
        assert events == ["order", ("import", shape, g.data_ptr())], events  # g again: ordered
        assert len(waits) == 1 and len(copies) == 2
        if ptrs is None:
            ptrs = (p.data_ptr(), m.data_ptr())
        assert (p.data_ptr(), m.data_ptr()) == ptrs
        assert twins.records()[p.data_ptr()].owned and twins.records()[m.data_ptr()].owned
        for got, want in zip((p, m, g), ref):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    del p, m, g, got
    gc.collect()
    twins.claim()  # the arrays recorded as a GPU's wait for no real event: let them go


def test_gpu_holder_releases_its_array_after_torch_stream():
    """A GPU view's holder (`FencedHolder`) does not free its array when torch's storage dies:
    the array waits for torch's stream like a dropped twin's (an event recorded at the next
    fence, stood in for here), then goes. A CPU holder frees it at once."""
    import weakref

    import jax.numpy as jnp

    from fx2xla.runtime import twins

    twins.claim()  # what earlier tests left waiting

    class Event:
        done = False

        def query(self):
            return self.done

    def dropped(holder_type):
        """A weak reference to an array whose only holder, of `holder_type`, is gone."""
        holder = holder_type()
        holder.array = jnp.ones(8)
        ref = weakref.ref(holder.array)
        del holder
        gc.collect()
        return ref

    events = []
    ref = dropped(inplace.FencedHolder)
    assert ref() is not None and twins.waiting()
    twins.fence(lambda: events.append(Event()) or events[-1])
    assert ref() is not None and len(events) == 1  # fenced, the event not passed yet
    events[0].done = True
    twins.fence(lambda: events.append(Event()) or events[-1])
    assert ref() is None and not twins.waiting()
    ref = dropped(inplace.Holder)
    assert ref() is None and not twins.waiting()
