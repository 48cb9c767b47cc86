"""bench/package.py runs on the CPU: for the MLP, every contender (eager, Inductor,
torch.compile with fx2xla, the loaded package, the package with nn.Linear weights as torch holds
them, the package with matmuls of 4-64 rows as x . W^T, the package loaded without the kernel
library) gets a positive median, an output within float32's 1e-4 (relative to the largest
magnitude) of eager's, and the ratios the README quotes."""
import math

from tests.conftest import run_bench


def test_package_bench_runs_on_cpu(tmp_path):
    report, printed = run_bench("package.py", ["--models", "mlp", "--rounds", "1"], tmp_path / "package.json")
    r = report["models"]["mlp"]
    names = {"eager", "inductor", "fx2xla", "package", "package:as-is", "package:weight-rhs", "package:xla-kernels"}
    assert set(r["median_s"]) == names and set(r["max_rel_err"]) == names
    assert all(math.isfinite(v) and v > 0 for v in r["median_s"].values()), r
    assert all(e <= 1e-4 for e in r["max_rel_err"].values()), r["max_rel_err"]
    assert set(r["ratios"]) == {"package/inductor", "package/eager", "package/fx2xla", "package/package:as-is",
                                "package/package:weight-rhs", "package/package:xla-kernels"}
    assert "MISMATCH" not in printed
