"""Which layout of a float32 weight XLA:CPU's dot reads faster, on this machine.

A CPU inference graph may import nn.Linear's weight ([out, in], read transposed) as a copy laid
out [in, out] (option `transposed_linear_weights`). Whether that pays depends on the machine's
kernels, not only on the shape: at 2-32 rows XLA:CPU's dot reads small weights (up to ~2 MiB)
[in, out] 1.1-2.4x faster on both CPUs measured, but a 16 MiB weight was 1.4-2.6x *slower* so
on an AVX2 EPYC and 1.1-1.8x faster on an AVX-512 one (docs/benchmarks.md). And the copy takes
the weight's memory again, which matters for large weights.

So weights up to `SMALL_WEIGHT_BYTES` are laid out [in, out] without asking; a larger one read by
more than `MAX_TIMED_ROWS` rows stays as torch holds it (at 64-512 rows the two layouts were
within ~15% on both machines); otherwise `prefer_kn` times both layouts once, in a small program
on the CPU client, and keeps the [in, out] copy only where it takes at most `MARGIN` of the time.
Answers are kept per process and on disk (`<FX2XLA_CACHE_DIR>/cpu-dot-layouts.json`, keyed by the
machine: CPU model and flags, usable cores, jaxlib version, XLA_FLAGS), so each shape is timed
once per machine (0.1-0.3 s).

The probe reads one weight, which stays in cache, as a small model's weights do between calls.
A model whose weights outgrow the cache reads them from memory, and there [in, out] gains less
or loses: at 8 rows on the AVX2 EPYC it lost by up to 16% (docs/benchmarks.md, "The decode
step at batch 8"; `time_layouts(copies=)` and `bench/dot_layout.py --read-mib` measure it).
A probe that read as many bytes as the graph did cost seconds of the first call for a gain
within that machine's noise, so it is not used.
"""
from __future__ import annotations

import json
import os
import platform
import threading
import time
import warnings

from .disk_cache import default_cache_dir, write_atomically

SMALL_WEIGHT_BYTES = 2 << 20  # [in, out] without timing: it won on every machine measured
MAX_TIMED_ROWS = 128  # beyond, a large weight stays as torch holds it: the layouts were within ~15%
MARGIN = 0.85  # a larger weight is relaid only where its dot takes at most this share of the time
FILE_NAME = "cpu-dot-layouts.json"

_lock = threading.Lock()  # one probe at a time: two at once would time each other
_known: dict[str, bool] = {}
_probes = 0


def probes_run() -> int:
    """How many shapes this process has timed (answers from memory or disk are not counted)."""
    return _probes


def forget() -> None:
    """Drop the answers kept in this process (the file on disk stays)."""
    with _lock:
        _known.clear()


def rows_bucket(rows: int) -> int:
    """Rows are timed at the next power of two (2..1024): one probe serves nearby batch sizes."""
    b = 2
    while b < rows and b < 1024:
        b *= 2
    return b


def machine() -> str:
    """What a timing depends on: CPU model and SIMD flags, usable cores, jaxlib, XLA_FLAGS."""
    import jaxlib

    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags":
                    flags = value.strip()
                    break
    except OSError:
        pass
    model = model or platform.processor()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    simd = " ".join(f for f in flags.split() if f.startswith(("avx", "amx", "fma", "sse4")))
    return "|".join([model, simd, f"cores={cores}", f"jaxlib={jaxlib.__version__}",
                     f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}"])


def _path() -> str | None:
    folder = default_cache_dir()
    return os.path.join(folder, FILE_NAME) if folder else None


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # absent, or unreadable: timed again and rewritten


def _write(path: str, here: str, shape: str, times: tuple[float, float]) -> None:
    data = _read(path)
    entries = data.get(here) if isinstance(data.get(here), dict) else {}
    entries[shape] = list(times)
    data[here] = entries
    try:
        write_atomically(path, json.dumps(data, indent=1, sort_keys=True).encode())
    except OSError as e:
        warnings.warn(f"fx2xla: cannot write {path}: {e}; the layout is timed again in the next process")


def time_layouts(rows: int, k: int, n: int, copies: int = 1) -> tuple[float, float]:
    """Seconds per dot of x[rows, k] with W laid out [n, k] (read transposed, as torch holds
    nn.Linear's weight) and [k, n], on the CPU client: medians of interleaved runs of two
    small programs, each a loop of about a millisecond or more. Each pass of the loop multiplies
    by `copies` distinct weights in turn: with one (prefer_kn's probe) the weight stays in cache,
    as a small model's do between calls; with enough to outgrow the cache it comes from memory
    each time, as a large model's do (bench/dot_layout.py --read-mib)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    cpu = jax.devices("cpu")[0]
    reps = int(min(64, max(1, round(2e7 / (2.0 * rows * k * n * copies)))))  # ~1 ms of dots per run at least
    # The values do not change a float32 dot's speed (finite, normal numbers): constants are the
    # cheapest to make at these sizes.
    x = jax.device_put(np.full((rows, k), 0.5, np.float32), cpu)
    weights = (tuple(jax.device_put(np.full((n, k), 0.25 / k, np.float32), cpu) for _ in range(copies)),
               tuple(jax.device_put(np.full((k, n), 0.25 / k, np.float32), cpu) for _ in range(copies)))

    def program(contract: int):
        def chain(x, ws):
            def step(i, acc):  # a new left operand for each dot: none is shared, merged or hoisted
                for j, w in enumerate(ws):
                    lhs = x + (i * len(ws) + j).astype(jnp.float32)
                    acc = acc + lax.dot_general(lhs, w, (((1,), (contract,)), ((), ())))
                return acc
            return lax.fori_loop(0, reps, step, jnp.zeros((rows, n), jnp.float32))
        return jax.jit(chain).lower(x, weights[0 if contract == 1 else 1]).compile()

    programs = (program(1), program(0))
    t0 = time.perf_counter()
    for p, w in zip(programs, weights):
        p(x, w).block_until_ready()
    warm = time.perf_counter() - t0
    times: tuple[list, list] = ([], [])
    for _ in range(7 if warm < 4e-3 else 5 if warm < 20e-3 else 3):  # a probe stays under ~0.3 s
        for j, (p, w) in enumerate(zip(programs, weights)):
            t0 = time.perf_counter()
            p(x, w).block_until_ready()
            times[j].append(time.perf_counter() - t0)
    nk, kn = (sorted(t)[len(t) // 2] / (reps * copies) for t in times)
    return nk, kn


def untimed_answer(rows: int, k: int, n: int) -> bool | None:
    """prefer_kn's answer where nothing is timed: True for weights up to SMALL_WEIGHT_BYTES,
    False for larger ones at more than MAX_TIMED_ROWS rows (rounded up); else None."""
    if k * n * 4 <= SMALL_WEIGHT_BYTES:
        return True
    return False if rows_bucket(max(int(rows), 1)) > MAX_TIMED_ROWS else None


def timed_answer(times: tuple[float, float]) -> bool:
    """prefer_kn's answer from (seconds [n, k], seconds [k, n]): [k, n] at most MARGIN of it."""
    return times[1] <= MARGIN * times[0]


def prefer_kn(rows: int, k: int, n: int) -> bool:
    """Whether a float32 dot of `rows` rows against a [n, k] weight should read the weight laid
    out [k, n] instead: always for weights up to SMALL_WEIGHT_BYTES, never for larger ones at
    more than MAX_TIMED_ROWS rows, else as timed on this machine (once per shape, at
    `rows_bucket(rows)` rows), where [k, n] takes at most MARGIN of the time."""
    global _probes
    untimed = untimed_answer(rows, k, n)
    if untimed is not None:
        return untimed
    rows = rows_bucket(max(int(rows), 1))
    shape = f"f32 {rows}x{k}x{n}"
    with _lock:
        if shape in _known:
            return _known[shape]
        path, here = _path(), machine()
        times = None
        if path is not None:
            stored = _read(path).get(here)
            entry = stored.get(shape) if isinstance(stored, dict) else None
            if isinstance(entry, list) and len(entry) == 2 and all(isinstance(t, (int, float)) and t > 0 for t in entry):
                times = (float(entry[0]), float(entry[1]))
        if times is None:
            times = time_layouts(rows, k, n)
            _probes += 1
            if path is not None:
                _write(path, here, shape, times)
        _known[shape] = answer = timed_answer(times)
        return answer
