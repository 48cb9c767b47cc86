"""Memory placement: `fx2xla.place_to_host` / `fx2xla.place_to_device` (fx2xla/offload.py) lower
to XLA's memory-placement annotation, as jax's `device_put(x, jax.memory.Space.Host)` does inside
`jit` on accelerators:

    stablehlo.custom_call @annotate_device_placement(%x) {has_side_effect = true,
        mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}}

XLA's host-offload passes turn each annotation into the copy to (or from) host memory. jax emits
nothing for a `device_put` to a memory kind inside `jit` on its CPU client; this rule emits the
annotation on every platform, so the module says where the value lives wherever it is lowered
(XLA:CPU drops the annotations when it compiles: its device memory is host memory).
"""
from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.interpreters.mlir import ir

from .. import offload
from .registry import register_lowering

_DEVICE_KIND = "device"

placement_p = Primitive("fx2xla_placement")


def _abstract(x, *, kind: str):
    space = jax.memory.Space.Device if kind == _DEVICE_KIND else jax.memory.Space.Host
    try:
        return x.update(memory_space=space)
    except TypeError:  # a jax whose avals have no memory space: the value's type is unchanged
        return x


def _lower(ctx, x, *, kind: str):
    from jax.extend.mlir.dialects import stablehlo as hlo

    op = hlo.CustomCallOp([x.type], [x], "annotate_device_placement", has_side_effect=True,
                          backend_config=ir.StringAttr.get(""), api_version=mlir.i32_attr(1))
    op.attributes["mhlo.frontend_attributes"] = ir.DictAttr.get({"_xla_buffer_placement": ir.StringAttr.get(kind)})
    return [op.result]


placement_p.def_abstract_eval(_abstract)
placement_p.def_impl(lambda x, *, kind: x)  # outside a trace: the value itself
mlir.register_lowering(placement_p, _lower)


def place(x, kind: str):
    """`x` annotated to live in memory kind `kind` ("device", "pinned_host", ...)."""
    return placement_p.bind(x, kind=kind)


def to_device(x):
    return place(x, _DEVICE_KIND)


def to_host(x):
    return place(x, offload.HOST_KIND)


@register_lowering(offload.place_to_host_op)
def _place_to_host(ctx, x):
    return to_host(x)


@register_lowering(offload.place_to_device_op)
def _place_to_device(ctx, x):
    return to_device(x)


def placed_on_host(node) -> bool:
    """Whether graph node `node` is a `place_to_host` (its value annotated to live in host memory)."""
    return getattr(node, "op", None) == "call_function" and node.target is offload.place_to_host_op


def with_kind(sharding, kind: str | None):
    """`sharding` in memory kind `kind` (None: as it is, the device's memory)."""
    return sharding if kind is None else sharding.with_memory_kind(kind)


def single_device_shardings(plan) -> dict:
    """jax.jit's in_shardings/out_shardings for a one-device plan whose inputs or results live in
    another memory kind than the device's (host offloading): each passed input and result in its
    kind, everything else (stacked weights, the seed, the index checks' verdict) in the device's.
    {} when every value is in device memory: the module is then the one lowered without them."""
    kinds_in = [p.memory_kind for p in plan.inputs if p.passed]
    kinds_out = [r.memory_kind for r in plan.results]
    if not any(kinds_in) and not any(kinds_out):
        return {}
    from jax.sharding import SingleDeviceSharding

    device = plan.device.jax_device

    def sharding(kind):
        return SingleDeviceSharding(device, memory_kind=kind or _DEVICE_KIND)

    ins = [sharding(k) for k in kinds_in] + [sharding(None)] * (len(plan.concats) + int(plan.seed))
    return {"in_shardings": tuple(ins), "out_shardings": ([sharding(k) for k in kinds_out], sharding(None))}
