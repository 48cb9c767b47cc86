"""bench/weight_lhs.py runs on the CPU: at 8 rows every contender has a positive median (each
was checked against eager inside the run), and the ratios are those of the medians."""
import math

from tests.conftest import run_bench


def test_weight_lhs_bench_runs_on_cpu(tmp_path):
    r, _ = run_bench("weight_lhs.py", ["--models", "small", "--rows", "8", "--rounds", "3"], tmp_path / "weight_lhs.json")
    cell = r["models"]["small"]["rows"]["8"]
    med = cell["median_s"]
    assert set(med) == {"eager", "inductor", "fx2xla", "fx2xla:lhs", "fx2xla:kn", "fx2xla:nk"}
    assert all(math.isfinite(t) and t > 0 for t in med.values())
    assert math.isclose(cell["fx2xla_vs_inductor"], med["fx2xla"] / med["inductor"])
    assert math.isclose(cell["fx2xla_vs_lhs"], med["fx2xla"] / med["fx2xla:lhs"])
    assert math.isclose(cell["fx2xla_vs_kn"], med["fx2xla"] / med["fx2xla:kn"])
    assert math.isclose(cell["kn_vs_nk"], med["fx2xla:kn"] / med["fx2xla:nk"])
