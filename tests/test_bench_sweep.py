"""bench/cuda_sweep.py (the CUDA model sweep) runs on the CPU: GPT-2 (default SDPA) and LLaMA
(GQA) in float32, inference and a training step, each case passing against eager with the
sweep's own tolerances (float32: relative 1e-3 on outputs, losses and grads), and every figure
in its JSON, the models run in the order `--models` names them (a deadline cuts the last)."""

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
