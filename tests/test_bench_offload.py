"""bench/offload.py runs end to end on the CPU with a tiny configuration: each contender's first
step, losses within 1e-5 (relative, float32) of eager's for three steps, the wall-time figures,
and the memory of each contender from its own process (XLA's bytes in use, and the bytes
offloading left in host memory: positive for an offloading contender)."""
import math
import os

from tests.conftest import run_bench


def test_offload_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "offload.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "XLA_FLAGS")}
    args = ["--device", "cpu", "--layers", "1", "--hidden", "64", "--batch", "2", "--seq", "16", "--vocab", "64",
            "--dtype", "float32", "--rounds", "3", "--queued", "2", "--phase-budget", "3",
            "--contenders", "eager,fx2xla_activations"]
    r, _ = run_bench("offload.py", args, out, env=env, timeout=900)
    assert set(r["contenders"]) == {"eager", "fx2xla_activations"}
    for name, c in r["contenders"].items():
        assert "error" not in c, (name, c)
        for fig in ("first_s", "synced_s", "queued_s"):
            assert isinstance(c[fig], float) and math.isfinite(c[fig]) and c[fig] > 0, (name, fig, c)
        assert c["kernel_s"] is None  # no device kernels on the CPU
    assert len(r["losses"]["fx2xla_activations"]) == 3
    assert r["loss_rel_diff_vs_eager"]["fx2xla_activations"] < 1e-5, r["loss_rel_diff_vs_eager"]
    mem = r["memory"]["fx2xla_activations"]
    assert mem["offloaded_bytes"] > 0 and mem["xla_device_memory"]["cpu:0"]["bytes_in_use"] > 0, mem
    assert r["memory"]["eager"]["torch_peak_bytes"] is None  # torch's allocator peak: CUDA only
