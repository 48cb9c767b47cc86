"""Which core ATen overloads have a lowering rule (the rest fall back to eager)."""
from __future__ import annotations

import importlib

import torch

from .lowering.registry import lowering_for

# Prims that survive the core-ATen decompositions in real graphs (e.g. AdamW's fma).
SURVIVING_PRIMS = ("fma",)


def core_overloads() -> list:
    """Every overload tagged `core` in torch's ATen opset, plus the surviving prims."""
    ops = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for ov in packet.overloads():
            op = getattr(packet, ov)
            if torch.Tag.core in op.tags:
                ops.append(op)
    try:
        importlib.import_module("torch._inductor.inductor_prims")  # defines prims.fma
    except ImportError:
        pass
    for name in SURVIVING_PRIMS:
        packet = getattr(torch.ops.prims, name, None)
        if packet is not None:
            ops.extend(getattr(packet, ov) for ov in packet.overloads())
    return sorted(ops, key=str)


def coverage() -> tuple[list, list]:
    """(lowered, falls_back): core overloads with and without a rule."""
    lowered, missing = [], []
    for op in core_overloads():
        (lowered if lowering_for(op) is not None else missing).append(op)
    return lowered, missing
