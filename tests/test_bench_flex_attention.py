"""bench/flex_attention.py runs end to end on the CPU with a small configuration: eager's and
fx2xla's first calls, the wall-time figures (positive, finite; no kernel time off CUDA), the
ratios, fx2xla's output within float32 rounding of eager's (relative 1e-5 of its largest value),
and eager's and fx2xla's of a float64 truth (the same bound, and not 0: the truth is float64),
nothing compiled while timing, in every phase (two masks, two lengths; each phase compiles
afresh, so Dynamo's recompile limit, even at 1, is never reached); training phases are refused
on the CPU with a clear message unless `--cpu-training` lifts torch's refusal."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "flex_attention.py"


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "XLA_FLAGS")}


def test_flex_attention_bench_runs_on_cpu(tmp_path):
    out = tmp_path / "flex.json"
    args = ["--device", "cpu", "--seqs", "128,192", "--heads", "4", "--kv-heads", "2", "--dim", "16",
            "--masks", "causal,document", "--contenders", "eager,fx2xla", "--rounds", "3", "--queued", "2",
            "--phase-budget", "1", "--out", str(out)]
    # Dynamo's recompile limit at 1: each phase compiles afresh (its first call is a first call),
    # so the phases' new masks and shapes never exhaust the limit of the function they share.
    wrapper = ("import runpy, sys, torch._dynamo\n"
               "torch._dynamo.config.recompile_limit = 1\n"
               f"sys.argv = {[str(BENCH)] + args!r}\n"
               f"runpy.run_path({str(BENCH)!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", wrapper], capture_output=True, text=True, timeout=900,
                          env=_env(), cwd=BENCH.parent.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert list(r["phases"]) == [f"infer {m} {s}" for s in (128, 192) for m in ("causal", "document")]
    for key, phase in r["phases"].items():
        assert set(phase["contenders"]) == {"eager", "fx2xla"}, key
        for name, c in phase["contenders"].items():
            assert "error" not in c, (key, name, c)
            for fig in ("first_s", "synced_s", "queued_s"):
                assert isinstance(c[fig], float) and math.isfinite(c[fig]) and c[fig] > 0, (key, name, fig, c)
            assert c["kernel_s"] is None
        assert phase["fx2xla_max_rel_err"] < 1e-5, (key, phase)
        for name in ("eager", "fx2xla"):  # both within float32 rounding of the float64 truth
            assert 0 < phase[f"{name}_max_rel_err_f64"] < 1e-5, (key, name, phase)
        assert phase["fx2xla_graphs_compiled_while_timing"] == 0, key
        assert phase["ratios"]["fx2xla/eager"]["synced"] > 0, key
        assert f"== {key}" in proc.stdout


def test_flex_attention_bench_refuses_training_on_cpu(tmp_path):
    root = BENCH.parent.parent
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu",
                           "--modes", "train", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=root)
    assert proc.returncode == 2 and "need CUDA" in proc.stderr, proc.stderr[-2000:]


def test_flex_attention_bench_trains_on_cpu_with_the_refusal_lifted(tmp_path):
    """`--cpu-training` lifts torch's refusal of flex_attention's backward on the CPU: the
    training phase (the compiled loss, its backward outside the compiled function) runs for eager
    and fx2xla, each with a first step and timed ones, nothing compiles while timing, and
    fx2xla's gradients of q, k and v are within float32 rounding of eager's (relative 1e-5 of
    the largest), and eager's and fx2xla's of the float64 truth's."""
    out = tmp_path / "train.json"
    args = [str(BENCH), "--device", "cpu", "--modes", "train", "--cpu-training", "--seqs", "384",
            "--heads", "4", "--kv-heads", "2", "--dim", "16", "--masks", "causal", "--contenders", "eager,fx2xla",
            "--rounds", "3", "--queued", "2", "--phase-budget", "1", "--out", str(out)]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=900, env=_env(),
                          cwd=BENCH.parent.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())["phases"]["train causal 384"]
    for name in ("eager", "fx2xla"):
        c = res["contenders"][name]
        assert "error" not in c, (name, c)
        assert all(math.isfinite(c[f]) and c[f] > 0 for f in ("first_s", "synced_s", "queued_s")), (name, c)
    assert res["fx2xla_graphs_compiled_while_timing"] == 0
    assert res["fx2xla_max_rel_err"] < 1e-5, res
    for name in ("eager", "fx2xla"):  # gradients within float32 rounding of the float64 truth's
        assert 0 < res[f"{name}_max_rel_err_f64"] < 1e-5, (name, res)
