"""`ShardedTensor`: a compiled graph's result left as per-device shards; and the shards a
sharded graph left a written tensor as (its twin), which a later sharded graph reads as they are."""
from __future__ import annotations

import math
import threading
import weakref
from typing import Any, NamedTuple

import torch

from ..runtime.executor import make_recording
from ..runtime.handoff import gather_array
from .specs import Annotation, Mesh, ShardingError, Spec, describe_spec, normalize_spec

class TwinRecord(NamedTuple):
    """The shards a sharded graph left a tensor's new contents as."""

    version: int  # the tensor's _version after the write
    data_ptr: int  # and its data pointer
    array: Any  # the new value as the graph left it: a global jax Array of per-device shards


# id(tensor written by a sharded graph) -> its TwinRecord: a later sharded graph reading the
# unchanged tensor with that sharding takes the shards instead of splitting the tensor again (a
# parameter updated by a compiled FSDP optimizer step stays on its devices). One table for the
# process, since the graph that writes a tensor and the graph that reads it are different graphs.
_sharded_twins: dict = {}


def keep_sharded_twin(t: torch.Tensor, array) -> None:
    """Record `array` (a global jax Array) as the shards of `t`'s current contents."""
    if id(t) not in _sharded_twins:
        try:
            weakref.finalize(t, _sharded_twins.pop, id(t), None)
        except TypeError:  # not weak-referenceable: nothing can be kept
            return
    _sharded_twins[id(t)] = TwinRecord(t._version, t.data_ptr(), array)


def sharded_twin(t: torch.Tensor, bump: int = 0):
    """The shards recorded for `t`, if its contents are still those (its version moved by
    `bump` since, its storage the same), else None."""
    twin = _sharded_twins.get(id(t))
    if twin is None or twin.version + bump != t._version or twin.data_ptr != t.data_ptr():
        return None
    return twin.array


def sharded_twins() -> dict:
    """A snapshot of every twin recorded: id(tensor) -> its TwinRecord."""
    return dict(_sharded_twins)


def forget_sharded_twins() -> None:
    _sharded_twins.clear()


class ShardedTensor(torch.Tensor):
    """A compiled graph's output left on its devices (`options={"outputs": "sharded"}`): a torch
    tensor of the global shape whose data stays as the executable's per-device shards.

    - `shards()`: the distinct pieces, each a torch tensor sharing its device's buffer, with its
      index (a tuple of slices into the global shape). No copy, no collective.
    - `full_tensor()`: the whole value as a plain tensor, assembled once (in one process; in
      several, every process must call it: it gathers the others' shards) and kept.
    - Any torch op on it works, on the whole value (assembled on first use). An fx2xla graph over
      the same mesh that reads it takes its shards as they are.
    - `array`: the global jax Array; `mesh`, `spec`: its layout (`fx2xla.mark_sharding` terms)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, array, mesh_id: int, spec: Spec, dtype: torch.dtype, device: torch.device, assemble=None,
                whole=None):
        shape = tuple(array.shape) if array is not None else tuple(whole.shape)
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t._array, t._assemble, t._whole, t._lock = array, assemble, whole, threading.Lock()
        t._fx2xla_sharding = Annotation(mesh_id, spec)
        return t

    @property
    def array(self):
        return self._array

    @property
    def mesh(self) -> Mesh:
        return self._fx2xla_sharding.mesh

    @property
    def spec(self) -> Spec:
        return self._fx2xla_sharding.spec

    def shards(self) -> list[tuple[tuple[slice, ...], torch.Tensor]]:
        """(index, piece) per distinct shard this process holds, in device order; each piece
        shares its device buffer's memory (a replica over another mesh axis is listed once)."""
        out = []
        with _recording():
            for shard in self._array.addressable_shards:
                if shard.replica_id == 0:
                    out.append((shard.index, torch.from_dlpack(shard.data)))
        return out

    def local_tensor(self) -> torch.Tensor:
        """The block of the value this process's devices hold, as one tensor (the whole value in
        a single process). Raises where those shards do not tile one block."""
        pieces = self.shards()
        lo = [min(i[d].start or 0 for i, _ in pieces) for d in range(self.dim())]
        hi = [max(i[d].stop if i[d].stop is not None else self.shape[d] for i, _ in pieces)
              for d in range(self.dim())]
        box = math.prod(h - l for l, h in zip(lo, hi))
        if box != sum(p.numel() for _, p in pieces):
            raise ShardingError(f"fx2xla: this process's shards of a {tuple(self.shape)} tensor sharded "
                                f"{describe_spec(self.spec)} over {self.mesh} do not form one block")
        block = torch.empty([h - l for l, h in zip(lo, hi)], dtype=self.dtype, device=self.device)
        for index, piece in pieces:
            block[tuple(slice((s.start or 0) - l, (s.stop if s.stop is not None else n) - l)
                        for s, l, n in zip(index, lo, self.shape))] = piece
        return block

    @classmethod
    def from_local(cls, local: torch.Tensor, mesh: Mesh, spec) -> "ShardedTensor":
        """A global tensor from each process's own part of it (a data loader's batch per process):
        `local` is this process's block, laid out by `spec` over `mesh`; the global shape scales
        each sharded dim by the number of processes along it. Every process calls it."""
        import jax

        spec = normalize_spec(spec, local.dim(), mesh)
        with _recording():
            data = jax.dlpack.from_dlpack(local.detach().cpu().contiguous())
            array = jax.make_array_from_process_local_data(mesh.named_sharding(spec), data)
        return cls(array, mesh.id, spec, local.dtype, local.device)

    def full_tensor(self) -> torch.Tensor:
        whole = self._whole
        if whole is not None:
            return whole
        with self._lock:
            if self._whole is None:
                self._whole = self._materialize()
            return self._whole

    def _materialize(self) -> torch.Tensor:
        with _recording():
            if self._array.is_fully_addressable:
                whole = self._assemble() if self._assemble is not None else _assemble(self)
            else:
                whole = gather_array(self._array, self.device)
        keep_sharded_twin(whole, self._array)  # a sharded graph reading it takes the shards
        return whole

    # Dynamo and AOTAutograd see the whole value (assembled when a traced graph first reads it;
    # an fx2xla graph then finds its shards through the twin recorded above).
    def __tensor_flatten__(self):
        return ["_full"], (self._fx2xla_sharding.mesh_id, self.spec)

    @property
    def _full(self) -> torch.Tensor:
        return self.full_tensor()

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        # Tracing's stand-in: the whole (fake) value, with the layout.
        whole = inner["_full"]
        return ShardedTensor(None, *meta, whole.dtype, whole.device, whole=whole)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def whole(x):
            return x.full_tensor() if isinstance(x, ShardedTensor) else x

        args, kwargs = torch.utils._pytree.tree_map(whole, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"ShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, spec={describe_spec(self.spec)}, "
                f"mesh={self.mesh!r})")


def _recording():
    """Recording of jax tracebacks on while making jax objects that outlive the call (another
    thread's compiled call may have paused it, see runtime/executor.py)."""
    return make_recording()()


def _assemble(t: ShardedTensor) -> torch.Tensor:
    whole = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    for index, piece in t.shards():
        whole[index] = piece
    return whole
