"""`python -m fx2xla ops` (lowering coverage), `python -m fx2xla cache info|clear` and
`python -m fx2xla kernels build|status` (torch's CPU kernels inside XLA:CPU executables)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from . import torch_kernels
from .coverage import coverage
from .runtime import dot_layout
from .runtime.executor import AUTOTUNE_FOLDER, disk_cache


def _ops(args) -> int:
    lowered, missing = coverage()
    total = len(lowered) + len(missing)
    if args.verbose:
        for op in lowered:
            print(f"  lowers    {op}")
    for op in missing:
        print(f"  fallback  {op}")
    print(f"{len(lowered)}/{total} core overloads lower to StableHLO ({100 * len(lowered) / total:.1f}%); "
          f"{len(missing)} run eagerly (fallback)")
    return 0


def _cache(args) -> int:
    cache = disk_cache()
    if cache is None:
        print("disk cache is off (FX2XLA_CACHE_DIR is empty)")
        return 0
    entries = cache.entries()
    # Beside the executables: this machine's timed CPU dot layouts (runtime/dot_layout.py) and
    # XLA's GPU autotune results (runtime/executor.py), both measured once and kept.
    layouts = os.path.join(cache.folder, dot_layout.FILE_NAME)
    autotune = os.path.join(cache.folder, AUTOTUNE_FOLDER)
    if args.action == "clear":
        removed = [f"{cache.clear()} executables"]
        if os.path.isfile(layouts):
            os.unlink(layouts)
            removed.append("the CPU dot-layout timings")
        if os.path.isdir(autotune):
            shutil.rmtree(autotune, ignore_errors=True)
            removed.append("the GPU autotune results")
        print(f"removed {', '.join(removed)} from {cache.folder}")
        return 0
    size = sum(os.path.getsize(p) for p in entries)
    extra = [what for path, what in ((layouts, "CPU dot-layout timings"), (autotune, "GPU autotune results"))
             if os.path.exists(path)]
    print(f"{cache.folder}: {len(entries)} executables, {size / 2**20:.1f} MiB"
          + (f"; also {', '.join(extra)}" if extra else ""))
    return 0


def _kernels(args) -> int:
    if args.action == "status":
        print(torch_kernels.status())
        return 0
    try:
        print(f"built {torch_kernels.build(force=args.force)}")
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 0 if args.optional else 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fx2xla")
    sub = p.add_subparsers(dest="cmd", required=True)
    ops = sub.add_parser("ops", help="which core ATen overloads lower and which fall back to eager")
    ops.add_argument("-v", "--verbose", action="store_true", help="list the lowered ones too")
    ops.set_defaults(fn=_ops)
    cache = sub.add_parser("cache", help="inspect or clear the cache on disk (FX2XLA_CACHE_DIR): executables, "
                                         "CPU dot-layout timings, GPU autotune results")
    cache.add_argument("action", choices=["info", "clear"])
    cache.set_defaults(fn=_cache)
    kernels = sub.add_parser("kernels", help="build torch's CPU kernels for XLA:CPU executables, or say whether they run")
    kernels.add_argument("action", choices=["build", "status"])
    kernels.add_argument("--force", action="store_true", help="build again even if a build exists")
    kernels.add_argument("--optional", action="store_true",
                         help="a missing compiler or a failed build is reported, not an error (exit 0)")
    kernels.set_defaults(fn=_kernels)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
