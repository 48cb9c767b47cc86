"""bench/call_path.py runs on the CPU: it reports both timings of the nested Python calls, the
evaluator check at top level (CPython's default there), and for each measured call its hot time
and its time right after each of the three others, all positive."""
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_call_path_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "call_path.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "call_path.py"), "--rounds", "1", "--calls", "20",
                          "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
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
