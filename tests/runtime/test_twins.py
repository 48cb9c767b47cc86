"""Result twins (runtime/twins.py): a tensor that is an earlier executable's result, unchanged,
reaches the next executable as that result's own jax Array instead of a new import.

Tolerances: float32 results against eager PyTorch rtol 1e-4, atol 1e-5 for a few elementwise
ops and small matmuls; after 5 AdamW steps, parameters rtol 1e-3, atol 1e-4 (Adam's update
divides by sqrt of a second moment, which magnifies rounding near zero). fx2xla with and
without twins must agree exactly: the same executables read the same bytes."""
from __future__ import annotations

import gc

import pytest
import torch

import fx2xla
from fx2xla.metrics import live_graphs
from fx2xla.runtime import twins
from fx2xla.runtime.executor import make_recording

from tests.conftest import calls_in_threads


@pytest.fixture(autouse=True)
def _every_input_imported(monkeypatch):
    """These tests count and watch imports: small CPU inputs that arrive afresh are imported
    here, not staged (tests/runtime/test_staged_inputs.py covers staging)."""
    monkeypatch.setenv("FX2XLA_STAGE_INPUTS", "0")


@pytest.fixture
def keep_all(monkeypatch):
    """CPU inference graphs keep their returned results too (FX2XLA_TWINS=all): the tests that
    chain inference calls exercise taking them back."""
    monkeypatch.setenv("FX2XLA_TWINS", "all")


def _count_imports(monkeypatch, shapes=None):
    """Count every import of every PlanExecutor made from now on (optionally listing shapes)."""
    from fx2xla import plan_executor

    counter = {"n": 0}
    real_init = plan_executor.PlanExecutor.__init__

    def init(self, plan):
        real_init(self, plan)
        real_import = self.import_tensor

        def watched(t, device):
            counter["n"] += 1
            if shapes is not None:
                shapes.append(tuple(t.shape))
            return real_import(t, device)

        self.import_tensor = watched

    monkeypatch.setattr(plan_executor.PlanExecutor, "__init__", init)
    return counter


def _train(model, steps, x, compiled: bool):
    """`steps` AdamW steps of model on x (loss: mean square of the output), forward, backward
    and optimizer step compiled with fx2xla when `compiled`. Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = torch.compile(model, backend="fx2xla") if compiled else model
    step = torch.compile(opt.step, backend="fx2xla") if compiled else opt.step
    losses = []
    for _ in range(steps):
        loss = fwd(x).pow(2).mean()
        loss.backward()
        step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 16))


def test_training_step_imports_only_what_torch_made(monkeypatch):
    """A compiled forward, backward and AdamW step: from the second step on, the backward takes
    its saved activations, the step its grads, parameters and moments, and the forward the
    parameters the step wrote, as twins. The only imports left per step are the two tensors
    torch made (the input batch in the forward, the output's gradient in the backward), against
    more than 20 without twins. Parameters match eager's after 5 steps, and fx2xla with and
    without twins agree exactly."""
    x = torch.randn(8, 32)
    ref = _mlp()
    eager_losses = _train(ref, 5, x, compiled=False)

    shapes = []
    counter = _count_imports(monkeypatch, shapes)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fwd = torch.compile(model, backend="fx2xla")
    step = torch.compile(opt.step, backend="fx2xla")
    per_step = []
    for _ in range(5):
        before = counter["n"]
        shapes.clear()
        loss = fwd(x).pow(2).mean()
        loss.backward()
        step()
        opt.zero_grad()
        per_step.append((counter["n"] - before, list(shapes)))
    for n, seen in per_step[1:]:
        assert n == 2, seen
        assert sorted(seen) == [(8, 16), (8, 32)]  # the output's gradient, the batch
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(loss.detach(), eager_losses[-1], rtol=1e-3, atol=1e-5)

    torch._dynamo.reset()
    monkeypatch.setenv("FX2XLA_TWINS", "0")
    plain = _mlp()
    before = counter["n"]
    _train(plain, 5, x, compiled=True)
    assert (counter["n"] - before) / 5 > 20
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)


@pytest.mark.usefixtures("keep_all")
def test_chained_calls_import_once(monkeypatch):
    """y = f(y) over and over (a decode loop's cache): only the first call imports (the input
    and the parameters, which stay resident); the last result matches eager's."""
    counter = _count_imports(monkeypatch)
    lin = torch.nn.Linear(16, 16)
    f = torch.compile(lambda y: torch.tanh(lin(y)) + 0.5, backend="fx2xla")
    y = e = torch.randn(4, 16)
    with torch.no_grad():
        y = f(y)
        first = counter["n"]  # the input, the weight and the bias
        for i in range(6):
            y = f(y)
        for i in range(7):
            e = torch.tanh(lin(e)) + 0.5
    torch.testing.assert_close(y, e, rtol=1e-4, atol=1e-5)
    assert first == 3 and counter["n"] == first


@pytest.mark.usefixtures("keep_all")
@pytest.mark.parametrize("change", ["in_place", "dtype_view", "transposed", "reshaped", "sliced", "data_write"])
def test_a_changed_or_other_tensor_is_imported(monkeypatch, change):
    """A result changed by torch in place, or another tensor over its memory (a dtype view, a
    transposed or reshaped view, a slice), is never taken for the result's array: the next
    call reads what torch holds, as eager does. (A write through `.data` keeps the version, as
    for parameters: torch.no_grad() writes are the supported way, docs/gpu.md.)"""
    counter = _count_imports(monkeypatch)
    f = torch.compile(lambda y: y * 2 + 1, backend="fx2xla")
    g = torch.compile(lambda y: y * 3, backend="fx2xla")
    y = f(torch.arange(16.0).reshape(4, 4))
    base = counter["n"]
    if change == "in_place":
        y.add_(1)
        arg = y
    elif change == "dtype_view":
        arg = y.view(torch.int32)
        g = torch.compile(lambda y: y + 3, backend="fx2xla")
    elif change == "transposed":
        arg = y.t()
    elif change == "reshaped":
        arg = y.view(2, 8)
    elif change == "sliced":
        arg = y[1:]
    else:
        with torch.no_grad():
            y.mul_(2)
        arg = y
    expected = (arg + 3) if change == "dtype_view" else arg * 3
    torch.testing.assert_close(g(arg), expected, rtol=0, atol=0)
    assert counter["n"] == base + 1


@pytest.mark.usefixtures("keep_all")
def test_a_detached_result_is_its_twin(monkeypatch):
    """`detach()` shares the memory and the version counter: it is taken as the twin."""
    counter = _count_imports(monkeypatch)
    f = torch.compile(lambda y: y * 2 + 1, backend="fx2xla")
    g = torch.compile(lambda y: y - 1, backend="fx2xla")
    x = torch.randn(8)
    d = f(x).detach()
    base = counter["n"]
    torch.testing.assert_close(g(d), x * 2, rtol=1e-6, atol=1e-6)
    assert counter["n"] == base


@pytest.mark.usefixtures("keep_all")
def test_records_leave_with_the_memory():
    """A record lives as long as torch's storage: a view keeps it, and it leaves once every
    tensor over that memory is gone."""
    f = torch.compile(lambda y: y + 1, backend="fx2xla")
    y = f(torch.zeros(32))
    ptr = y.data_ptr()
    assert ptr in twins.records()
    v = y[:]
    del y
    gc.collect()
    assert ptr in twins.records()
    del v
    gc.collect()
    assert ptr not in twins.records()


@pytest.mark.usefixtures("keep_all")
def test_metrics_count_records():
    """fx2xla.metrics() reports the live records: one more per kept result alive, one fewer
    once it is dropped. The cyclic collector is off while it counts: a collection would drop
    the records of other tests' garbage too (the table is the process's)."""
    f = torch.compile(lambda y: y - 1, backend="fx2xla")
    f(torch.zeros(8))  # compiled now, its result dropped
    gc.collect()
    gc.disable()
    try:
        before = fx2xla.metrics()["twin_records"]
        y = f(torch.zeros(8))
        assert fx2xla.metrics()["twin_records"] == before + 1
        assert fx2xla.metrics()["twin_arrays_waiting"] >= 0
        del y
        assert fx2xla.metrics()["twin_records"] == before
    finally:
        gc.enable()


def test_off(monkeypatch):
    """FX2XLA_TWINS=0: no record is kept and every call imports its inputs."""
    monkeypatch.setenv("FX2XLA_TWINS", "0")
    counter = _count_imports(monkeypatch)
    f = torch.compile(lambda y: y * 0.5, backend="fx2xla")
    y = torch.ones(8)
    before = dict(twins.records())
    for _ in range(4):
        y = f(y)
    torch.testing.assert_close(y, torch.full((8,), 1 / 16), rtol=0, atol=0)
    assert counter["n"] == 4
    assert not set(twins.records()) - set(before)


def test_cpu_inference_results_are_not_kept_by_default(monkeypatch):
    """By default a CPU inference graph keeps no returned result (a record costs about what the
    import it may save does): no record is left, a call that reads the last result imports it,
    and values are eager's. A forward graph's returned results are kept (its backward reads
    them), and an inference graph's written input is (a decode step's cache)."""
    monkeypatch.delenv("FX2XLA_TWINS", raising=False)
    counter = _count_imports(monkeypatch)
    older = set(live_graphs)
    f = torch.compile(lambda y: y * 0.5 + 1, backend="fx2xla")
    y = e = torch.ones(8)
    before = dict(twins.records())
    for _ in range(4):
        y = f(y)
        e = e * 0.5 + 1
    torch.testing.assert_close(y, e, rtol=0, atol=0)
    assert counter["n"] == 4
    assert not set(twins.records()) - set(before)
    (graph,) = [g for g in live_graphs if g not in older]
    assert graph.static.kept == ()

    older = set(live_graphs)
    lin = torch.nn.Linear(8, 4)
    out = torch.compile(lin, backend="fx2xla")(torch.randn(2, 8, requires_grad=True))
    (forward,) = [g for g in live_graphs if g not in older and g.training]
    assert forward.static.kept and out.data_ptr() in twins.records()

    def write(cache, x):
        cache.add_(x)
        return cache.sum()

    older = set(live_graphs)
    cache = torch.zeros(8)
    total = torch.compile(write, backend="fx2xla")(cache, torch.ones(8))
    (graph,) = [g for g in live_graphs if g not in older]
    assert cache.data_ptr() in twins.records() and total.data_ptr() not in twins.records()
    torch.testing.assert_close(cache, torch.ones(8), rtol=0, atol=0)
    assert total.item() == 8


class _FakeEvent:
    """Stands in for a CUDA event recorded on torch's stream: passed once `done` is set."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done


def test_gpu_arrays_wait_for_torch_stream_before_release():
    """A GPU result's array outlives its tensor until an event recorded on torch's stream after
    the tensor died has passed (torch may still read the memory in kernels queued before), then
    goes. (CPU arrays recorded as a GPU's, with events stood in for.)"""
    import weakref

    import jax.numpy as jnp

    events = []

    def recorded():
        events.append(_FakeEvent())
        return events[-1]

    twins.claim()  # whatever earlier tests left waiting (never released by these stand-in events)
    t = torch.zeros(8)
    array = jnp.ones(8)
    ref = weakref.ref(array)
    twins.keep(t, array, None, fenced=True)
    del array
    twins.fence(recorded)
    assert ref() is not None and not events  # the tensor lives: nothing to fence
    del t
    gc.collect()
    assert ref() is not None and twins.waiting()
    twins.fence(recorded)
    assert len(events) == 1 and ref() is not None  # fenced, the event not passed yet
    events[0].done = True
    twins.fence(recorded)
    assert ref() is None and not twins.waiting() and len(events) == 1


@pytest.mark.usefixtures("keep_all")
def test_twins_made_paused_read_while_recording():
    """Twin arrays come from calls that run with jaxlib's traceback recording paused; a call
    that runs recorded (here inside a recording block, as while another thread compiles) takes
    them as well."""
    f = torch.compile(lambda y: y + 1, backend="fx2xla")
    y = f(torch.zeros(8))
    y = f(y)
    with make_recording()():
        y = f(y)
    y = f(y)
    torch.testing.assert_close(y, torch.full((8,), 4.0), rtol=0, atol=0)


@pytest.mark.usefixtures("keep_all")
def test_many_threads_chain_their_own_results():
    """Eight threads, each chaining its own results through two graphs: every thread's last
    value is eager's."""
    w = torch.randn(16, 16) / 4
    f = torch.compile(lambda y: torch.tanh(y @ w), backend="fx2xla")
    g = torch.compile(lambda y: y * 1.5 + 0.25, backend="fx2xla")
    inputs = [torch.randn(4, 16) for _ in range(8)]

    def chain(y):
        for _ in range(5):
            y = g(f(y))
        return y

    f(inputs[0]), g(inputs[0])  # compiled once, before the threads
    results = calls_in_threads(chain, inputs, calls=3)
    for i, x in enumerate(inputs):
        e = x
        for _ in range(5):
            e = torch.tanh(e @ w) * 1.5 + 0.25
        for r in results[i]:
            torch.testing.assert_close(r, e, rtol=1e-4, atol=1e-5)


def test_a_reshaped_output_leaves_as_a_result():
    """An output that only reshapes a value nothing else returns (a bias gradient's sum viewed
    as [n]) is the executable's result itself, with no view in torch; two outputs viewing one
    value still share its memory, as eager's do."""
    older = set(live_graphs)
    out = torch.compile(lambda x: (x * 2).sum(0, keepdim=True).view(-1), backend="fx2xla")(torch.ones(3, 4))
    (graph,) = [g for g in live_graphs if g not in older]
    assert not graph.plan.outputs[0].views
    torch.testing.assert_close(out, torch.full((4,), 6.0), rtol=0, atol=0)

    def two(x):
        b = x * 2
        return b.view(-1), b.view(2, -1)

    a, b = torch.compile(two, backend="fx2xla")(torch.ones(2, 3))
    assert a.data_ptr() == b.data_ptr()
    torch.testing.assert_close(b, torch.full((2, 3), 2.0), rtol=0, atol=0)


def test_storage_objects_live_as_long_as_storage():
    """What the records rely on from torch: a storage's Python object lives as long as the
    storage (a weak reference to it dies with the memory, not with a temporary)."""
    import weakref

    t = torch.zeros(4)
    ref = weakref.ref(t.untyped_storage())
    gc.collect()
    assert ref() is not None
    v = t.detach()
    del t
    gc.collect()
    assert ref() is v.untyped_storage()
    del v
    gc.collect()
    assert ref() is None


@pytest.mark.usefixtures("keep_all")
def test_results_of_every_kind_come_back_as_twins(monkeypatch):
    """bf16, int64, 0-d and empty results all come back as twins (nothing imported) and the
    graph that reads them matches eager exactly (integer and exactly representable values)."""
    counter = _count_imports(monkeypatch)

    def make(x):
        return x.to(torch.bfloat16) * 2, x.argmax(-1), x.sum(), x[:, :0] + 1

    def use(h, idx, s, e):
        return h.float() + idx.unsqueeze(-1) + s, e.sum(-1) + idx

    f, g = torch.compile(make, backend="fx2xla"), torch.compile(use, backend="fx2xla")
    x = torch.arange(12.0).reshape(3, 4)
    outs = f(x)
    assert [o.dtype for o in outs] == [torch.bfloat16, torch.int64, torch.float32, torch.float32]
    assert outs[2].dim() == 0 and outs[3].numel() == 0
    before = counter["n"]
    a, b = g(*outs)
    assert counter["n"] == before
    ea, eb = use(*make(x))
    torch.testing.assert_close(a, ea, rtol=0, atol=0)
    torch.testing.assert_close(b, eb, rtol=0, atol=0)


def _gpu_like(monkeypatch, compiled, arg):
    """Call `compiled(arg)` once with results recorded as a GPU's (fenced) and its executor's
    stream order stubbed and watched, fences recorded with stand-in events; returns (events of
    the order and the imports, the fence events made, the executor)."""
    from fx2xla import plan_executor

    monkeypatch.setattr(plan_executor, "GPU_PLATFORMS", ("cpu", "cuda", "rocm"))
    older = set(live_graphs)
    compiled(arg)
    (graph,) = [g for g in live_graphs if g not in older]
    executor, events, fences = graph.executor, [], []

    def recorded():
        fences.append(_FakeEvent())
        return fences[-1]

    real_import = executor.import_tensor
    executor.import_tensor = lambda t, d: events.append("import") or real_import(t, d)
    executor.stream_order = lambda dev, index: events.append("order")
    executor.fence = lambda: twins.fence(recorded)
    return events, fences, executor


@pytest.mark.parametrize("case", ["ordered_call", "all_twins", "all_twins_pressing"])
def test_dropped_gpu_results_go_at_the_next_ordered_call(monkeypatch, case):
    """A dropped GPU result's array goes at once at the next call that imports something (it is
    ordered after torch's stream, after the drop); a call that imports nothing fences it instead
    (an event on torch's stream), unless the waiting arrays add up to ORDER_BYTES: then it
    imports one twin again to be ordered, and lets them go. (CPU graphs standing in for GPU
    ones: results recorded as fenced, the order and the events stood in for.) Values stay
    eager's."""
    import weakref

    twins.fence(lambda: _FakeEvent())  # nothing of earlier tests left unfenced
    for arrays in twins.claim():
        del arrays
    f = torch.compile(lambda x: x * 2, backend="fx2xla")
    events, fences, _ = _gpu_like(monkeypatch, f, torch.ones(64))
    w = f(torch.ones(64))  # a result: the twin the all-twin calls take
    y = f(torch.full((64,), 3.0))
    ref = weakref.ref(twins.records()[y.data_ptr()].array)
    del y
    gc.collect()
    assert ref() is not None and twins.waiting()
    events.clear()
    if case == "ordered_call":
        out = f(torch.full((64,), 5.0))
        assert events == ["order", "import"] and not fences
        torch.testing.assert_close(out, torch.full((64,), 10.0), rtol=0, atol=0)
        assert ref() is None
        return
    if case == "all_twins_pressing":
        monkeypatch.setattr(twins, "ORDER_BYTES", 1)
    out = f(w)
    torch.testing.assert_close(out, torch.full((64,), 4.0), rtol=0, atol=0)
    if case == "all_twins":
        assert events == [] and len(fences) == 1 and ref() is not None
        fences[0].done = True
        f(w)
        assert ref() is None
    else:
        assert events == ["order", "import"] and not fences and ref() is None


def test_gpu_index_check_verdict_is_recorded(monkeypatch):
    """On a GPU the index checks' verdict is read by torch's `_assert_async` on its stream, so
    its array is recorded like every result (held until torch's stream is done with it). (A CPU
    graph with results recorded as a GPU's.) The gathered values are eager's."""
    from fx2xla import plan_executor

    monkeypatch.setattr(plan_executor, "GPU_PLATFORMS", ("cpu", "cuda", "rocm"))
    older = set(live_graphs)
    x, i = torch.randn(8, 4), torch.tensor([3, 0, 7])
    out = torch.compile(lambda x, i: x[i] * 2, backend="fx2xla")(x, i)
    (graph,) = [g for g in live_graphs if g not in older]
    spec = graph.static
    assert spec.checks, "the gather is index-checked"
    assert spec.kept == tuple(range(len(graph.plan.results) + 1))
    torch.testing.assert_close(out, x[i] * 2, rtol=0, atol=0)


@pytest.mark.usefixtures("keep_all")
def test_a_loaded_package_takes_its_own_results_back(monkeypatch, tmp_path):
    """A package loaded with fx2xla.load runs through the same executor: its result fed back as
    its input (a decode loop's state) is not imported again, and the values are eager's."""
    counter = _count_imports(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(2, 8)
    path = str(tmp_path / "step.fx2xla")
    fx2xla.export(model, (x,), path)
    run = fx2xla.load(path)
    with torch.no_grad():
        y = run(x)
        first = counter["n"]
        for _ in range(5):
            y = run(y)
        e = x
        for _ in range(6):
            e = model(e)
    torch.testing.assert_close(y, e, rtol=1e-5, atol=1e-6)
    assert counter["n"] == first
