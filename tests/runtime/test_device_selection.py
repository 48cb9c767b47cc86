"""The device follows the data: a graph runs on the PJRT device its tensor inputs live on
(`cuda:N` -> CUDA device N, CPU -> the CPU client), as Inductor picks it; PJRT_DEVICE and the
device index (option device_index, FX2XLA_DEVICE_INDEX) override it. The CUDA cases use a
stand-in CUDA client with two devices (this machine has no GPU); the CPU case runs for real."""
import types

import pytest
import torch

import fx2xla.runtime.client as client
from fx2xla.runtime import Device, device_for


@pytest.fixture
def two_gpus(monkeypatch):
    """A stand-in jax CUDA client with two local devices (only the platform mapping is under test)."""
    real = client.get_backend

    def get_backend(platform):
        if platform == "cuda":
            return types.SimpleNamespace(local_devices=lambda: ["gpu0", "gpu1"])
        return real(platform)

    monkeypatch.setattr(client, "get_backend", get_backend)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("FX2XLA_DEVICE_INDEX", raising=False)


def test_cpu_tensors_run_on_the_cpu_client(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("FX2XLA_DEVICE_INDEX", raising=False)
    assert device_for([torch.device("cpu")] * 2) == Device("cpu", 0)
    assert device_for([]) == Device("cpu", 0)  # no tensor inputs (factories only)
    compiled = torch.compile(lambda x: x * 2, backend="fx2xla")
    x = torch.randn(3)
    torch.testing.assert_close(compiled(x), x * 2)


def test_cuda_tensors_pick_their_own_gpu(two_gpus):
    assert device_for([torch.device("cuda", 1)]) == Device("cuda", 1)
    assert device_for([torch.device("cuda")]) == Device("cuda", 0)  # no index: device 0
    assert device_for([torch.device("cuda", 1), torch.device("cpu")]) == Device("cuda", 1)


def test_explicit_overrides(two_gpus, monkeypatch):
    assert device_for([torch.device("cuda", 1)], index=0) == Device("cuda", 0)  # option device_index
    monkeypatch.setenv("FX2XLA_DEVICE_INDEX", "0")
    assert device_for([torch.device("cuda", 1)]) == Device("cuda", 0)
    monkeypatch.delenv("FX2XLA_DEVICE_INDEX")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # the platform, whatever the tensors say
    assert device_for([torch.device("cuda", 1)]) == Device("cpu", 0)


def test_two_accelerators_are_an_error(two_gpus):
    with pytest.raises(ValueError, match="cuda:0, cuda:1"):
        device_for([torch.device("cuda", 0), torch.device("cuda", 1)])
    with pytest.raises(ValueError, match="device index 5"):
        device_for([torch.device("cuda", 0)], index=5)


def test_missing_plugin_and_foreign_devices_say_what_to_do(monkeypatch):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")

    def no_cuda(platform):
        if platform == "cuda":
            raise RuntimeError("Unknown backend cuda")
        return client.get_backend.__wrapped__(platform)

    monkeypatch.setattr(client, "get_backend", no_cuda)
    with pytest.raises(RuntimeError, match=r"tensors on cuda:0.*fx2xla\[cuda13\]"):
        device_for([torch.device("cuda", 0)])
    with pytest.raises(ValueError, match="mps"):
        device_for([torch.device("mps")])


def test_a_process_given_some_gpus_keeps_torchs_numbers(monkeypatch):
    """Under torchrun each process gets one GPU from jax.distributed (local_device_ids): jax
    numbers it 0, torch keeps the host's number. cuda:3 in torchrun's fourth process is jax's
    local device 0 (local_hardware_id 3), and back; a GPU the process was not given is refused
    by name. A process with every GPU, and the CPU, keep plain positions."""
    from fx2xla.runtime import client

    class FakeDevice:
        platform = "gpu"

        def __init__(self, id, hardware):
            self.id, self.local_hardware_id = id, hardware

    given = [FakeDevice(7, 3)]
    every = [FakeDevice(0, 0), FakeDevice(1, 1)]
    devices = {"cuda": given}

    class FakeClient:
        def __init__(self, platform):
            self.platform = platform

        def local_devices(self):
            return devices[self.platform]

    monkeypatch.setattr(client, "get_backend", FakeClient)
    assert client.local_position("cuda", 3) == 0
    assert client.Device("cuda", 3).jax_device is given[0]
    assert client.torch_index(given[0]) == 3
    with pytest.raises(ValueError, match="cuda:0 is not one of this process's devices.*cuda:3"):
        client.local_position("cuda", 0)
    devices["cuda"] = every
    assert client.local_position("cuda", 1) == 1 and client.torch_index(every[1]) == 1
    assert client.local_position("cpu", 5) == 5
