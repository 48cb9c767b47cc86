"""bench/call_path.py runs on the CPU: it reports both timings of the nested Python calls, the
evaluator check at top level (CPython's default there), and for each measured call its hot time
and its time right after each of the three others, all positive."""
import math

from tests.conftest import run_bench


def test_call_path_bench_runs_on_cpu(tmp_path):
    r, _ = run_bench("call_path.py", ["--rounds", "1", "--calls", "20"], tmp_path / "call_path.json")
    py = r["python_calls"]
    assert py["chain50_top_s"] > 0 and py["chain50_inside_dynamo_s"] > 0
    assert py["default_evaluator_top"] in (True, None)
    assert py["default_evaluator_inside_dynamo"] in (True, False, None)
    cold = r["cold_caches"]
    measured = {"fx2xla_graph", "dlpack_import", "raw_execute", "inductor_call"}
    assert set(cold["hot_s"]) == measured
    assert set(cold["after"]) == {"dynamo_empty_call", "sweep_4MiB", "sweep_512KiB"}
    for after in cold["after"].values():
        assert set(after) == measured
        for cell in after.values():
            assert cell["pair_s"] > 0 and math.isfinite(cell["extra_s"])
