"""Where a model's compiled call spends its time, called back to back: fx2xla and Inductor in one run.

    .venv/bin/python bench/call_split.py [--models tiny,cnn,mlp] [--rounds 9] [--calls 60]

Each backend is wrapped so that the callable it hands Dynamo is timed on its own. Per call:
- `outside`: the whole compiled call less that callable: Dynamo's guards and frame, and the
  wrappers between them and the backend. Both backends pay it; how long it takes depends on
  what the call before left in the caches.
- `inside`: the backend's callable. fx2xla's is split further:
  - `import`: the inputs' hand-off (resident weights checked, small fresh inputs copied into
    their staging buffers, the others imported over DLPack), `metrics()["import_seconds"]`;
  - `execute`: the launch and the export of its results, `metrics()["execute_seconds"]` (both
    kept because this sets FX2XLA_TIME_EXECUTE=1 before compiling);
  - `other`: the rest of `inside`: fx2xla's Python around them (the traceback pause, the check
    for torch's spinning workers, the plan's bookkeeping).
- `release`: dropping the call's results (each fx2xla result is a torch tensor over an XLA buffer).

Each contender's result is compared with eager's on the same inputs first (max |err|, printed
and stored).

Wall time, and this thread's CPU time for `outside` (a thread that is descheduled while its
wall time runs would show here). Contenders alternate by round; medians over rounds. Writes
bench/results/call_split.json.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

os.environ["FX2XLA_TIME_EXECUTE"] = "1"  # read when a graph's executor is made

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from harness import write_json  # noqa: E402

import fx2xla  # noqa: E402,F401  (registers the backend)
from fx2xla.metrics import live_graphs, metrics  # noqa: E402
from fx2xla.testing import ModelCase, model_cases  # noqa: E402

_clock, _cpu = time.perf_counter, time.thread_time


class Tiny(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1


TINY = ModelCase("tiny", Tiny, lambda: (torch.randn(4),))  # the tiny call of bench/inference.py


class Timed:
    """A backend whose callables are timed: wall and this thread's CPU seconds spent inside them."""

    def __init__(self, name: str):
        from torch._dynamo.backends.registry import lookup_backend

        self.backend = lookup_backend(name)
        self.wall = self.cpu = 0.0

    def __call__(self, gm, example_inputs):
        inner = self.backend(gm, example_inputs)

        def call(*a):
            t, c = _clock(), _cpu()
            try:
                return inner(*a)
            finally:
                self.wall += _clock() - t
                self.cpu += _cpu() - c

        call._boxed_call = getattr(inner, "_boxed_call", False)
        return call


def split(case, rounds: int, calls: int) -> dict:
    torch.manual_seed(0)
    model = case.build().eval()
    inputs = case.make_inputs()
    timed = {"fx2xla": Timed("fx2xla"), "inductor": Timed("inductor")}
    before = set(live_graphs)
    compiled = {k: torch.compile(copy.deepcopy(model), backend=b) for k, b in timed.items()}
    samples: dict = {}

    def add(key, value):
        samples.setdefault(key, []).append(value)

    with torch.no_grad():
        for fn in compiled.values():
            for _ in range(3):
                fn(*inputs)
        graphs = [g for g in live_graphs if g not in before]
        expected = model(*inputs)
        errors = {f"{k}.max_abs_err": (fn(*inputs) - expected).abs().max().item() for k, fn in compiled.items()}
        for _ in range(rounds):
            for name, fn in compiled.items():
                for _ in range(3):
                    fn(*inputs)
                t = timed[name]
                t.wall = t.cpu = 0.0
                m0 = metrics()
                w, c = _clock(), _cpu()
                for _ in range(calls):
                    fn(*inputs)
                w, c = (_clock() - w) / calls, (_cpu() - c) / calls
                add(f"{name}.whole", w)
                add(f"{name}.inside", t.wall / calls)
                add(f"{name}.outside", w - t.wall / calls)
                add(f"{name}.outside_cpu", c - t.cpu / calls)
                if name == "fx2xla":
                    m1 = metrics()
                    ex = (m1["execute_seconds"] - m0["execute_seconds"]) / calls
                    im = (m1["import_seconds"] - m0["import_seconds"]) / calls
                    add("fx2xla.import", im)
                    add("fx2xla.execute", ex)
                    add("fx2xla.other", t.wall / calls - ex - im)
                    release = 0.0
                    for _ in range(calls):
                        out = fn(*inputs)
                        r = _clock()
                        del out
                        release += _clock() - r
                    add("fx2xla.release", release / calls)
    return {k: statistics.median(v) for k, v in samples.items()} | errors | {"graphs": len(graphs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,cnn,mlp")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "call_split.json"))
    a = p.parse_args()
    cases = {c.name: c for c in model_cases()} | {"tiny": TINY}
    unknown = [m for m in a.models.split(",") if m not in cases]
    if unknown:
        p.error(f"unknown models {unknown}; choose from {sorted(cases)}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; per call, medians of {a.rounds} rounds "
          f"of {a.calls} back-to-back calls (us)")
    print(f"{'model':8s} {'contender':9s} {'whole':>9s} {'outside':>9s} {'(cpu)':>8s} {'inside':>9s} "
          f"{'import':>8s} {'execute':>9s} {'other':>8s} {'release':>8s}")
    results = {}
    for m in a.models.split(","):
        r = split(cases[m], a.rounds, a.calls)
        results[m] = r
        for who in ("fx2xla", "inductor"):
            cells = [r[f"{who}.{k}"] * 1e6 if f"{who}.{k}" in r else None
                     for k in ("whole", "outside", "outside_cpu", "inside", "import", "execute", "other", "release")]
            print(f"{m:8s} {who:9s} " + " ".join(f"{'-' if v is None else format(v, '.1f'):>{w}s}"
                                             for v, w in zip(cells, (9, 9, 8, 9, 8, 9, 8, 8))))
        print(f"{m:8s} fx2xla ÷ Inductor: whole {r['fx2xla.whole'] / r['inductor.whole']:.2f}, "
              f"inside {r['fx2xla.inside'] / r['inductor.inside']:.2f}; max |err| against eager: fx2xla "
              f"{r['fx2xla.max_abs_err']:.1e}, Inductor {r['inductor.max_abs_err']:.1e}")
    write_json(a.out, {"models": results, "rounds": a.rounds, "calls": a.calls, "torch": torch.__version__})
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
