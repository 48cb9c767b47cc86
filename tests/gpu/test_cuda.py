"""On a CUDA GPU (`PJRT_DEVICE=CUDA pytest -m cuda`): models with torch's default SDPA run as
one executable (the fused attention kernels torch picks on CUDA lower: no eager islands),
results match eager (float32: rtol 1e-4 / atol 1e-5 scaled by 10 for whole models; bfloat16:
rtol 1.6e-2 / atol 1e-2 scaled by 10), and torch keeps its GPU memory. Skipped without a GPU."""
import os

import pytest
import torch

import fx2xla
from conftest import tolerance

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _cuda_client(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CUDA")


def _gpt2(dtype):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128)
    return transformers.GPT2LMHeadModel(config).eval().to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt2_default_sdpa_runs_without_islands(dtype):
    model = _gpt2(dtype)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    compiled = torch.compile(model, backend="fx2xla", options={"fallback": "error"})
    with torch.no_grad():
        expected = model(ids).logits
        actual = compiled(ids).logits
    assert actual.device == expected.device
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance(dtype, 10))
    assert fx2xla.metrics()["fallback_ops"] == 0


def test_torch_keeps_its_gpu_memory():
    free_before, _ = torch.cuda.mem_get_info()
    model = _gpt2(torch.float32)
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        compiled(torch.randint(0, 1000, (2, 64), device="cuda"))
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
    assert free_after >= 0.9 * free_before, (free_before, free_after)
    memory = fx2xla.metrics()["device_memory"]
    assert any(m["bytes_limit"] for m in memory.values())
