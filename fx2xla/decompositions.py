"""The decomposition table AOTAutograd applies before lowering: PyTorch's core-ATen table.

Ops that survive it (core ATen plus a few prims such as `prims.fma`) each need a rule in
`fx2xla/lowering/`.
"""
from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions


@functools.cache
def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    return table
