"""The per-call path's placed half: values handed over through a jax sharding.

A plan over a mesh takes its inputs as per-device shards and gives its results back from their
shards; a one-device plan that offloads (offload.py) takes and leaves some values in host memory,
also through a jax sharding (of that memory kind). `plan_executor.PlanExecutor` runs every plan;
what is particular to these values lives here, so the one-device path never branches on them:

- `PlacedHandOff`: an input split into shards (or placed in host memory), or taken as the shards
  a graph left it as (its twin), or passed as a `ShardedTensor` another graph returned;
- `placed_launch`: the launcher of such an executable, which keeps the jax Arrays of written
  inputs, sharded outputs and host results beside their tensors (twins, see
  sharding.keep_sharded_twin), and leaves outputs sharded under `outputs="sharded"`;
- `keep_twins`: records those Arrays once a call's results are installed.
"""
from __future__ import annotations

import functools

import torch

from . import offload
from .lowering.graph import passed_spec, spmd_shardings
from .lowering.memory import with_kind
from .plan import GraphPlan, InputKind, InputPlan, OutputKind
from .runtime.executor import make_sharded_launcher
from .runtime.handoff import aligned
from .sharding import ShardedTensor, keep_sharded_twin, mesh_by_id, sharded_twin


class PlacedHandOff:
    """Hands inputs of `plan` over through jax shardings: `placement(p)` says which (None: the
    input takes the one-device path), and calling it hands one tensor over."""

    def __init__(self, plan: GraphPlan, import_tensor, order, align: bool):
        self.mesh = None if plan.mesh_id is None else mesh_by_id(plan.mesh_id)
        host_inputs = any(p.memory_kind is not None for p in plan.inputs)
        # Inputs that may arrive as the shards or host buffers another graph left them as.
        self.takes_twins = self.mesh is not None or host_inputs
        # Stacked weights and the seed are the same on every device of a mesh.
        self.replicated = None if self.mesh is None else self.mesh.named_sharding(())
        self._host = offload.host_sharding(plan) if self.mesh is None and host_inputs else None
        self._jax_device = plan.device.jax_device
        self._torch_device = plan.torch_device
        self._import_tensor = import_tensor
        self._order = order  # jax's import stream waits for torch's (CUDA), before new imports
        self._align = align
        self._spans = self.mesh is not None and self.mesh.spans_processes

    def placement(self, p: InputPlan):
        """The jax sharding input `p` is handed over with, or None (the one-device path)."""
        if self.mesh is None:
            return self._host if p.memory_kind is not None else None
        perm = p.perm if p.kind is InputKind.PERMUTED else None
        return with_kind(self.mesh.named_sharding(passed_spec(p.sharding, perm)), p.memory_kind)

    def __call__(self, t: torch.Tensor, sharding, twin_use=None):
        """`t` as a global jax Array laid out as `sharding`: the shards a sharded graph left it
        as (its twin) or the ShardedTensor's own when they are laid out so, else split from `t`.
        `twin_use`: (donated, bump), see plan_executor.TwinUse."""
        import jax

        donated, bump = twin_use or (False, 0)
        if type(t) is ShardedTensor:  # another sharded graph's output, passed as it is
            if t.array.sharding == sharding and not donated:
                return t.array
            t = t.full_tensor()
        twin = sharded_twin(t, bump)  # written by a sharded graph since: its shards are on the devices
        # (deleted: a step that donated it raised before installing)
        if twin is not None and twin.sharding == sharding and not twin.is_deleted():
            return twin
        # The executor ordered jax's stream after torch's work so far; torch work queued here
        # (a move, copies) needs one more order before its imports.
        queued = False
        if self._torch_device is None:
            t = t.cpu()
        elif t.device != self._torch_device:
            # Blocking (a host sync per call where `t` is on the host); a mesh's inputs normally
            # live on its first device already, and this is skipped.
            t, queued = t.to(self._torch_device), True
        if self._spans:  # this process's shards, each from its slice
            # Every piece cut (a donated one copied, never a view of `t`) in torch first, then one
            # order, then the imports.
            pieces = {}
            for index in sharding.addressable_devices_indices_map(tuple(t.shape)).values():
                key = _index_key(index)
                if key not in pieces:
                    part = t[index].clone() if donated else t[index].contiguous()
                    pieces[key] = aligned(part) if self._align else part
            self._order()
            return jax.make_array_from_callback(
                tuple(t.shape), sharding, lambda index: self._import_tensor(pieces[_index_key(index)], self._jax_device)
            ).block_until_ready()
        if self._align:
            dense = aligned(t)
            queued = queued or dense is not t
            t = dense
        if queued:
            self._order()
        # The shards are copied from `t`'s memory asynchronously: done before torch may write `t`
        # again.
        return jax.device_put(self._import_tensor(t, self._jax_device), sharding,
                              may_alias=False if donated else None).block_until_ready()


def placed_launch(exe, plan: GraphPlan, result_shapes, exports, sharded_outputs: bool):
    """(launch, twins, keeps_arrays) for an executable whose results come back through jax shardings (a mesh's,
    or host memory), or None for a one-device plan without host results. `twins`: (result index,
    input position the result is written to, or -1 for an output) of the results whose jax
    Arrays `launch` returns after the others, to be kept beside their tensors: a later graph
    reading that tensor unchanged takes them as they are (a backward its saved activations, a
    forward the parameters a step just wrote) instead of splitting it again. `keeps_arrays`: jax
    Arrays of a call's results outlive it (twins, ShardedTensors)."""
    host = offload.host_results(plan)
    written = {r: i for i, r in plan.mutations}
    if plan.mesh_id is None:
        if not host:
            return None
        twins = tuple((r, written.get(r, -1)) for r in host)
        return offload.make_host_launcher(exe, exports, keep=host), twins, True
    outs, code = spmd_shardings(plan)["out_shardings"]
    shardings = outs + [code] * (len(result_shapes) - len(outs))
    lazy = _lazy_results(plan, outs) if sharded_outputs else {}
    twins = tuple((r, written.get(r, -1)) for r in range(len(outs))
                  if r not in lazy and (r in written or not outs[r].is_fully_replicated or r in host))
    launch = make_sharded_launcher(exe, shardings, result_shapes, exports, keep=[r for r, _ in twins], lazy=lazy)
    return launch, twins, bool(twins or lazy)


def keep_twins(twins, arrays, outs, held) -> None:
    """Record each twin's jax Array as the shards of the tensor it became: the written input
    (`held`, after the executor installed it) or the output."""
    for (r, i), array in zip(twins, arrays):
        keep_sharded_twin(held[i] if i >= 0 else outs[r], array)


def _lazy_results(plan: GraphPlan, shardings) -> dict:
    """The results returned as sharding.ShardedTensor under outputs="sharded": sharded graph
    outputs that reach the caller as they are (no view, permutation or restride in torch)."""
    used = {}
    for p in plan.outputs:
        if p.kind is OutputKind.TENSOR:
            used.setdefault(p.index, []).append(p)
    lazy = {}
    for r, ps in used.items():
        res = plan.results[r]
        if (r < plan.num_outputs and len(ps) == 1 and not ps[0].views and ps[0].inv_perm is None
                and ps[0].stride is None and res.perm is None and not shardings[r].is_fully_replicated):
            meta = res.node.meta["val"]
            lazy[r] = functools.partial(_sharded_result, plan.mesh_id, res.sharding, meta.dtype,
                                        res.device or torch.device("cpu"))
    return lazy


def _sharded_result(mesh_id, spec, dtype, device, array, assemble) -> ShardedTensor:
    return ShardedTensor(array, mesh_id, spec, dtype, device, assemble)


def _index_key(index) -> tuple:
    """A hashable form of a shard's index (a tuple of slices; slices hash from Python 3.12 only)."""
    return tuple((i.start, i.stop, i.step) if isinstance(i, slice) else i for i in index)
