"""Lowering rules: linalg."""
