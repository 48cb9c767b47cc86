"""Where a tiny CUDA call spends its host time, stage by stage, and which stage blocks the host.

    PJRT_DEVICE=CUDA python3 bench/gpu_probe.py [--out probe.json]

For `x + 1` on 1024 floats: each stage of the per-call path (the stream order, the import, the
execute, the export, the whole call) timed alone (median of 300, µs), and timed once behind a
~0.1 s GPU kernel queued on torch's stream: a stage that takes ~0.1 s there waits for the GPU
(a host sync), which a stream-ordered hand-off must never do.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fx2xla  # noqa: F401  (registers the backend)
from fx2xla.metrics import live_graphs
from fx2xla.runtime import handoff


def median_us(fn, n=300):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def behind_long_kernel_ms(fn):
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    fn()
    dt = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return dt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    x = torch.zeros(1024, device="cuda")
    compiled = torch.compile(lambda x: x + 1, backend="fx2xla")
    compiled(x)
    torch.cuda.synchronize()
    graph = [g for g in live_graphs][-1]
    spec = graph._static
    dev = graph._jax_device
    imp = handoff.make_importer(platform="cuda")
    order = handoff.make_stream_order(platform="cuda")
    export = handoff.make_exporter(platform="cuda")
    public_export = handoff.make_exporter(True, platform="cuda")
    buf = imp(x, dev)
    arr = spec.exe.execute([buf])[0]
    stages = {
        "order": lambda: order(dev, 0),
        "import": lambda: imp(x, dev),
        "import_public": lambda: handoff.make_importer(True, platform="cuda")(x, dev),
        "execute_sharded": lambda: spec.exe.execute_sharded([buf]),
        "execute_public": lambda: spec.exe.execute([buf]),
        "launch(export)": lambda: spec.launch([buf]),
        "export_private": lambda: export(arr),
        "export_public": lambda: public_export(arr),
        "call": lambda: compiled(x),
        "torch_x+1": lambda: x + 1,
    }
    res = {}
    for name, fn in stages.items():
        try:
            res[name] = {"median_us": round(median_us(fn), 2), "behind_long_kernel_ms": round(behind_long_kernel_ms(fn), 3)}
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"{name:18s} {res[name]}", flush=True)
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
