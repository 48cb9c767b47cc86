"""Lowering rules, one module per op family; importing this package registers them all."""
from . import control_flow, creation, elementwise, fft, indexing, linalg, nn, random, reductions, shape  # noqa: F401
from . import memory  # noqa: F401  (fx2xla.place_to_host / place_to_device)
from .graph import lower_graph
from .registry import LOWERINGS, LoweringContext, register_lowering

__all__ = ["lower_graph", "register_lowering", "LoweringContext", "LOWERINGS"]
