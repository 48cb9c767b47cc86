"""Every lowering rule: importing this module registers them all (`import fx2xla` does, once)."""
from . import (control_flow, creation, elementwise, fft, flex, indexing, linalg, losses, memory, nn, random, reductions,  # noqa: F401
               grouped, polynomials, products, selection, shape, solvers, special)
