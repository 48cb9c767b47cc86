"""bench/inference.py's tiny-call section runs on the CPU: it reports, for wall and CPU time,
a positive median for fx2xla, Inductor and the two jaxlib floors (a call that only executes, and
one that copies its input and launches: the script checks that one's result equals eager's
exactly and exits non-zero otherwise), and `fx2xla_over_jaxlib_minimal` as fx2xla's median less
the minimal call's."""
import math

from tests.conftest import run_bench


def test_tiny_call_floors(tmp_path):
    r, out = run_bench("inference.py", ["--models", "tiny", "--rounds", "1"], tmp_path / "i.json")
    for clock in ("wall", "cpu"):
        med = r["tiny"][clock]
        for k in ("fx2xla", "inductor", "jaxlib_minimal", "jaxlib_execute_only"):
            assert med[k] > 0, (clock, k)
        assert math.isclose(med["fx2xla_over_jaxlib_minimal"], med["fx2xla"] - med["jaxlib_minimal"], rel_tol=1e-9)
    assert "jaxlib_minimal" in out and "jaxlib_execute_only" in out
