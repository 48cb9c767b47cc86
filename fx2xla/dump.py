"""`FX2XLA_DUMP_DIR=dir`: per compiled graph, the FX graph, the StableHLO and XLA's optimized HLO."""
from __future__ import annotations

import itertools
import os
import re

_seq = itertools.count()


def dump_dir() -> str | None:
    return os.environ.get("FX2XLA_DUMP_DIR") or None


def write_graph(name: str, gm, stablehlo: str, optimized_hlo) -> None:
    """Write `<seq>_<name>.fx.txt`, `.stablehlo.mlir` and `.hlo.txt` (optimized_hlo is a
    callable, evaluated only when dumping)."""
    d = dump_dir()
    if d is None:
        return
    os.makedirs(d, exist_ok=True)
    stem = os.path.join(d, f"{next(_seq):03d}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}")
    with open(stem + ".fx.txt", "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=True, include_device=True))
    with open(stem + ".stablehlo.mlir", "w") as f:
        f.write(stablehlo)
    with open(stem + ".hlo.txt", "w") as f:
        f.write(optimized_hlo())
