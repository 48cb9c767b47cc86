"""XLA:CPU's float32 dot with nn.Linear's weight as torch holds it ([out, in], read transposed)
against the weight laid out [in, out], on this machine, over rows and weight shapes.

    .venv/bin/python bench/dot_layout.py [--rows 1,2,4,8,16,32,64,128] [--read-mib 0]
        [--out bench/results/dot_layout.json]

Each cell is `fx2xla.runtime.dot_layout.time_layouts` (what CPU inference graphs time once per
machine for weights over 2 MiB, option transposed_linear_weights): medians of interleaved runs of
two small programs, one dot each in a loop. Prints [in, out] time ÷ [out, in] time, and what
`prefer_kn` would answer for the cell (weights up to 2 MiB: always; larger ones: at most
MARGIN of the time, at up to MAX_TIMED_ROWS rows).

`--read-mib M`: each pass of the loop reads distinct weights of the cell's shape, as many as make
about M MiB (a power of two, 1 to 32 of them), instead of one weight again and again: the weights
come from memory once M outgrows the cache, as a model's do when its weights do (prefer_kn still
times one weight; docs/benchmarks.md says what the two give).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from harness import write_json  # noqa: E402

from fx2xla.runtime import dot_layout  # noqa: E402

SHAPES = [(256, 688), (688, 256), (256, 1000), (768, 768), (768, 3072), (3072, 768), (1024, 4096), (4096, 1024)]


def copies_for(k: int, n: int, read_mib: float) -> int:
    """Distinct [n, k] float32 weights that make about `read_mib` MiB: the nearest power of two,
    1 to 32."""
    want = read_mib * 2**20 / (4 * k * n)
    copies = 1
    while copies * 1.5 <= want and copies < 32:  # 1.5: halfway between copies and 2 * copies
        copies *= 2
    return copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="K x N of the weight ([in, out])")
    ap.add_argument("--read-mib", type=float, default=0.0,
                    help="distinct weights per pass, about this many MiB of them (0: one weight)")
    ap.add_argument("--out", default="bench/results/dot_layout.json")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    print(f"machine: {dot_layout.machine()}")
    print("[in, out] time ÷ [out, in] time; * where the weight would be laid out [in, out] (MARGIN "
          f"{dot_layout.MARGIN}, weights over {dot_layout.SMALL_WEIGHT_BYTES >> 20} MiB timed up to "
          f"{dot_layout.MAX_TIMED_ROWS} rows)")
    print(f"{'K x N':>12} {'MiB':>5} {'copies':>6}  " + " ".join(f"{r:>6}" for r in rows))
    cells = []
    for k, n in shapes:
        line = []
        copies = copies_for(k, n, a.read_mib)
        for m in rows:
            nk, kn = dot_layout.time_layouts(m, k, n, copies)
            untimed = dot_layout.untimed_answer(m, k, n)
            relaid = m >= 2 and (untimed if untimed is not None else dot_layout.timed_answer((nk, kn)))
            cells.append({"rows": m, "k": k, "n": n, "copies": copies, "out_in_s": nk, "in_out_s": kn,
                          "relaid": relaid})
            line.append(f"{kn / nk:5.2f}{'*' if relaid else ' '}")
        print(f"{k:>5} x {n:<5} {k * n * 4 / 2**20:5.1f} {copies:>6}  " + " ".join(line), flush=True)
    write_json(a.out, {"machine": dot_layout.machine(), "read_mib": a.read_mib, "cells": cells})
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
