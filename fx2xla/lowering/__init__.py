"""Lowering rules, one module per op family; importing this package registers them all."""
from . import creation, elementwise, fft, indexing, linalg, nn, random, reductions, shape  # noqa: F401
from . import control_flow  # noqa: F401  (last: gives view ops' *_copy twins the rules above)
from .graph import lower_graph
from .registry import LOWERINGS, LoweringContext, register_lowering

__all__ = ["lower_graph", "register_lowering", "LoweringContext", "LOWERINGS"]
