"""Lowering rules: reductions."""
