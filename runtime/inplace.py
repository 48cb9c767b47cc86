"""Written inputs updated in place: torch views over XLA's own buffers.

A graph that writes its inputs (an optimizer step's parameters and moments, batch norm's
running statistics) returns their new contents as results, and each call would hand torch a
fresh buffer per written tensor. XLA can instead write into the input's own buffer (the module
aliases the input with its result, and the caller donates it), as eager and Inductor update
tensors in place: no fresh allocation per tensor and step, no page faults on its first touch
(bench/train.py's MLP step: docs/benchmarks.md), and on a GPU no DLPack export and `set_` per
written tensor and step (the host work of a GPU training step's optimizer step).

PJRT aliases a donated buffer only if XLA owns it and nothing references it from outside:
- a DLPack import of torch memory is donated but not aliased (the result is a new buffer);
- a result exported to torch through DLPack holds an external reference: the CPU client then
  copies, a GPU client refuses the call, so a GPU call donates only arrays no export
  references (twins recorded `owned`, runtime/twins.py) and imports the tensor otherwise.
So the new contents of a written input reach torch as a *view*: a tensor over the result's
memory (`own_view`), whose storage keeps a `Holder` of the jax Array alive instead of taking a
PJRT external reference. The next call takes that Array back as the input's twin
(runtime/twins.py) and donates it; XLA writes the new contents at the same address; the holder
then moves to the new Array (`rehome`), which owns the memory from then on. The tensor keeps its
storage, and its version counter moves as for any in-place write (`written_in_place`).

One-device plans on the CPU and on CUDA (plan.py decides; `FX2XLA_INPLACE=0` turns it off).
- CPU: every call has finished when it returns (results are read or exported only once ready),
  so no execution still reads a buffer when the next donates it.
- CUDA: nothing waits on the host. XLA must not write a tensor before torch's queued kernels
  that read it have run, so a call that donates is ordered after torch's stream (it imports at
  least one input: plan_executor). Torch's stream waits for the execution before its next
  kernel reads a written tensor (`handoff.make_stream_wait` on one result, where no export
  already does so). A holder's array is released after torch's stream passes, as a dropped
  twin's is (`FencedHolder`). GPU in place needs the twins on (their fence and order).
"""
from __future__ import annotations

import os
import weakref

import torch

from . import twins as _twins

# The numpy array-interface type string per torch dtype a view can be made as (bfloat16 and
# other dtypes numpy lacks: as unsigned integers of their width, then `Tensor.view(dtype)`).
_TYPESTR = {torch.float32: "<f4", torch.float64: "<f8", torch.float16: "<f2", torch.int64: "<i8",
            torch.int32: "<i4", torch.int16: "<i2", torch.int8: "|i1", torch.uint8: "|u1", torch.bool: "|b1",
            torch.complex64: "<c8", torch.complex128: "<c16"}
_WIDTH = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def enabled() -> bool:
    """Whether one-device CPU and CUDA plans write their written inputs in place
    (`FX2XLA_INPLACE`, default on), read when a graph is planned."""
    return os.environ.get("FX2XLA_INPLACE", "1") not in ("0", "")


def viewable(dtype: torch.dtype) -> bool:
    """Whether `own_view` can make a tensor of `dtype`."""
    return dtype in _TYPESTR or dtype.itemsize in _WIDTH


class Holder:
    """Owns the memory a torch storage views: the jax Array that last wrote it. numpy keeps the
    holder as its array's base, and torch keeps that array as the storage's owner."""

    __slots__ = ("array", "__array_interface__", "__cuda_array_interface__", "__weakref__")


class FencedHolder(Holder):
    """A GPU view's holder. When torch's storage dies, kernels torch queued may still read the
    memory, so the array waits for torch's stream (`twins.release_later`) instead of going at
    once; this covers views no twin record fences (inference tensors, records replaced)."""

    __slots__ = ()

    def __del__(self, _release=_twins.release_later):
        array = getattr(self, "array", None)
        if array is not None:
            try:
                _release(array)
            except (AttributeError, TypeError):  # at interpreter exit, twins' globals may be gone
                pass


# address -> Holder, while its storage lives (a new holder at a freed address replaces the entry;
# the old one's weak reference then removes nothing).
_holders: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def own_view(a, dtype: torch.dtype, cuda_index: int | None = None) -> torch.Tensor:
    """A tensor of `dtype` over the memory of jax Array `a` (one device, row-major), holding `a`
    instead of a PJRT external reference, so that a later call can donate `a` and have XLA write
    its result there. CPU (`cuda_index` None): waits until `a` is ready. CUDA device
    `cuda_index`: does not wait; the caller makes torch's stream wait for `a` instead."""
    if a.dtype.itemsize != dtype.itemsize:
        raise TypeError(f"fx2xla: a {a.dtype}{list(a.shape)} result cannot be viewed as {dtype}")
    holder = Holder() if cuda_index is None else FencedHolder()
    holder.array = a
    ptr = a.unsafe_buffer_pointer()
    typestr = _TYPESTR.get(dtype)
    interface = {"data": (ptr, False), "shape": tuple(a.shape), "typestr": typestr or _WIDTH[dtype.itemsize]}
    if cuda_index is None:
        import numpy as np

        a.block_until_ready()
        holder.__array_interface__ = {**interface, "version": 3}
        t = torch.from_numpy(np.asarray(holder))
    else:
        # No "stream" entry: torch would not wait on it; the order is the caller's.
        holder.__cuda_array_interface__ = {**interface, "strides": None, "version": 2}
        t = torch.as_tensor(holder, device=torch.device("cuda", cuda_index))
    if typestr is None:
        t = t.view(dtype)
    _holders[ptr] = holder
    return t


def rehome(ptr: int, a) -> bool:
    """XLA wrote jax Array `a` into the memory at `ptr` (the donated input's): the holder there,
    if any, now holds `a`, which owns that memory. Returns whether there was one."""
    holder = _holders.get(ptr)
    if holder is None:
        return False
    holder.array = a
    return True


def consumed(ptr: int) -> bool:
    """Whether the Array the holder at `ptr` holds was donated away (deleted) although no
    result landed at its address: PJRT aliases every donated buffer it owns outright, so this
    is never expected, and the caller refuses to go on over memory that may be freed."""
    holder = _holders.get(ptr)
    return holder is not None and holder.array.is_deleted()


def written_in_place(dst: torch.Tensor) -> None:
    """`dst`'s memory now holds new contents XLA wrote: its version moves, as an in-place
    write's does (autograd, and twins, see the change). An inference tensor has no version."""
    if not dst.is_inference():
        torch.autograd.graph.increment_version(dst)
