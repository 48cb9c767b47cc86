"""Lowering rules: shape."""
