"""bench/host_profile.py runs end to end on the CPU with one layer: it prints the median step,
the results handed back per step (a one-layer GPT-2 step writes 4 tensors per parameter in its
AdamW step: parameters, two moments, step counters) and cProfile's table."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_host_profile_runs_on_cpu():
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "host_profile.py"), "--layers", "1", "--steps", "2",
                           "--top", "5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = re.search(r"fx2xla on cpu: median step ([0-9.]+) ms", proc.stdout)
    assert step and float(step.group(1)) > 0, proc.stdout
    counts = re.search(r"results handed back per step: (\d+) \(written inputs: (\d+)\)", proc.stdout)
    assert counts, proc.stdout
    from fx2xla.testing import gpt2

    params = len(list(gpt2(layers=1, hidden=64, heads=4, vocab=1000, positions=64).parameters()))
    assert int(counts.group(2)) == 4 * params and int(counts.group(1)) > int(counts.group(2)), proc.stdout
    assert "tottime" in proc.stdout
