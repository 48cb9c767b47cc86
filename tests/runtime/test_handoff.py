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
