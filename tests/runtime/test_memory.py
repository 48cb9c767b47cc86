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
