"""Where a tiny call's time goes around fx2xla's own code: two effects of the machine and of Dynamo.

    .venv/bin/python bench/call_path.py [--rounds 5] [--calls 3000]

1. Python calls inside Dynamo's frame. A chain of 50 Python calls, timed at top level and inside
   the function a Dynamo-compiled call runs (a backend whose graph is that timing loop). Inside,
   CPython's frame evaluator is Dynamo's shim, not the default (printed, from
   `_PyInterpreterState_GetEvalFrameFunc` where ctypes finds it), so calls are not inlined.
2. Cold caches. fx2xla's compiled graph (x*2+1, called without Dynamo's frame), a jaxlib DLPack
   import and a raw PJRT execute, each timed hot in a loop and right after something else ran:
   Dynamo's empty call, or a NumPy sweep over 4 MiB or 512 KiB. Inductor's whole call likewise.
   "extra" is the pair's time less the two apart: what the interleaving costs.

This thread's CPU time, medians of `--rounds` rounds of `--calls` calls. Writes
bench/results/call_path.json.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import write_json  # noqa: E402

import fx2xla  # noqa: E402,F401  (registers the backend)
from fx2xla.metrics import live_graphs  # noqa: E402
from fx2xla.runtime import default_device  # noqa: E402
from fx2xla.runtime.handoff import import_tensor  # noqa: E402


def tiny(x):
    return x * 2 + 1


def chain(n: int) -> int:
    return n if n == 0 else chain(n - 1)


def default_evaluator() -> bool | None:
    """Whether CPython's frame evaluator is its default one now (None where ctypes cannot tell)."""
    try:
        api = ctypes.pythonapi
        api.PyInterpreterState_Get.restype = ctypes.c_void_p
        get = api._PyInterpreterState_GetEvalFrameFunc
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        default = ctypes.cast(api._PyEval_EvalFrameDefault, ctypes.c_void_p).value
        return get(api.PyInterpreterState_Get()) == default
    except (AttributeError, OSError):
        return None


def per_call(fn, calls: int) -> float:
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls


def python_calls_in_dynamo(rounds: int, calls: int) -> dict:
    inside: dict = {}

    def timing_loop(*args):
        inside["default_evaluator"] = default_evaluator()
        inside.setdefault("chain50", []).append(per_call(lambda: chain(50), calls))
        return (args[0],)

    compiled = torch.compile(tiny, backend=lambda gm, _: timing_loop, fullgraph=True)
    x = torch.randn(4)
    top = []
    for _ in range(rounds):
        compiled(x)
        top.append(per_call(lambda: chain(50), calls))
    return {"chain50_top_s": statistics.median(top), "chain50_inside_dynamo_s": statistics.median(inside["chain50"]),
            "default_evaluator_top": default_evaluator(), "default_evaluator_inside_dynamo": inside["default_evaluator"]}


def cold_caches(rounds: int, calls: int) -> dict:
    x = torch.randn(4)
    torch._dynamo.reset()
    before = set(live_graphs)
    torch.compile(tiny, backend="fx2xla", fullgraph=True)(x)
    (graph,) = [g for g in live_graphs if g not in before]
    device = default_device().jax_device
    buf = import_tensor(x, device)
    exe = graph.static.exe
    empty = torch.compile(lambda y: y * 2 + 1, backend=lambda gm, _: (lambda *a: (a[0],)), fullgraph=True)
    inductor = torch.compile(lambda y: y * 2 + 1, fullgraph=True)
    empty(x), inductor(x)
    big, small = np.ones(1 << 20, np.float32), np.ones(1 << 17, np.float32)
    before_calls = {"dynamo_empty_call": lambda: empty(x), "sweep_4MiB": big.sum, "sweep_512KiB": small.sum}
    measured = {"fx2xla_graph": lambda: graph.call_unboxed(x), "dlpack_import": lambda: import_tensor(x, device),
                "raw_execute": lambda: exe.execute([buf]), "inductor_call": lambda: inductor(x)}
    samples: dict = {}
    for _ in range(rounds):
        for name, fn in list(before_calls.items()) + list(measured.items()):
            per_call(fn, 100)
            samples.setdefault(name, []).append(per_call(fn, calls))
        for b, bf in before_calls.items():
            for m, mf in measured.items():
                samples.setdefault(f"{b}+{m}", []).append(per_call(lambda: (bf(), mf()), calls))
    med = {k: statistics.median(v) for k, v in samples.items()}
    out = {"hot_s": {m: med[m] for m in measured}, "alone_s": {b: med[b] for b in before_calls}, "after": {}}
    for b in before_calls:
        out["after"][b] = {m: {"pair_s": med[f"{b}+{m}"], "extra_s": med[f"{b}+{m}"] - med[b] - med[m]} for m in measured}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "call_path.json"))
    a = p.parse_args()
    us = 1e6
    py = python_calls_in_dynamo(a.rounds, a.calls)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    print(f"\n50 nested Python calls: top level {py['chain50_top_s'] * us:.2f} us, inside Dynamo's frame "
          f"{py['chain50_inside_dynamo_s'] * us:.2f} us (x{py['chain50_inside_dynamo_s'] / py['chain50_top_s']:.2f}); "
          f"CPython's default evaluator: top level {py['default_evaluator_top']}, inside {py['default_evaluator_inside_dynamo']}")
    cold = cold_caches(a.rounds, a.calls)
    print("\nthis thread's CPU time per call (us): hot, and right after each of the others (extra = pair - both alone)")
    print(f"{'':16s} {'hot':>8s}" + "".join(f" {b + ' (' + format(cold['alone_s'][b] * us, '.1f') + ')':>34s}"
                                              for b in cold["alone_s"]))
    for m, hot in cold["hot_s"].items():
        cells = "".join(f" {'+' + format(cold['after'][b][m]['extra_s'] * us, '.1f'):>34s}" for b in cold["alone_s"])
        print(f"{m:16s} {hot * us:8.1f}{cells}")
    write_json(a.out, {"python_calls": py, "cold_caches": cold, "rounds": a.rounds, "calls": a.calls})
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
