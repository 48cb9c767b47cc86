"""bench/call_split.py runs on the CPU: for each model it reports, for fx2xla and Inductor, a
positive whole call that is its outside plus its inside, fx2xla's inside split into a positive
import and execute, a non-negative release, one compiled graph, and results within float32
tolerance of eager's (max |err| ≤ 1e-5 for x*2+1)."""
import math

from tests.conftest import run_bench


def test_call_split_bench_runs_on_cpu(tmp_path):
    r, out = run_bench("call_split.py", ["--models", "tiny", "--rounds", "1", "--calls", "5"], tmp_path / "s.json")
    tiny = r["models"]["tiny"]
    assert tiny["graphs"] == 1
    for who in ("fx2xla", "inductor"):
        assert tiny[f"{who}.whole"] > 0 and tiny[f"{who}.inside"] > 0
        assert math.isclose(tiny[f"{who}.whole"], tiny[f"{who}.outside"] + tiny[f"{who}.inside"], rel_tol=1e-9)
        assert tiny[f"{who}.max_abs_err"] <= 1e-5
    assert tiny["fx2xla.import"] > 0 and tiny["fx2xla.execute"] > 0 and tiny["fx2xla.release"] >= 0
    assert tiny["fx2xla.import"] + tiny["fx2xla.execute"] < tiny["fx2xla.inside"]
    assert "fx2xla ÷ Inductor" in out
