"""Scan-folding: compile time and latency of folded vs unrolled layer stacks, in one run.

For GPT-2 configs (hidden 256, 4 heads) of 4, 12, 24 and 48 layers, compiled with
backend="fx2xla" with `scan_folding` on (one loop; `scan_min_layers` 2, so that every depth
folds) and off (unrolled):
  backend   the backend's own compile time, FX graph in, executable out: graph passes +
            lowering to StableHLO + XLA compile (fx2xla.metrics() deltas)
  first     the end-to-end first call (Dynamo and AOTAutograd tracing included)
            (compile figures are medians of --repeats fresh compiles, default 3)
  frontend  first - backend - one steady call: Dynamo + AOTAutograd tracing
  region    the first call again, folded, with the GPT-2 block marked as a
            `torch.compiler.nested_compile_region`: AOTAutograd then traces the block once
            instead of once per layer (Dynamo still steps through every call), and the pass
            folds the region's calls
  marked    the same with `fx2xla.scan_layers(model)` marking the model's layer stack instead
            of editing GPT2Block (one region per layer class, arguments passed flat)
  latency   steady-state median per call, folded and unrolled interleaved in rounds (the
            order alternates between rounds), with a third contender, folded with the
            torch_kernels kind "stacked_matmul" off (`copied`: each iteration copies its layer's
            weights out of the stacks for XLA's dots, instead of torch's gemm reading them in
            place)
The disk cache is off, so every compile is real. With matplotlib installed (`make bench`
installs it) a PNG of compile time and latency against depth is written next to the JSON.

    .venv/bin/python bench/scan.py [--layers 4 12 24 48] [--train] [--json bench/results/scan.json]

--train measures one training step (forward + backward) instead of inference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["FX2XLA_CACHE_DIR"] = ""  # measure compiles, not disk loads

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import fmt_time, interleaved_medians, write_json  # noqa: E402

import fx2xla  # noqa: E402
from fx2xla.runtime import executable_cache  # noqa: E402
from fx2xla.testing import LogitsOnly, gpt2, token_ids  # noqa: E402


def _backend_seconds() -> float:
    m = fx2xla.metrics()
    return sum(m["pass_seconds"].values()) + m["lower_seconds"] + m["compile_seconds"]


def measure(layers: int, fold: bool, ids, train: bool, region: bool = False, marked: bool = False,
            copied: bool = False):
    import transformers.models.gpt2.modeling_gpt2 as modeling_gpt2

    block = modeling_gpt2.GPT2Block
    forward = block.forward
    if region:
        block.forward = torch.compiler.nested_compile_region(forward)
    try:
        return _measure(layers, fold, ids, train, marked, copied)
    finally:
        block.forward = forward


def _measure(layers: int, fold: bool, ids, train: bool, marked: bool = False, copied: bool = False):
    # Every compile is real: the region variant lowers to the very module the plain folded
    # one does, which the in-memory executable cache would otherwise hand back.
    executable_cache.clear()
    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=layers))
    model.train(False)  # no dropout: training steps are deterministic and foldable
    if marked:
        fx2xla.scan_layers(model)
    torch._dynamo.reset()
    options = {"scan_folding": fold, "scan_min_layers": 2}
    if copied:  # each iteration copies its layer's weights out of the stacks for XLA's dots
        options["torch_kernels"] = [k for k in fx2xla.torch_kernels.KINDS if k != "stacked_matmul"]
    compiled = torch.compile(model, backend="fx2xla", fullgraph=True, options=options)

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


def plot(rows: list, mode: str, path: str) -> bool:
    """Compile time and latency against depth as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    layers = [r["layers"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in (("backend_unroll", "backend compile, unrolled", "o--"),
                              ("backend_fold", "backend compile, folded", "o-"),
                              ("first_unroll", "first call, unrolled", "s--"),
                              ("first_fold", "first call, folded", "s-"),
                              ("first_region", "first call, folded, nested_compile_region", "^-"),
                              ("first_marked", "first call, folded, scan_layers(model)", "v-")):
        if all(key in r for r in rows):
            a.plot(layers, [r[key] for r in rows], style, label=label)
    a.set(xlabel="layers", ylabel="seconds", title=f"GPT-2 compile time ({mode})")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    b.plot(layers, [r["latency_fold"] / r["latency_unroll"] for r in rows], "o-", label="folded / unrolled")
    b.axhline(1.10, color="r", ls=":", label="target 1.10")
    b.axhline(1.0, color="k", lw=0.5)
    b.set(xlabel="layers", ylabel="latency ratio", title="steady-state latency, folded / unrolled")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12, 24, 48])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--repeats", type=int, default=3, help="compiles per variant and depth (medians)")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--json", default="bench/results/scan.json")
    args = ap.parse_args(argv)
    ids = token_ids(args.batch, args.seq)
    mode = "train step (fw+bw)" if args.train else "inference"
    print(f"GPT-2 hidden 256, batch {args.batch} x seq {args.seq}, {mode}; fx2xla folded vs unrolled")
    header = (f"{'layers':>6} | {'backend fold':>12} {'backend unroll':>14} {'ratio':>6} | "
              f"{'first fold':>10} {'first unroll':>12} {'first region':>12} {'first marked':>12} | {'frontend fold':>13} "
              f"{'frontend unroll':>15} | {'lat fold':>10} {'lat unroll':>10} {'fold/unroll':>11} {'copied/unroll':>13}")
    print(header)
    # Warm-up (imports, PJRT client, Dynamo's and jax's first-use costs), not measured.
    measure(2, True, ids, args.train)
    measure(2, False, ids, args.train)
    measure(2, True, ids, args.train, region=True)
    measure(2, True, ids, args.train, marked=True)
    rows = []
    for n in args.layers:
        runs = {"region": [], "marked": [], "fold": [], "unroll": []}
        variants = [("region", True, True, False), ("marked", True, False, True), ("fold", True, False, False),
                    ("unroll", False, False, False)]
        for r in range(args.repeats):  # compile times are medians over repeats, order rotated
            k = r % len(variants)
            for name, fold, region, marked in variants[k:] + variants[:k]:
                runs[name].append(measure(n, fold, ids, args.train, region=region, marked=marked))
        region, marked, folded, unrolled = ({**rs[-1], **{k: statistics.median(x[k] for x in rs)
                                                          for k in ("first", "backend", "frontend")}}
                                            for rs in runs.values())
        assert folded["folded"] == region["folded"] == marked["folded"] == 1 and unrolled["folded"] == 0, (
            folded["folded"], region["folded"], marked["folded"], unrolled["folded"])
        copied = measure(n, True, ids, args.train, copied=True)
        lat = interleaved_medians({"fold": folded["step"], "unroll": unrolled["step"], "copied": copied["step"]},
                                  (ids,), rounds=args.rounds, budget_s=90)
        row = {"layers": n, **{f"{k}_fold": folded[k] for k in ("backend", "first", "frontend")},
               **{f"{k}_unroll": unrolled[k] for k in ("backend", "first", "frontend")},
               "first_region": region["first"], "frontend_region": region["frontend"],
               "first_marked": marked["first"], "frontend_marked": marked["frontend"],
               "latency_fold": lat["fold"], "latency_unroll": lat["unroll"], "latency_fold_copied": lat["copied"]}
        rows.append(row)
        print(f"{n:>6} | {fmt_time(row['backend_fold']):>12} {fmt_time(row['backend_unroll']):>14} "
              f"{row['backend_unroll'] / row['backend_fold']:>6.2f} | {fmt_time(row['first_fold']):>10} "
              f"{fmt_time(row['first_unroll']):>12} {fmt_time(row['first_region']):>12} "
              f"{fmt_time(row['first_marked']):>12} | "
              f"{fmt_time(row['frontend_fold']):>13} {fmt_time(row['frontend_unroll']):>15} | "
              f"{fmt_time(lat['fold']):>10} {fmt_time(lat['unroll']):>10} {lat['fold'] / lat['unroll']:>11.2f} "
              f"{lat['copied'] / lat['unroll']:>13.2f}", flush=True)
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        print(f"folded backend compile, {last['layers']} vs {first['layers']} layers: "
              f"{last['backend_fold'] / first['backend_fold']:.2f}x (target <= 1.5x)")
        print(f"unrolled / folded backend compile at {last['layers']} layers: "
              f"{last['backend_unroll'] / last['backend_fold']:.2f}x (target >= 5x)")
    worst = max(rows, key=lambda r: r["latency_fold"] / r["latency_unroll"])
    print(f"latency folded / unrolled, worst depth ({worst['layers']} layers): "
          f"{worst['latency_fold'] / worst['latency_unroll']:.2f} (target <= 1.10)")
    last = rows[-1]
    print(f"Dynamo + AOTAutograd share of the folded first call at {last['layers']} layers: "
          f"{last['frontend_fold'] / last['first_fold']:.0%}; with nested_compile_region blocks the "
          f"first call is {last['first_fold'] / last['first_region']:.2f}x shorter, with scan_layers(model) "
          f"{last['first_fold'] / last['first_marked']:.2f}x; first call unrolled / folded: "
          f"{last['first_unroll'] / last['first_fold']:.2f}x, unrolled / marked: "
          f"{last['first_unroll'] / last['first_marked']:.2f}x (target >= 1.5x)")
    if args.json:
        write_json(args.json, {"mode": mode, "rows": rows})
        png = os.path.splitext(args.json)[0] + ".png"
        if plot(rows, mode, png):
            print(f"wrote {args.json} and {png}")
        else:
            print(f"wrote {args.json} (no plot: matplotlib is not installed; `make bench` installs it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
