"""DLPack hand-off: the private fast paths and the public fallbacks give the same tensors."""
import jax
import pytest
import torch

from fx2xla.runtime import default_device
from fx2xla.runtime.handoff import make_exporter, make_importer

CASES = [
    torch.randn(3, 4),
    torch.randn(2, 3).to(torch.bfloat16),
    torch.tensor([2**40, -5], dtype=torch.int64),
    torch.tensor([True, False]),
    torch.tensor(3.5),
    torch.empty(0, 3),
    torch.randn(33)[1:],  # not 64-byte aligned
]


@pytest.mark.parametrize("public", [False, True], ids=["private", "public"])
@pytest.mark.parametrize("t", CASES, ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_round_trip(public, t):
    imp, exp = make_importer(public), make_exporter(public)
    assert imp.__name__ == ("import_public" if public else "import_private")
    assert exp.__name__ == ("export_public" if public else "export_private")
    a = imp(t, default_device().jax_device)
    back = exp(a)
    assert back.dtype == t.dtype and back.shape == t.shape
    torch.testing.assert_close(back, t, rtol=0, atol=0)


def test_private_import_is_zero_copy():
    t = torch.arange(16, dtype=torch.float32)
    a = make_importer(False)(t, default_device().jax_device)
    back = make_exporter(False)(a)
    assert back.data_ptr() == t.data_ptr()


def test_public_path_env_switch(monkeypatch):
    monkeypatch.setenv("FX2XLA_PUBLIC_DLPACK", "1")
    assert make_importer().__name__ == "import_public"
    assert make_exporter().__name__ == "export_public"


class _FakeCudaDevice:
    """Stands in for a jax CUDA device: its external-ready stream handle."""

    def get_stream_for_external_ready_events(self):
        return 0xABC


def test_cuda_importer_takes_parameters_and_uses_jax_stream(monkeypatch):
    """The private CUDA importer hands tensors that require grad (nn.Parameter) to jaxlib as
    they are (Tensor.__dlpack__ refuses them), defined on jax's external-ready stream, with no
    torch stream call per tensor. jaxlib's import is stubbed (no GPU here)."""
    from jax._src.lib import _jax

    from fx2xla.runtime import handoff

    calls = []
    monkeypatch.setattr(_jax, "dlpack_managed_tensor_to_buffer",
                        lambda capsule, device, stream, copy, kind: calls.append((capsule, stream)) or "buf")
    monkeypatch.setattr(torch.Tensor, "__dlpack__", lambda *a, **k: pytest.fail("per-tensor __dlpack__"))
    importer = make_importer(False, platform="cuda")
    assert importer.__name__ == "import_cuda_private"
    device = _FakeCudaDevice()
    param = torch.nn.Parameter(torch.randn(3))
    assert importer(param, device) == "buf" and importer(torch.randn(2), device) == "buf"
    assert [stream for _, stream in calls] == [0xABC, 0xABC]
    assert torch.utils.dlpack.from_dlpack(calls[0][0]).data_ptr() == param.data_ptr()  # zero-copy
    handoff.reset_stream_order()  # forget the fake device (the tables are keyed by id)


def test_public_cuda_importer_detaches_parameters(monkeypatch):
    import jax.dlpack

    seen = []
    monkeypatch.setattr(jax.dlpack, "from_dlpack", lambda t: seen.append(t) or jax.numpy.zeros(3))
    importer = make_importer(True, platform="cuda")
    assert importer.__name__ == "import_cuda_public"
    importer(torch.nn.Parameter(torch.randn(3)), default_device().jax_device)
    assert not seen[0].requires_grad


def test_misaligned_tensors_are_copied_for_accelerators():
    from fx2xla.runtime.handoff import aligned

    base = torch.randn(64)
    assert aligned(base) is base
    view = base[1:]
    copy = aligned(view)
    assert copy.data_ptr() % 16 == 0 and copy.data_ptr() != view.data_ptr()
    torch.testing.assert_close(copy, view, rtol=0, atol=0)


def _watch(graph, events):
    """Record `graph`'s stream orders and imports (in the order they happen) into `events`."""
    executor = graph.executor
    real_import = executor.import_tensor

    def watched_import(t, device):
        events.append("import")
        return real_import(t, device)

    executor.import_tensor = watched_import
    executor.stream_order = lambda dev, index: events.append("order")


def _new_graph(older):
    from fx2xla.metrics import live_graphs

    (graph,) = [g for g in live_graphs if g not in older]
    return graph


def test_one_stream_order_per_call(monkeypatch):
    """A graph on a GPU orders jax's import stream after torch's once per call, after every
    torch-side preparation (dense copies, the seed of random ops, weights stacked for a folded
    scan) and before the first import, however many tensors it hands over; a call whose inputs
    are all resident orders nothing. (CPU graphs, with the order function stubbed and watched,
    and every input imported as on a GPU: no staging.)"""
    from fx2xla.metrics import live_graphs
    from fx2xla.testing import LogitsOnly, gpt2, token_ids

    monkeypatch.setenv("FX2XLA_STAGE_INPUTS", "0")
    events = []
    older = set(live_graphs)
    lin = torch.nn.Linear(4, 4)
    compiled = torch.compile(lambda a, b, c: lin(a) + b.t() + c, backend="fx2xla")
    a, b, c = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    expected = lin(a) + b.t() + c
    with torch.no_grad():
        torch.testing.assert_close(compiled(a, b, c), expected)
    _watch(_new_graph(older), events)
    with torch.no_grad():
        torch.testing.assert_close(compiled(a, b, c), expected)
    assert events[0] == "order" and events.count("order") == 1 and events.count("import") >= 3, events

    # Only parameters in, unchanged since the last call: nothing to import, nothing to order.
    older = set(live_graphs)
    params_only = torch.compile(lambda: lin.weight * 2 + lin.bias, backend="fx2xla")
    with torch.no_grad():
        torch.testing.assert_close(params_only(), lin.weight * 2 + lin.bias)
    events.clear()
    _watch(_new_graph(older), events)
    with torch.no_grad():
        torch.testing.assert_close(params_only(), lin.weight * 2 + lin.bias)
    assert events == [], events

    # Random ops: the seed is drawn before the call's one order (and imported after it).
    older = set(live_graphs)
    dropped = torch.compile(lambda x: torch.nn.functional.dropout(lin(x), 0.5, training=True), backend="fx2xla")
    with torch.no_grad():
        dropped(a)
    graph = _new_graph(older)
    assert graph.plan.seed
    events.clear()
    _watch(graph, events)
    with torch.no_grad():
        out = dropped(a)
    assert events == ["order", "import", "import"], events  # x, then the seed
    kept = out != 0
    torch.testing.assert_close(out[kept], (lin(a) * 2)[kept].detach())

    # A folded scan: the per-layer weights stacked in torch, rebuilt after a weight changes,
    # before the call's one order.
    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=3, hidden=64)).eval()
    ids = token_ids(1, 16)
    older = set(live_graphs)
    folded = torch.compile(model, backend="fx2xla", fullgraph=True, options={"scan_min_layers": 2})
    with torch.no_grad():
        folded(ids)
    graph = _new_graph(older)
    groups = graph.plan.concats
    assert len(groups) >= 2
    events.clear()
    _watch(graph, events)
    with torch.no_grad():
        model.model.transformer.h[1].mlp.c_fc.weight.mul_(0.5)  # renews the stacks
        stacks = graph.executor.cached_stacks()
        got = folded(ids)
        expected = model(ids)
    assert any(graph.executor.cached_stacks()[k] is not v for k, v in stacks.items())  # rebuilt this call
    assert events[0] == "order" and events.count("order") == 1, events
    assert events.count("import") >= 1 + len(groups), events  # ids and every stack
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


class _Fake:
    """A stand-in for torch.cuda's stream and event objects: records what is asked of it."""

    def __init__(self, log, *args, **kwargs):
        self.log, self.args, self.kwargs = log, args, kwargs
        log.append((type(self).__name__, args, kwargs))


def test_order_after_torch_records_one_event_per_call(monkeypatch):
    """jax's import stream waits on one CUDA event per device (and thread), recorded again on
    torch's current stream of the tensors' device at each call: one record and one wait per
    call, one ExternalStream per device, no new event per call (wait_stream made one), and the
    device index passed through (cuda:1 while cuda:0 is current). torch.cuda is faked."""
    import threading

    from fx2xla.runtime import handoff

    log = []

    class ExternalStream(_Fake):
        def wait_event(self, event):
            log.append(("wait", self.args[0], id(event)))

        def wait_stream(self, stream):
            pytest.fail("wait_stream makes a new event per call")

    class Event(_Fake):
        def record(self, stream):
            log.append(("record", id(self), stream))

    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda *a, **k: ExternalStream(log, *a, **k))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: Event(log, *a, **k))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: f"torch stream of cuda:{index}")
    handoff.reset_stream_order()  # no stream or event made yet, in any thread
    order = handoff.make_stream_order(False, "cuda")  # the private CUDA importer's ordering
    assert order is not None and handoff.make_stream_order(True, "cuda") is None
    device = _FakeCudaDevice()
    try:
        for _ in range(3):
            order(device, 1)
        made = [e for e in log if e[0] in ("ExternalStream", "Event")]
        assert made == [("ExternalStream", (0xABC,), {"device": torch.device("cuda", 1)}), ("Event", (), {})], made
        calls = [e for e in log if e[0] in ("record", "wait")]
        event = calls[0][1]
        assert calls == [("record", event, "torch stream of cuda:1"), ("wait", 0xABC, event)] * 3, calls
        # Another thread records its own event (its current stream is its own), on the same stream.
        log.clear()
        worker = threading.Thread(target=order, args=(device, 1))
        worker.start()
        worker.join()
        assert [e[0] for e in log] == ["Event", "record", "wait"] and log[1][1] != event, log
    finally:
        handoff.reset_stream_order()  # forget the fake device, its fake stream and events


def test_public_cuda_importer_runs_under_the_tensors_device(monkeypatch):
    """jax's public import asks torch for its current stream of the *current* device: the
    importer makes the tensor's device current around it (a tensor on cuda:1 while cuda:0 is
    current). torch.cuda.device and the tensor's device are faked."""
    import jax.dlpack

    scopes, seen = [], []

    class FakeDevice:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            scopes.append(self.index)

        def __exit__(self, *exc):
            scopes.pop()

    monkeypatch.setattr(torch.cuda, "device", FakeDevice)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 1)  # what a tensor on cuda:1 answers
    monkeypatch.setattr(jax.dlpack, "from_dlpack", lambda t: seen.append(list(scopes)) or jax.numpy.zeros(3))
    make_importer(True, platform="cuda")(torch.randn(3), default_device().jax_device)
    assert seen == [[1]] and scopes == []


def test_inputs_are_aligned_before_the_import_where_the_device_needs_it(monkeypatch):
    """Graphs on GPUs (`_align`) hand XLA only 16-byte aligned memory: misaligned views (a
    storage offset) are copied before the import. (A CPU graph with the flag set and its
    imports watched, every input imported as on a GPU; without the flag the same views reach
    the import as they are.)"""
    from fx2xla.metrics import live_graphs

    monkeypatch.setenv("FX2XLA_STAGE_INPUTS", "0")

    older = set(live_graphs)
    compiled = torch.compile(lambda x, y: x * 2 + y, backend="fx2xla")
    base = torch.randn(80)
    x, y = base[1:33], base[34:66]
    assert x.data_ptr() % 16 and y.data_ptr() % 16
    torch.testing.assert_close(compiled(x, y), x * 2 + y)
    graph = _new_graph(older)
    executor = graph.executor
    real_import, pointers = executor.import_tensor, []

    def watched_import(t, device):
        pointers.append(t.data_ptr())
        return real_import(t, device)

    executor.import_tensor = watched_import
    for align in (False, True):
        pointers.clear()
        executor.align = align
        torch.testing.assert_close(compiled(x, y), x * 2 + y, rtol=0, atol=0)
        assert len(pointers) == 2
        assert all(p % 16 == 0 for p in pointers) == align, pointers


def test_restride_keeps_the_device_and_the_strides():
    """Outputs given eager's strides stay on their device (meta here: no memory, no copy to the
    CPU), with the strides asked for: a permuted layout, gaps, a broadcast dim."""
    from fx2xla.plan_executor import restride as _restride

    t = torch.empty(2, 3, 4, device="meta")
    for stride in [(1, 8, 2), (24, 8, 2)]:
        r = _restride(t, stride)
        assert r.device == t.device and r.shape == t.shape and r.stride() == stride, (stride, r.stride())
    r = _restride(t, (4, 0, 1))
    assert r.device == t.device and r.shape == t.shape and r.stride()[1] == 0
