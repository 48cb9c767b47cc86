"""bench/cuda_sweep.py (the CUDA model sweep) runs on the CPU: GPT-2 (default SDPA) and LLaMA
(GQA) in float32, inference and a training step, each case passing against eager with the
sweep's own tolerances (float32: relative 1e-3 on outputs, losses and grads), and every figure
in its JSON, the models run in the order `--models` names them (a deadline cuts the last); its
batch-norm calibration, its float64 reference for float32 cases that fail the direct comparison,
and its refusal of an all-zero eager answer, each on a small CNN; `--start-at`."""

import pytest
import torch

from tests.conftest import run_bench


def test_sweep_runs_and_matches_eager_on_cpu(tmp_path):
    report, printed = run_bench("cuda_sweep.py", ["--device", "cpu", "--models", "llama,gpt2", "--dtypes", "float32",
                                         "--modes", "infer,train"], tmp_path / "sweep.json", cwd=tmp_path)
    assert [c["model"] for c in report["cases"]] == ["llama", "llama", "gpt2", "gpt2"]
    cases = {(c["model"], c["mode"]): c for c in report["cases"]}
    assert set(cases) == {(m, mode) for m in ("gpt2", "llama") for mode in ("infer", "train")}
    for key, case in cases.items():
        assert case["status"] == "pass", (key, case)
        assert all(err <= 1e-3 for name, err in case["errors"].items() if err is not None), (key, case["errors"])
    assert "4 passed, 0 failed" in printed


def _sweep():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import cuda_sweep

    return cuda_sweep


class _SmallCNN(torch.nn.Module):
    """conv -> batch norm -> ReLU -> conv, called as the sweep calls models (keywords)."""

    def __init__(self, scale_std=0.02):
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.bn, self.conv2 = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 4, 3)
        with torch.no_grad():
            self.bn.weight.normal_(0, scale_std)     # as transformers draws EfficientNet's

    def forward(self, pixel_values):
        return self.conv2(torch.relu(self.bn(self.conv1(pixel_values))))


def test_calibrate_batch_norms_sets_scales_and_statistics():
    """calibrate_batch_norms: every batch norm's scale is 1 + N(0, 0.1^2) and its shift N(0,
    0.1^2) afterwards (whatever init gave), its running statistics are those of one training
    forward on the inputs (so eval mode equals that forward's normalization), and its momentum
    and batch count are as before."""
    sweep = _sweep()
    m = _SmallCNN()
    x = {"pixel_values": torch.randn(4, 3, 10, 10, generator=torch.Generator().manual_seed(1))}
    sweep.calibrate_batch_norms(m, x)
    assert (m.bn.weight - 1).abs().max() < 0.5 and m.bn.weight.std() > 0.01 and m.bn.bias.abs().max() > 0
    assert m.bn.momentum == 0.1 and int(m.bn.num_batches_tracked) == 0 and m.training
    h = m.conv1(x["pixel_values"]).detach()
    torch.testing.assert_close(m.bn.running_mean, h.mean((0, 2, 3)), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.bn.running_var, h.var((0, 2, 3), unbiased=True), rtol=1e-5, atol=1e-6)
    m.eval()
    with torch.no_grad():   # eval normalizes by that forward's statistics (the variance unbiased)
        c = (1, -1, 1, 1)
        expected = ((h - h.mean((0, 2, 3)).view(c)) / (h.var((0, 2, 3)).view(c) + m.bn.eps).sqrt()
                    * m.bn.weight.view(c) + m.bn.bias.view(c))
        torch.testing.assert_close(m.bn(h), expected, rtol=1e-4, atol=1e-5)


def test_float32_falls_back_to_a_float64_reference(monkeypatch):
    """A float32 case whose direct comparison with eager fails (here: tolerances 0) is judged
    against a float64 reference, in inference and in a training step: it passes when fx2xla is
    no further from float64 than the factor allows, keeps the direct figures under "direct", and
    fails when the factor and floor are 0 too (fx2xla's float32 error against float64 is not 0).
    An all-zero eager answer is an error, not a pass."""
    sweep = _sweep()
    x = {"pixel_values": torch.randn(4, 3, 10, 10, generator=torch.Generator().manual_seed(1))}
    model = _SmallCNN()
    sweep.calibrate_batch_norms(model, x)
    device = torch.device("cpu")
    tol = dict(sweep.TOLERANCES["float32"])
    monkeypatch.setitem(sweep.TOLERANCES, "float32", tol | {"output": 0.0, "loss": 0.0, "grad": 0.0})
    for run in (sweep.run_infer, sweep.run_train):
        torch._dynamo.reset()
        res = run(model, x, torch.float32, device, sweep.Stage())
        assert res["ok"] and res["reference"] == "float64", res
        assert res["direct"]["errors"] and 0 < res["errors"]["output" if run is sweep.run_infer else "loss"] < 1e-5
    monkeypatch.setitem(sweep.TOLERANCES, "float32", tol | {"output": 0.0, "loss": 0.0, "grad": 0.0,
                                                           "factor": 0.0, "floor": 0.0})
    for run in (sweep.run_infer, sweep.run_train):
        torch._dynamo.reset()
        assert not run(model, x, torch.float32, device, sweep.Stage())["ok"]

    class Zeros(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3))

        def forward(self, pixel_values):
            return pixel_values[..., :3] * self.w

    with pytest.raises(ValueError, match="all zeros"):
        sweep.run_infer(Zeros(), x, torch.float32, device, sweep.Stage())


def test_start_at_goes_on_from_a_model():
    """--start-at MODEL keeps the models from MODEL on, in the order run (the sweep's, or
    --models'), and names the models to run when MODEL is not among them."""
    sweep = _sweep()
    names = [s.name for s in sweep.model_specs(32)]
    assert sweep.parse_args(["--start-at", "phi3"]).models == names[names.index("phi3"):]
    assert sweep.parse_args(["--models", "bert,gpt2,t5", "--start-at", "gpt2"]).models == ["gpt2", "t5"]
    with pytest.raises(SystemExit):
        sweep.parse_args(["--models", "bert,gpt2", "--start-at", "t5"])
