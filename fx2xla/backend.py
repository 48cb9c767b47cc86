"""The `torch.compile` backend: `torch.compile(model, backend="fx2xla", options={...})`.

Dynamo hands us a graph; AOTAutograd (with the core-ATen decomposition table) turns it into
forward/backward or inference graphs of core ATen ops; each becomes a CompiledGraph that
lowers to StableHLO and runs on the PJRT device chosen by `PJRT_DEVICE`.
"""
from __future__ import annotations

import functools

import torch

OPTIONS = {
    # name: (default, help)
    "device_index": (None, "local PJRT device index (default: FX2XLA_DEVICE_INDEX or 0)"),
}


def _check_options(options: dict | None) -> dict:
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"fx2xla: unknown option(s) {unknown}; known: {sorted(OPTIONS)}")
    return {k: options.get(k, d) for k, (d, _) in OPTIONS.items()}


def _graph_name(kind: str) -> str:
    cid = torch._guards.CompileContext.current_compile_id()
    return f"g{cid}_{kind}".replace("/", "_") if cid is not None else kind


def _compile(gm, example_inputs, *, kind: str, options: dict):
    from .compiled_graph import CompiledGraph
    from .runtime import Device, default_device

    device = default_device()
    if options["device_index"] is not None:
        device = Device(device.platform, int(options["device_index"]))
    return CompiledGraph(gm, example_inputs, device, _graph_name(kind))


def fx2xla_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode=None):
    """Compile a Dynamo graph for XLA. Registered as the `fx2xla` torch.compile backend."""
    from torch._dynamo.backends.common import aot_autograd

    from . import lowering  # noqa: F401  (registers the rules)
    from .decompositions import decomposition_table

    opts = _check_options(options)
    return aot_autograd(
        fw_compiler=functools.partial(_compile, kind="forward", options=opts),
        bw_compiler=functools.partial(_compile, kind="backward", options=opts),
        inference_compiler=functools.partial(_compile, kind="inference", options=opts),
        decompositions=decomposition_table(),
    )(gm, example_inputs)
