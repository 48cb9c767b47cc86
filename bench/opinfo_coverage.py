"""OpInfo coverage of fx2xla: how much of PyTorch's op_db compiles and matches eager.

    .venv/bin/python bench/opinfo_coverage.py               # the default test's cases and samples
    .venv/bin/python bench/opinfo_coverage.py --all-dtypes  # every op at every dtype, default samples
    .venv/bin/python bench/opinfo_coverage.py --full        # every sample (the opinfo_full sweep; hours)
    .venv/bin/python bench/opinfo_coverage.py --ops add,nn.functional.pad --dtypes float32 --samples 5

Runs the same cases as tests/opinfo/test_opinfo.py (every sample is run, not just up to the
first failure) and prints, per dtype, the share of OpInfo samples that pass and the share of
ops that pass all their samples, the most common failure causes, and the share of core ATen
overloads with a lowering rule (fx2xla.coverage). Skipped samples (see the test's docstring)
are counted separately, not as failures. Raw results go to bench/results/opinfo_coverage.json.
--regen merges the results into tests/opinfo/expected_failures.json, as FX2XLA_OPINFO_REGEN=1
does for the tests.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST_FILE = ROOT / "tests" / "opinfo" / "test_opinfo.py"


def _suite():
    """tests/opinfo/test_opinfo.py as a module (the cases, runner and skip lists live there)."""
    spec = importlib.util.spec_from_file_location("fx2xla_opinfo_suite", TEST_FILE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _selected(suite, all_dtypes: bool, ops: set | None, dtypes: set | None) -> list:
    cases = suite.all_cases() if all_dtypes or ops or dtypes else suite.default_cases()
    if ops:
        cases = [c for c in cases if suite.op_key(c.op) in ops or c.op.name in ops]
    if dtypes:
        cases = [c for c in cases if suite.dtype_name(c.dtype) in dtypes]
    return cases


def _worker(args) -> list[dict]:
    """Run the cases with these indices (in a fresh process for --jobs > 1)."""
    indices, max_samples, selection = args
    suite = _suite()
    cases = _selected(suite, *selection)
    out = []
    for i in indices:
        case = cases[i]
        t0 = time.perf_counter()
        results = suite.run_case(case, max_samples, stop_at_first_failure=False)
        out.append(dict(
            key=case.key, op=suite.op_key(case.op), dtype=suite.dtype_name(case.dtype),
            seconds=time.perf_counter() - t0,
            results=[dict(index=r.index, status=r.status, error=r.error) for r in results],
        ))
        print(f"  {out[-1]['op']:<45} {out[-1]['dtype']:<9} {out[-1]['seconds']:6.1f}s "
              + " ".join(r.status for r in results[:8]) + (" ..." if len(results) > 8 else ""), flush=True)
    return out


def _cause(error: str) -> str:
    """An error line with shapes, numbers and quoted values removed, for grouping."""
    e = re.sub(r"\(inputs: .*", "", error)
    e = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", e)  # numbers, not the 2 of fx2xla or _fft_r2c
    e = re.sub(r"'[^']*'", "'…'", e)
    e = re.sub(r"\[[^\]]*\]", "[…]", e)
    return e[:160]


def report(records: list[dict], core: tuple[int, int]) -> str:
    lines = []
    by_dtype: dict = collections.defaultdict(lambda: collections.Counter())
    ops_by_dtype: dict = collections.defaultdict(lambda: collections.Counter())
    causes: collections.Counter = collections.Counter()
    cause_ops: dict = collections.defaultdict(set)
    for r in records:
        stats = collections.Counter(s["status"] for s in r["results"])
        by_dtype[r["dtype"]].update(stats)
        by_dtype["all"].update(stats)
        compared = stats["pass"] + stats["fail"]
        if compared:
            kind = "pass" if stats["fail"] == 0 else "fail"
            ops_by_dtype[r["dtype"]][kind] += 1
            ops_by_dtype["all"][kind] += 1
        else:
            ops_by_dtype[r["dtype"]]["skip"] += 1
            ops_by_dtype["all"]["skip"] += 1
        for s in r["results"]:
            if s["status"] == "fail":
                c = _cause(s["error"])
                causes[c] += 1
                cause_ops[c].add(f"{r['op']}:{r['dtype']}")

    def pct(a, b):
        return f"{100 * a / b:5.1f}%" if b else "    -"

    lines.append(f"{'dtype':<10} {'samples pass':>22} {'skipped':>8}   {'ops pass all samples':>24} {'skipped':>8}")
    for d in ["float32", "bfloat16", "float16", "int64", "bool", "all"]:
        if d not in by_dtype:
            continue
        s, o = by_dtype[d], ops_by_dtype[d]
        ns, no = s["pass"] + s["fail"], o["pass"] + o["fail"]
        lines.append(f"{d:<10} {pct(s['pass'], ns)} ({s['pass']:>5}/{ns:<5}) {s['skip']:>8}   "
                     f"{pct(o['pass'], no)} ({o['pass']:>4}/{no:<4}) {o['skip']:>8}")
    lowered, total = core
    lines.append(f"core ATen overloads with a lowering rule: {pct(lowered, total)} ({lowered}/{total})")
    lines.append("")
    lines.append("top failure causes (failing samples; op:dtype examples):")
    for c, n in causes.most_common(40):
        ex = sorted(cause_ops[c])
        lines.append(f"  {n:5d}  {c}\n         {', '.join(ex[:6])}{' …' if len(ex) > 6 else ''} ({len(ex)} cases)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="every op, dtype and sample (default: the default test's cases)")
    p.add_argument("--all-dtypes", action="store_true", help="every op at every dtype (with the default samples)")
    p.add_argument("--regen", action="store_true", help="merge the results into expected_failures.json")
    p.add_argument("--samples", type=int, default=None, help="samples per (op, dtype) (overrides --full)")
    p.add_argument("--ops", default="", help="comma-separated op names / name.variant (default: all)")
    p.add_argument("--dtypes", default="", help="comma-separated dtypes (default: the test's)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "opinfo_coverage.json"))
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    # Before op_db is imported: it registers a few more overloads (as `python -m fx2xla ops` sees).
    from fx2xla.coverage import coverage

    lowered, missing = coverage()
    suite = _suite()
    max_samples = args.samples if args.samples is not None else (None if args.full else suite.DEFAULT_SAMPLES)
    ops = set(filter(None, args.ops.split(","))) or None
    dtypes = set(filter(None, args.dtypes.split(","))) or None
    selection = (args.all_dtypes or args.full, ops, dtypes)
    cases = _selected(suite, *selection)
    print(f"{len(cases)} (op, dtype) cases, {max_samples or 'all'} samples each, {args.jobs} job(s)", flush=True)
    if args.jobs > 1:
        import multiprocessing as mp

        # Round-robin so that slow op families spread over the workers.
        chunks = [list(range(j, len(cases), args.jobs)) for j in range(args.jobs)]
        with mp.get_context("spawn").Pool(args.jobs) as pool:
            parts = pool.map(_worker, [(c, max_samples, selection) for c in chunks])
        records = sorted((r for part in parts for r in part), key=lambda r: (r["op"], r["dtype"]))
    else:
        records = _worker((list(range(len(cases))), max_samples, selection))
    elapsed = time.perf_counter() - t0

    text = report(records, (len(lowered), len(lowered) + len(missing)))
    print()
    print(text)
    print(f"\n{len(cases)} cases in {elapsed:.0f} s")
    slow = sorted(records, key=lambda r: -r["seconds"])[:10]
    print("slowest: " + ", ".join(f"{r['op']}:{r['dtype']} {r['seconds']:.1f}s" for r in slow))
    if args.regen:
        suite.regenerate({
            tuple(r["key"]): ([suite.SampleResult(**s) for s in r["results"]], max_samples) for r in records
        })
        print(f"merged into {suite.EXPECTED_FAILURES_PATH}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(max_samples=max_samples, seconds=elapsed, records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
