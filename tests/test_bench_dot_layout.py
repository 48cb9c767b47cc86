"""bench/dot_layout.py runs on the CPU: every cell gets two positive times, and the layout it
reports is prefer_kn's rule (a weight up to 2 MiB: [in, out] from two rows on; one row never;
a larger one at more than 128 rows: as torch holds it); with --read-mib, each cell reads the
number of distinct weights that makes about that much, and its times stay positive."""
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


def test_dot_layout_bench_reads_distinct_weights(tmp_path):
    # 64 x 96 float32 is 24 KiB: 0.1 MiB is about 4 of them; 1024 x 640 (2.5 MiB) stays one.
    r, _ = run_bench("dot_layout.py", ["--rows", "8", "--shapes", "64x96,1024x640", "--read-mib", "0.1"],
                     tmp_path / "dot_layout.json")
    assert r["read_mib"] == 0.1
    assert [(c["k"], c["copies"]) for c in r["cells"]] == [(64, 4), (1024, 1)]
    for c in r["cells"]:
        assert math.isfinite(c["out_in_s"]) and c["out_in_s"] > 0 and math.isfinite(c["in_out_s"]) and c["in_out_s"] > 0
