"""Process start to first result: cold and warm torch.compile, fx2xla.load, and Inductor.

    .venv/bin/python bench/warmup.py [--models gpt2,llama] [--repeats 3]

Each measurement is a fresh Python process. The paths:
- "cold": torch.compile(backend="fx2xla") with an empty FX2XLA_CACHE_DIR;
- "warm": the same, reusing the folder the cold run filled (Dynamo and AOTAutograd trace again,
  the executable comes from the disk cache);
- "load": fx2xla.load of a package written once by fx2xla.export (no tracing, no lowering);
- "inductor": torch.compile's default backend, cold (its own caches pointed at an empty folder).
The paths run in rotating order within each repeat, so drift hits all. Prints medians of the
imports (torch, fx2xla: the same for every path, reported apart), the time from after the
imports to the first result (building the model included for the compile paths; the load
path builds none), and the whole process; ratios against the cold fx2xla first result; writes
raw numbers to bench/results/warmup.json.
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
import json, os, sys, time
t0 = time.perf_counter()
import torch, fx2xla
t1 = time.perf_counter()
mode, name = sys.argv[1], sys.argv[2]
from fx2xla.testing import token_ids
ids = token_ids(4, 128)
def build():
    from fx2xla.testing import LogitsOnly, gpt2, llama
    torch.manual_seed(0)
    return LogitsOnly({"gpt2": gpt2, "llama": llama}[name]()).eval()
with torch.no_grad():
    if mode == "export":
        fx2xla.export(build(), (ids,), sys.argv[3])
        out = None
    elif mode == "load":
        out = fx2xla.load(sys.argv[3])(ids)
    else:
        backend = "inductor" if mode == "inductor" else "fx2xla"
        out = torch.compile(build(), backend=backend, fullgraph=True)(ids)
    if out is not None:
        out[0, 0, 0].item()
t2 = time.perf_counter()
m = fx2xla.metrics()
print(json.dumps({"import_s": t1 - t0, "first_result_s": t2 - t1, "compiles": m["compiles"],
                  "disk_hits": m["disk_hits"], "graphs": m["graphs"]}))
"""

PATHS = ("cold", "warm", "load", "inductor")
# Rotating orders (warm reuses the cache cold filled, so it follows cold).
ORDERS = (("load", "cold", "warm", "inductor"), ("inductor", "cold", "warm", "load"), ("cold", "warm", "load", "inductor"))


def run_child(mode: str, model: str, cache_dir: str, package: str) -> dict:
    env = dict(os.environ, FX2XLA_CACHE_DIR=cache_dir, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache_dir, "triton"))
    child_mode = "compile" if mode in ("cold", "warm") else mode
    for attempt in range(2):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-c", CHILD, child_mode, model, package], env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        lines = r.stdout.strip().splitlines()
        if r.returncode == 0 and lines:
            res = json.loads(lines[-1])
            res["process_wall_s"] = wall
            res["failed_attempts"] = attempt
            return res
        # A child that died is reported, and run once more (a crash is not a timing).
        print(f"  {model} {mode}: the child process failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
    raise RuntimeError(f"{model} {mode}: the child process failed twice")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "warmup.json"))
    a = p.parse_args()
    results = {}
    print(f"{'model':8s} {'path':9s} {'imports':>8s} {'1st result':>11s} {'process':>9s} {'compiles':>9s} "
          f"{'disk hits':>9s} {'traced':>7s} {'÷ cold':>7s}")
    for model in a.models.split(","):
        work = tempfile.mkdtemp(prefix="fx2xla-warmup-")
        package = os.path.join(work, "package")
        try:
            t0 = time.perf_counter()
            run_child("export", model, os.path.join(work, "export-cache"), package)
            export_s = time.perf_counter() - t0
            runs = {k: [] for k in PATHS}
            for rep in range(a.repeats):
                folder = os.path.join(work, f"cache-{rep}")
                for mode in ORDERS[rep % len(ORDERS)]:
                    fresh = folder if mode in ("cold", "warm") else os.path.join(work, f"{mode}-{rep}")
                    runs[mode].append(run_child(mode, model, fresh, package))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
        cold = med["cold"]["first_result_s"]
        for k in PATHS:
            m = med[k]
            print(f"{model:8s} {k:9s} {m['import_s']:7.2f}s {m['first_result_s']:10.2f}s {m['process_wall_s']:8.2f}s "
                  f"{m['compiles']:9.0f} {m['disk_hits']:9.0f} {m['graphs']:7.0f} {m['first_result_s'] / cold:7.3f}")
        print(f"{model:8s} fx2xla.export (once): {export_s:.1f}s process")
        results[model] = {"runs": runs, "median": med, "export_process_s": export_s,
                          "first_result_over_cold": {k: med[k]["first_result_s"] / cold for k in PATHS}}
    write_json(a.out, results)
    print(f"raw numbers: {a.out}")


if __name__ == "__main__":
    main()
