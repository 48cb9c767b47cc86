"""bench/host_memory.py runs end to end on the CPU with one small model: a child process per
setting, fx2xla's thresholds set in one (`metrics()`'s status), left to glibc in another, and
(`--no-pad`) given in the environment without the top pad in a third (fx2xla then sets nothing),
the compiled Linear within 1e-4 of eager's result (float32, a 256-term dot) in each, and
finite times, fault counts and system times for all three contenders."""
import math

from tests.conftest import run_bench


def test_host_memory_bench_runs(tmp_path):
    r, printed = run_bench("host_memory.py", ["--models", "linear", "--pairs", "1", "--rounds", "2", "--no-pad"],
                           tmp_path / "hm.json", timeout=900)
    runs = r["models"]["linear"]["runs"]
    assert runs["set"][0]["host_malloc"].startswith("set: mmap threshold 32 MiB")
    assert runs["glibc"][0]["host_malloc"] == "off: FX2XLA_MALLOC_TUNING=0"
    assert runs["no_pad"][0]["host_malloc"].startswith("left to the user: MALLOC_")
    for setting, (run,) in runs.items():
        assert run["fx2xla_max_abs_diff_vs_eager"] < 1e-4, (setting, run)
        for label in ("eager", "inductor", "fx2xla"):
            assert math.isfinite(run["medians_ms"][label]) and run["medians_ms"][label] > 0
            counts = run["counts"][label]
            assert counts["faults_per_call"] >= 0 and counts["system_ms_per_call"] >= 0
    summary = r["models"]["linear"]["summary"]
    assert set(summary) == {"set", "glibc", "no_pad"}
    assert "medians over pairs, set / glibc / no_pad" in printed
