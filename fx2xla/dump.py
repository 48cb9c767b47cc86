"""`FX2XLA_DUMP_DIR=dir`: per compiled graph, the FX graph, the StableHLO and XLA's optimized HLO."""
from __future__ import annotations

import itertools
import os
import re

_seq = itertools.count()


def dump_dir() -> str | None:
    return os.environ.get("FX2XLA_DUMP_DIR") or None


def _stem(name: str) -> str | None:
    """`<dump dir>/<seq>_<name>` (the folder created), or None when not dumping."""
    d = dump_dir()
    if d is None:
        return None
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"{next(_seq):03d}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}")


def write_graph(name: str, gm, stablehlo: str, optimized_hlo) -> None:
    """Write `<seq>_<name>.fx.txt`, `.stablehlo.mlir` and `.hlo.txt` (optimized_hlo is a
    callable, evaluated only when dumping)."""
    stem = _stem(name)
    if stem is None:
        return
    with open(stem + ".fx.txt", "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=True, include_device=True))
    with open(stem + ".stablehlo.mlir", "w") as f:
        f.write(stablehlo)
    with open(stem + ".hlo.txt", "w") as f:
        f.write(optimized_hlo())


def write_pass(name: str, pass_name: str, gm, notes) -> None:
    """Write `<seq>_<name>_pass_<pass_name>.fx.txt`: the graph after a pass that changed it,
    its notes (what the pass did) as a header."""
    stem = _stem(f"{name}_pass_{pass_name}")
    if stem is None:
        return
    with open(stem + ".fx.txt", "w") as f:
        f.writelines(f"# {n}\n" for n in notes)
        f.write(gm.print_readable(print_output=False))
