"""bench/train.py runs end to end on the CPU for the MLP with `--phases`: the step's medians for
every contender, fx2xla's first loss within 1e-4 of eager's (float32; the MLP has no dropout,
so only rounding differs), and per phase (forward, loss, backward, optimizer step, zero_grad)
a positive finite median for eager, Inductor and fx2xla, with the backward's page faults
counted and printed, and fx2xla's split parts counted (where the kernel library is built, the
backward's three matmuls are split, so some; else none); the back-to-back medians of eager,
Inductor, fx2xla and fx2xla without the weight on the left, positive and finite, their ratios
and the column `wl` printed."""
import math

from fx2xla import torch_kernels

from tests.conftest import run_bench


def test_train_bench_phases(tmp_path):
    r, printed = run_bench("train.py", ["--models", "mlp", "--rounds", "1", "--phases"], tmp_path / "train.json",
                           timeout=1200)
    m = r["models"]["mlp"]
    assert "error" not in m, m.get("error")
    for contender in ("eager", "inductor", "fx2xla"):
        assert math.isfinite(m[f"{contender}_s"]) and m[f"{contender}_s"] > 0
    assert m["first_loss_abs_diff_vs_eager"] < 1e-4
    for contender in ("eager", "inductor", "fx2xla", "fx2xla_weight_rhs"):
        assert math.isfinite(m[f"{contender}_back_to_back_s"]) and m[f"{contender}_back_to_back_s"] > 0
    assert m["back_to_back_fx2xla_vs_inductor"] == m["fx2xla_back_to_back_s"] / m["inductor_back_to_back_s"]
    assert "back to back (a training loop's steps" in printed and "wl (fx2xla ÷ fx2xla computing" in printed
    split = m["phases"].pop("fx2xla_split_parts")
    assert (split["parts"] > 0) == torch_kernels.available("matmul")
    assert 0 <= split["elsewhere"] <= split["parts"]
    assert set(m["phases"]) == {"eager", "inductor", "fx2xla"}
    for contender, med in m["phases"].items():
        for phase in ("forward", "loss", "backward", "optimizer", "zero_grad"):
            assert math.isfinite(med[phase]) and med[phase] > 0, (contender, phase, med)
        assert med["backward_faults"] >= 0
        assert f"phases, {contender}" in printed
    assert "backward page faults" in printed and "fx2xla's splits in those steps" in printed
