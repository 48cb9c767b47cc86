"""Timing as BENCHMARKS.md asks: contenders interleaved in rounds, medians, ratios of medians."""
from __future__ import annotations

import json
import os
import statistics
import time
from typing import Callable


def materialise(out):
    """Wait for `out` (a tensor, or tuples, lists and dicts of them) to be computed."""
    # Read one element so an asynchronous executor cannot stop the clock early.
    import torch

    if isinstance(out, torch.Tensor):
        if out.numel():
            out.reshape(-1)[0].item()
    elif isinstance(out, (tuple, list)):
        for o in out:
            materialise(o)
    elif hasattr(out, "values"):
        for o in out.values():
            materialise(o)


def timed_call(fn: Callable, args: tuple) -> float:
    t0 = time.perf_counter()
    materialise(fn(*args))
    return time.perf_counter() - t0


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design: n orders of n contenders (2n when n is odd) in which each contender
    runs first equally often and right after each other one equally often."""
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(x + r) % n for x in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def interleaved_medians(contenders: dict[str, Callable], args: tuple, rounds: int = 15,
                        calls_per_round: int = 1, budget_s: float | None = None,
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each contender; contenders alternate within every round so
    machine drift hits all of them alike, and the rounds cycle through a balanced set of orders
    (`balanced_orders`), so each runs right after each other one equally often. (A plain rotation
    does not: with [eager, A, B] it puts A after eager twice as often as B, and right after
    eager's OpenMP threads, still spinning, take the cores from XLA's, the same executable ran
    10-25% slower.)
    `budget_s` stops early (after ≥5 rounds). `clock`:
    wall time by default; `time.thread_time` counts only this thread's CPU time, which other
    processes on a loaded machine inflate far less (for single-threaded contenders)."""
    return _medians(contenders, args, rounds, calls_per_round, budget_s, clock, warm=False)


def back_to_back_medians(contenders: dict[str, Callable], args: tuple, rounds: int = 15, calls: int = 5,
                         budget_s: float | None = None, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each contender called back to back, as a loop of requests
    calls one model: in every round (the balanced orders of interleaved_medians) each contender
    runs once untimed, so that nothing of the contender before it is left (its OpenMP workers
    spinning, or its own asleep), then `calls` times in a row, timed together. interleaved_medians
    times single calls that each follow another contender's, which costs a compiler whose kernels
    run on torch's OpenMP team (eager, Inductor) more than fx2xla: its workers must wake, or share
    the cores with XLA's threads. `budget_s` stops early (after ≥5 rounds)."""
    return _medians(contenders, args, rounds, calls, budget_s, clock, warm=True)


def _medians(contenders: dict[str, Callable], args: tuple, rounds: int, calls: int, budget_s: float | None,
             clock: Callable[[], float], warm: bool) -> dict[str, float]:
    """Rounds in balanced orders; per round and contender, one untimed call first where `warm`,
    then `calls` calls timed together. Medians of the seconds per call."""
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    start = time.perf_counter()
    names = list(contenders)
    orders = [[names[i] for i in row] for row in balanced_orders(len(names))]
    for r in range(rounds):
        for name in orders[r % len(orders)]:
            fn = contenders[name]
            if warm:
                materialise(fn(*args))
            t0 = clock()
            for _ in range(calls):
                out = fn(*args)
            materialise(out)
            samples[name].append((clock() - t0) / calls)
        if budget_s is not None and r >= 4 and time.perf_counter() - start > budget_s:
            break
    return {k: statistics.median(v) for k, v in samples.items()}


def _under(fn: Callable, setting: str, on: bool | str = False) -> Callable:
    """`fn` with the process-wide fx2xla.torch_kernels `setting(on)` for each call: the same
    executable, so interleaving it with `fn` compares only that setting."""
    from fx2xla import torch_kernels

    context = getattr(torch_kernels, setting)

    def call(*args):
        with context(on):
            return fn(*args)
    return call


def unsliced(fn: Callable) -> Callable:
    """`fn` with torch's convolution kernels run on whole batches (batch_slicing(False))."""
    return _under(fn, "batch_slicing")


def served(fn: Callable, how: bool | str = True) -> Callable:
    """`fn` with the main thread serving the matmul and convolution handlers' work on torch's
    team (serving(True)), not sliced on XLA's threads; `how="auto"`: each executable serves or
    not as its first main-thread calls found faster."""
    return _under(fn, "serving", how)


def unpacked(fn: Callable) -> Callable:
    """`fn` with torch's convolutions reordering their weights on every call instead of using
    the packed copies (weight_packing(False))."""
    return _under(fn, "weight_packing")


def copied_out(fn: Callable) -> Callable:
    """`fn` with convolutions on packed weights computed into a tensor of torch's and copied
    into XLA's buffer instead of written there (in_place_writes(False))."""
    return _under(fn, "in_place_writes")


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
