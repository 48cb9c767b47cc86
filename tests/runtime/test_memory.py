"""Memory shared with torch: fx2xla turns jax's GPU preallocation off unless the user set any
XLA_PYTHON_CLIENT_* memory variable, and metrics() reports what XLA holds per device."""
import os
import subprocess
import sys

import pytest
import torch

import fx2xla

_PRINT_POLICY = "import os, fx2xla; print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))"


@pytest.mark.parametrize("user_env,expected", [
    ({}, "false"),  # default: no preallocation
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, "true"),  # the user's own choice stands
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}, "None"),  # so does any other memory setting
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, "None"),
    ({"XLA_CLIENT_MEM_FRACTION": ".5"}, "None"),  # the newer spelling of the fraction
])
def test_preallocation_policy(user_env, expected):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_PYTHON_CLIENT_", "XLA_CLIENT_"))}
    out = subprocess.run([sys.executable, "-c", _PRINT_POLICY], env={**env, **user_env},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected


def test_metrics_report_device_memory():
    compiled = torch.compile(lambda x: x.sin() * 2, backend="fx2xla")
    x = torch.randn(256, 256)
    torch.testing.assert_close(compiled(x), x.sin() * 2)
    memory = fx2xla.metrics()["device_memory"]
    assert "cpu:0" in memory
    assert isinstance(memory["cpu:0"]["bytes_in_use"], int) and memory["cpu:0"]["bytes_in_use"] >= 0


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
def test_a_dropped_model_frees_its_weights(train):
    """A model compiled for a training step (forward, backward, SGD step) or for inference, called
    three times, then dropped with its optimizer and compiled function (torch._dynamo.reset(),
    gc.collect()): no weight stays alive. torch keeps AOTAutograd's compiled function, and with
    it fx2xla's graph, past the reset; the graph's resident buffers must not hold the weights.
    Each step's loss equals eager's on a copy (float32, rtol 1e-5, atol 1e-6)."""
    import copy
    import gc
    import weakref

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    ref_model = copy.deepcopy(m)
    refs = [weakref.ref(p) for p in m.parameters()]
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.01), torch.optim.SGD(ref_model.parameters(), lr=0.01)

    def step(model, optimizer, x):
        loss = model(x).square().mean()
        if train:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return loss.detach()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="fx2xla")
    with torch.set_grad_enabled(train):
        for i in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(m, opt, x), step(ref_model, ref_opt, x), rtol=1e-5, atol=1e-6)
    del m, opt, compiled
    torch._dynamo.reset()
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
