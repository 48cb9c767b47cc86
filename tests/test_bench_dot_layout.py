"""bench/dot_layout.py runs on the CPU: every cell gets two positive times, and the layout it
reports is prefer_kn's rule (a weight up to 2 MiB: [in, out] from two rows on; one row never;
a larger one at more than 128 rows: as torch holds it)."""
import math

from tests.conftest import run_bench


def test_dot_layout_bench_runs_on_cpu(tmp_path):
    r, _ = run_bench("dot_layout.py", ["--rows", "1,2,256", "--shapes", "64x96,1024x640"], tmp_path / "dot_layout.json")
    assert r["machine"] and len(r["cells"]) == 6
    for c in r["cells"]:
        assert math.isfinite(c["out_in_s"]) and c["out_in_s"] > 0 and math.isfinite(c["in_out_s"]) and c["in_out_s"] > 0
    relaid = {(c["rows"], c["k"]): c["relaid"] for c in r["cells"]}
    assert relaid[(1, 64)] is False and relaid[(2, 64)] is True and relaid[(256, 64)] is True
    assert relaid[(1, 1024)] is False and relaid[(256, 1024)] is False
