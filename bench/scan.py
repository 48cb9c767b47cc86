"""Scan-folding: compile time and latency of folded vs unrolled layer stacks, in one run.

For GPT-2 configs (hidden 256, 4 heads) of 4, 12, 24 and 48 layers, compiled with
backend="fx2xla" with `scan_folding` on (one loop; `scan_min_layers` 2, so that every depth
folds) and off (unrolled):
  backend   the backend's own compile time, FX graph in, executable out: graph passes +
            lowering to StableHLO + XLA compile (fx2xla.metrics() deltas)
  first     the end-to-end first call (Dynamo and AOTAutograd tracing included)
  frontend  first - backend - one steady call: Dynamo + AOTAutograd tracing
  latency   steady-state median per call, folded and unrolled interleaved in rounds
The disk cache is off, so every compile is real.

    .venv/bin/python bench/scan.py [--layers 4 12 24 48] [--train] [--json bench/results/scan.json]

--train measures one training step (forward + backward) instead of inference.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["FX2XLA_CACHE_DIR"] = ""  # measure compiles, not disk loads

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import fmt_time, interleaved_medians, write_json  # noqa: E402

import fx2xla  # noqa: E402
from fx2xla.testing import LogitsOnly, gpt2, token_ids  # noqa: E402


def _backend_seconds() -> float:
    m = fx2xla.metrics()
    return sum(m["pass_seconds"].values()) + m["lower_seconds"] + m["compile_seconds"]


def measure(layers: int, fold: bool, ids, train: bool):
    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=layers))
    model.train(False)  # no dropout: training steps are deterministic and foldable
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fx2xla", fullgraph=True, options={"scan_folding": fold, "scan_min_layers": 2})

    def step(x):
        if not train:
            with torch.no_grad():
                return compiled(x)
        out = compiled(x)
        out.float().pow(2).mean().backward()
        return out

    folds0, backend0 = fx2xla.metrics()["scan_folds"], _backend_seconds()
    t0 = time.perf_counter()
    step(ids)
    first = time.perf_counter() - t0
    backend = _backend_seconds() - backend0
    folded = fx2xla.metrics()["scan_folds"] - folds0
    t0 = time.perf_counter()
    step(ids)
    steady = time.perf_counter() - t0
    return {"first": first, "backend": backend, "frontend": max(first - backend - steady, 0.0),
            "folded": folded, "step": step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12, 24, 48])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ids = token_ids(args.batch, args.seq)
    mode = "train step (fw+bw)" if args.train else "inference"
    print(f"GPT-2 hidden 256, batch {args.batch} x seq {args.seq}, {mode}; fx2xla folded vs unrolled")
    header = (f"{'layers':>6} | {'backend fold':>12} {'backend unroll':>14} {'ratio':>6} | "
              f"{'first fold':>10} {'first unroll':>12} | {'frontend fold':>13} {'frontend unroll':>15} | "
              f"{'lat fold':>10} {'lat unroll':>10} {'fold/unroll':>11}")
    print(header)
    # Warm-up (imports, PJRT client, Dynamo's and jax's first-use costs), not measured.
    measure(2, True, ids, args.train)
    measure(2, False, ids, args.train)
    rows = []
    for n in args.layers:
        folded = measure(n, True, ids, args.train)
        unrolled = measure(n, False, ids, args.train)
        assert folded["folded"] == 1 and unrolled["folded"] == 0, (folded["folded"], unrolled["folded"])
        lat = interleaved_medians({"fold": folded["step"], "unroll": unrolled["step"]}, (ids,),
                                  rounds=args.rounds, budget_s=60)
        row = {"layers": n, **{f"{k}_fold": folded[k] for k in ("backend", "first", "frontend")},
               **{f"{k}_unroll": unrolled[k] for k in ("backend", "first", "frontend")},
               "latency_fold": lat["fold"], "latency_unroll": lat["unroll"]}
        rows.append(row)
        print(f"{n:>6} | {fmt_time(row['backend_fold']):>12} {fmt_time(row['backend_unroll']):>14} "
              f"{row['backend_unroll'] / row['backend_fold']:>6.2f} | {fmt_time(row['first_fold']):>10} "
              f"{fmt_time(row['first_unroll']):>12} | {fmt_time(row['frontend_fold']):>13} "
              f"{fmt_time(row['frontend_unroll']):>15} | {fmt_time(lat['fold']):>10} "
              f"{fmt_time(lat['unroll']):>10} {lat['fold'] / lat['unroll']:>11.2f}", flush=True)
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"folded backend compile, {last['layers']} vs {first['layers']} layers: "
              f"{last['backend_fold'] / first['backend_fold']:.2f}x (target <= 1.5x)")
        print(f"unrolled / folded backend compile at {last['layers']} layers: "
              f"{last['backend_unroll'] / last['backend_fold']:.2f}x (target >= 5x)")
        print(f"Dynamo + AOTAutograd share of the folded first call at {last['layers']} layers: "
              f"{last['frontend_fold'] / last['first_fold']:.0%}")
    if args.json:
        write_json(args.json, {"mode": mode, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
