"""Process start to first result, cold vs warm disk cache, for GPT-2 and LLaMA configs.

    .venv/bin/python bench/warmup.py [--models gpt2,llama] [--repeats 3]

Each measurement is a fresh Python process; "cold" starts with an empty FX2XLA_CACHE_DIR, "warm"
reuses the folder the cold run filled. Cold and warm alternate, so drift hits both. Prints the
medians of: whole process wall time, time to first result (inside the process: torch.compile's
first call), and the backend's compile step (XLA compile, or the executable loaded from disk);
writes raw numbers to bench/results/warmup.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from harness import write_json  # noqa: E402

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, fx2xla
from fx2xla.testing import LogitsOnly, gpt2, llama, token_ids
model = LogitsOnly({"gpt2": gpt2, "llama": llama}[sys.argv[1]]()).eval()
ids = token_ids(4, 128)
t1 = time.perf_counter()
with torch.no_grad():
    out = torch.compile(model, backend="fx2xla", fullgraph=True)(ids)
    out[0, 0, 0].item()
t2 = time.perf_counter()
m = fx2xla.metrics()
print(json.dumps({"setup_s": t1 - t0, "first_result_s": t2 - t1,
                  "compile_step_s": m["compile_seconds"] + m["disk_load_seconds"],
                  "lower_s": m["lower_seconds"], "compiles": m["compiles"], "disk_hits": m["disk_hits"]}))
"""


def run_child(model: str, cache_dir: str) -> dict:
    env = dict(os.environ, FX2XLA_CACHE_DIR=cache_dir)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, model], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = wall
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "warmup.json"))
    a = p.parse_args()
    results = {}
    print(f"{'model':8s} {'':5s} {'process':>9s} {'1st result':>11s} {'compile step':>13s} {'compiles':>9s} {'disk hits':>9s}")
    for model in a.models.split(","):
        runs = {"cold": [], "warm": []}
        for _ in range(a.repeats):
            folder = tempfile.mkdtemp(prefix="fx2xla-warmup-")
            try:
                runs["cold"].append(run_child(model, folder))
                runs["warm"].append(run_child(model, folder))
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
        for k in ("cold", "warm"):
            m = med[k]
            print(f"{model:8s} {k:5s} {m['process_wall_s']:8.2f}s {m['first_result_s']:10.2f}s "
                  f"{m['compile_step_s']:12.3f}s {m['compiles']:9.0f} {m['disk_hits']:9.0f}")
        ratio = med["warm"]["compile_step_s"] / med["cold"]["compile_step_s"]
        first = med["warm"]["first_result_s"] / med["cold"]["first_result_s"]
        print(f"{model:8s} warm/cold: compile step {ratio:.3f}, first result {first:.2f}, "
              f"process {med['warm']['process_wall_s'] / med['cold']['process_wall_s']:.2f}")
        results[model] = {"runs": runs, "median": med, "compile_step_warm_over_cold": ratio,
                          "first_result_warm_over_cold": first}
    write_json(a.out, results)
    print(f"raw numbers: {a.out}")


if __name__ == "__main__":
    main()
