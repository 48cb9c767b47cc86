"""Lowering: one rule per ATen overload (the registry, `registry.py`), rules in one module per op
family (imported by `rules.py`, which `import fx2xla` runs once), and the module a graph's plan
lowers to (`graph.py`)."""
