"""Timing as BENCHMARKS.md asks: contenders interleaved in rounds, medians, ratios of medians."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable


def _materialise(out):
    # Read one element so an asynchronous executor cannot stop the clock early.
    import torch

    if isinstance(out, torch.Tensor):
        if out.numel():
            out.reshape(-1)[0].item()
    elif isinstance(out, (tuple, list)):
        for o in out:
            _materialise(o)
    elif hasattr(out, "values"):
        for o in out.values():
            _materialise(o)


def timed_call(fn: Callable, args: tuple) -> float:
    t0 = time.perf_counter()
    _materialise(fn(*args))
    return time.perf_counter() - t0


def interleaved_medians(contenders: dict[str, Callable], args: tuple, rounds: int = 15,
                        calls_per_round: int = 1, budget_s: float | None = None,
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each contender; contenders alternate within every round so
    machine drift hits all of them alike, and the order rotates from round to round so none
    always runs right after another's (cache and allocator state, a neighbour's burst).
    `budget_s` stops early (after ≥5 rounds). `clock`:
    wall time by default; `time.thread_time` counts only this thread's CPU time, which other
    processes on a loaded machine inflate far less (for single-threaded contenders)."""
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    start = time.perf_counter()
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = contenders[name]
            t0 = clock()
            for _ in range(calls_per_round):
                out = fn(*args)
            _materialise(out)
            samples[name].append((clock() - t0) / calls_per_round)
        if budget_s is not None and r >= 4 and time.perf_counter() - start > budget_s:
            break
    return {k: statistics.median(v) for k, v in samples.items()}


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:8.1f} us"
    if s < 1:
        return f"{s * 1e3:8.2f} ms"
    return f"{s:8.2f} s "
