"""DLPack hand-off: the private fast paths and the public fallbacks give the same tensors."""
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
    handoff._ready_streams.clear()


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


def test_one_stream_order_per_call(monkeypatch):
    """A graph on a GPU orders jax's import stream after torch's once per call, after every
    torch-side preparation (dense copies) and before the first import, however many tensors it
    hands over; a call whose inputs are all resident orders nothing. (CPU graph, with the
    order function stubbed and watched.)"""
    from fx2xla.metrics import live_graphs

    events = []
    older = set(live_graphs)
    lin = torch.nn.Linear(4, 4)
    compiled = torch.compile(lambda a, b, c: lin(a) + b.t() + c, backend="fx2xla")
    a, b, c = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    expected = lin(a) + b.t() + c
    with torch.no_grad():
        torch.testing.assert_close(compiled(a, b, c), expected)
    (graph,) = [g for g in live_graphs if g not in older]
    real_import = graph._import_tensor

    def watched_import(t, device):
        events.append("import")
        return real_import(t, device)

    graph._import_tensor = watched_import
    graph._order_in = lambda dev, index: events.append("order")
    with torch.no_grad():
        torch.testing.assert_close(compiled(a, b, c), expected)
    assert events[0] == "order" and events.count("order") == 1 and events.count("import") >= 3, events

    # Only parameters in, unchanged since the last call: nothing to import, nothing to order.
    older = set(live_graphs)
    params_only = torch.compile(lambda: lin.weight * 2 + lin.bias, backend="fx2xla")
    with torch.no_grad():
        torch.testing.assert_close(params_only(), lin.weight * 2 + lin.bias)
    (graph,) = [g for g in live_graphs if g not in older]
    events.clear()
    graph._order_in = lambda dev, index: events.append("order")
    with torch.no_grad():
        torch.testing.assert_close(params_only(), lin.weight * 2 + lin.bias)
    assert events == [], events
