"""Lowering rules: nn."""
