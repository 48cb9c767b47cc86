"""A compiled call on the CPU right after eager torch work, against the same call alone.

    .venv/bin/python bench/cpu_threads.py [--models mlp,cnn,gpt2] [--calls 40]
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/cpu_threads.py     # torch's workers sleep at once
    FX2XLA_PARK_TORCH_THREADS=0 .venv/bin/python bench/cpu_threads.py # fx2xla does not park them
    FX2XLA_PARK_SIGNALS=0 .venv/bin/python bench/cpu_threads.py       # it parks them in a region

torch's OpenMP workers keep spinning on their cores for a while after each parallel region
(GNU OpenMP's default wait policy). XLA:CPU runs its executables on threads of its own, so a call
that starts while they spin shares the cores with them; Inductor's kernels run on the spinning
team itself. For each model this prints, for fx2xla and for Inductor, the median call alone
(back to back), right after an eager call of the model, and 10 ms after one, and writes
bench/results/cpu_threads.json. Run it once as is and once with OMP_WAIT_POLICY=PASSIVE to see
what the spinning costs each side. fx2xla parks the spinning workers during its long executables
(fx2xla.torch_kernels.run_parked); FX2XLA_PARK_TORCH_THREADS=0 shows the cost without that.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import write_json  # noqa: E402

import fx2xla  # noqa: E402,F401  (registers the backend)
from fx2xla import torch_kernels  # noqa: E402
from fx2xla.testing import model_cases  # noqa: E402


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def after_eager(call, eager, args, calls: int, pause_s: float | None) -> float:
    """Median seconds of `call`, each right after an eager call (pause None) or `pause_s`
    later."""
    times = []
    for _ in range(calls):
        eager(*args)
        if pause_s:
            time.sleep(pause_s)
        t0 = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - t0)
    return _median(times)


def alone(call, args, calls: int) -> float:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - t0)
    return _median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,cnn,gpt2")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_threads.json"))
    a = p.parse_args()
    policy = os.environ.get("OMP_WAIT_POLICY", "(unset)")
    parking = "on" if torch_kernels.parking_on() else "off"
    results = {"omp_wait_policy": policy, "torch_threads": torch.get_num_threads(), "parking": parking,
               "models": {}}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, OMP_WAIT_POLICY {policy}, "
          f"fx2xla parks torch's workers: {parking} (FX2XLA_PARK_TORCH_THREADS)")
    print(f"{'model':8s} {'contender':9s} {'alone':>9s} {'after eager':>12s} {'10 ms after':>12s} {'eager':>9s}")
    for case in model_cases():
        if case.name not in a.models.split(","):
            continue
        torch.manual_seed(0)
        model, args = case.build().eval(), case.make_inputs()
        row = {}
        with torch.no_grad():
            torch._dynamo.reset()
            for name, compiled in (("fx2xla", torch.compile(model, backend="fx2xla", fullgraph=True)),
                                   ("inductor", torch.compile(model, fullgraph=True))):
                compiled(*args)
                row[name] = {"alone_s": alone(compiled, args, a.calls),
                             "after_eager_s": after_eager(compiled, model, args, a.calls, None),
                             "after_eager_10ms_s": after_eager(compiled, model, args, a.calls, 0.01)}
            row["eager_alone_s"] = alone(model, args, a.calls)
        results["models"][case.name] = row
        for name in ("fx2xla", "inductor"):
            r = row[name]
            print(f"{case.name:8s} {name:9s} {r['alone_s'] * 1e3:7.2f}ms {r['after_eager_s'] * 1e3:10.2f}ms "
                  f"{r['after_eager_10ms_s'] * 1e3:10.2f}ms {row['eager_alone_s'] * 1e3:7.2f}ms")
    results["parked_calls"] = torch_kernels.parked_calls()
    results["signal_parked_calls"] = torch_kernels.signal_parked_calls()
    print(f"\nfx2xla calls parked: {results['parked_calls']}, by signal: {results['signal_parked_calls']} "
          "(FX2XLA_PARK_SIGNALS=0: in a parallel region instead)")
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
