"""`python -m fx2xla ops`: lowering coverage of the core ATen opset."""
from __future__ import annotations

import argparse
import sys


def _ops(args) -> int:
    from .coverage import coverage

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fx2xla")
    sub = p.add_subparsers(dest="cmd", required=True)
    ops = sub.add_parser("ops", help="which core ATen overloads lower and which fall back to eager")
    ops.add_argument("-v", "--verbose", action="store_true", help="list the lowered ones too")
    ops.set_defaults(fn=_ops)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
