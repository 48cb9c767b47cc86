"""Result twins: the jax Array a one-device executable left a tensor's memory as.

Every result of a one-device executable reaches torch as a tensor sharing the PJRT buffer's
memory (DLPack). When such a tensor comes back as the input of a later executable (a backward's
saved activations, an optimizer step's grads, a forward's parameters that a step just wrote, a
decode step's cache), importing it again makes a second PJRT buffer over the same memory. On
CUDA that import is what blocks the host: PJRT waits for buffers imported on its external-ready
stream whose definition is still pending behind torch's work (docs/gpu.md, "One host wait is
left"). Passing the result's own jax Array instead costs a dictionary lookup, and XLA orders the
read after the execution that wrote it by itself.

The table is keyed by the memory's address and tied to the torch *storage*: a tensor that reads
the same memory with the same dtype, shape, contiguity and version counter value holds the same
bytes as the array. That covers the tensor itself and what shares its storage and version
counter from the same address (`detach()`, the gradient AccumulateGrad stores, a saved tensor
unpacked). A write through torch moves the version and the twin is no longer taken. (A write
torch's version counter does not see, through `.data`, is the one exception, as for resident
parameters: see docs/gpu.md.)

A record lives as long as the storage does: a weak reference to the storage's Python object,
which torch keeps alive as long as the storage itself, drops it. The record holds the array, so
the memory cannot be handed out again while the record exists.

On a GPU a dropped record's array is not released at once. torch may still have kernels queued
that read the tensor that just died, and PJRT knows nothing of torch's stream: released, the
memory could go to the next execution, which (with every input a twin, nothing imported) is not
ordered after torch's stream and could write it before those kernels ran. So the arrays of
dropped records wait for the next call on that device (every result of a GPU executable is
recorded for this, not only those that may come back as inputs):
- a call that imports something is ordered after torch's stream, and so is every later
  execution: it `claim`s every waiting array before its order and lets them go after it;
- a call that imports nothing `fence`s them: one CUDA event recorded on torch's current stream,
  and they are released once it has passed (a later call checks), unless they add up to
  `ORDER_BYTES` or more: then the call imports one of its twins again, so that it is ordered and
  can claim them (memory back at once, for one import).

Inference tensors (made under `torch.inference_mode()`) have no version counter, so torch's
writes to them cannot be seen: no record is kept for one, and none is taken for one.

What is kept (`plan_executor.twin_results`): on a GPU every result; on the CPU the new contents
of written inputs, and the returned results of training graphs (a forward's saved activations,
a backward's gradients), which the next graph reads. A CPU inference graph's returned results
are not kept: there a record (a storage object, a weak reference, a drop callback: ~8 µs per
result on the AVX2 EPYC) costs about what importing the tensor again costs (~10 µs), and most
such results never come back.

`FX2XLA_TWINS=0` turns the twins off: every input is imported as before. `FX2XLA_TWINS=all`
keeps the returned results of CPU inference graphs too (a loop that feeds its outputs back).
"""
from __future__ import annotations

import collections
import functools
import os
import threading
import weakref
from typing import Any, NamedTuple


class TwinRecord(NamedTuple):
    """The array a result was exported from, and what a tensor must show to be its twin."""

    storage: Any  # weakref to the torch storage's Python object
    version: int  # the version counter's value the array's contents correspond to
    shape: Any  # torch.Size
    dtype: Any  # torch.dtype
    array: Any  # the jax Array
    device: Any  # the jax device the array lives on (one device, its default memory)
    fenced: bool  # a GPU's: once dropped, released only after torch's stream passes (see above)
    owned: bool  # no DLPack export references the array: it may be donated (runtime/inplace.py)


# data_ptr -> TwinRecord. Dict reads and writes are atomic under the GIL; two threads keeping the
# same address at once leave one of the two records, each of them correct.
_table: dict[int, TwinRecord] = {}
# GPU arrays of dropped records: waiting for the next fence, then for its event.
_lock = threading.Lock()  # fence() only
_unfenced: list = []
_unfenced_bytes = 0
_fenced: collections.deque = collections.deque()  # (event, [arrays]), oldest first
# Dropped arrays a call that imports nothing would rather order itself for than hold (see above):
# an activation's worth of a training step, not a decode step's cache entry.
ORDER_BYTES = 256 << 20


def enabled() -> bool:
    """Whether results are kept as twins (`FX2XLA_TWINS`, default on), read when a graph is
    specialized."""
    return os.environ.get("FX2XLA_TWINS", "1") not in ("0", "")


def inference_outputs_kept() -> bool:
    """Whether a CPU inference graph's returned results are kept too (`FX2XLA_TWINS=all`), read
    when a graph is specialized."""
    return os.environ.get("FX2XLA_TWINS", "1") == "all"


def _drop(key: int, ref) -> None:
    rec = _table.get(key)
    if rec is not None and rec.storage is ref:
        _table.pop(key, None)
        if rec.fenced:
            release_later(rec.array)


def release_later(array) -> None:
    """Hold GPU `array`, whose memory torch's queued kernels may still read, until torch's
    stream has passed this point: the next fence's event, or the next ordered call."""
    global _unfenced_bytes
    _unfenced.append(array)  # no lock: a collection inside fence() may run this
    _unfenced_bytes += array.nbytes  # a hint only (no lock): read against ORDER_BYTES


def keep(t, array, device, fenced: bool = False, owned: bool = False) -> None:
    """Record `array` (on jax `device`) as the contents of tensor `t`, which shares its memory.
    `fenced`: a GPU's array, released after torch's stream once dropped (see above). `owned`:
    `t` views the array without a DLPack export (runtime/inplace.py), so PJRT may take it as a
    donated argument (a GPU refuses to donate a buffer that has an external reference)."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor: torch may write it unseen (no version), no twin
        return
    key = t.data_ptr()
    storage = t.untyped_storage()
    rec = _table.get(key)
    ref = rec.storage if rec is not None and rec.storage() is storage else \
        weakref.ref(storage, functools.partial(_drop, key))
    _table[key] = TwinRecord(ref, version, t.shape, t.dtype, array, device, fenced, owned)


def rebind(t) -> None:
    """`t` was just made to share the storage of a kept result (`Tensor.set_`): its own version
    counter is the one later readers show, so the record takes its value."""
    key = t.data_ptr()
    rec = _table.get(key)
    if rec is not None and rec.storage() is t.untyped_storage():
        try:
            _table[key] = rec._replace(version=t._version)
        except RuntimeError:  # an inference tensor now: its writes cannot be seen, no twin
            _table.pop(key, None)


def waiting() -> bool:
    """Whether dropped GPU arrays wait for a fence or its event (read on the call path)."""
    return bool(_unfenced or _fenced)


def torch_stream_event(index: int):
    """A CUDA event recorded now on torch's current stream of device `index`."""
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(index))
    return event


def pressing() -> bool:
    """Whether the arrays waiting for a fence add up to ORDER_BYTES or more."""
    return _unfenced_bytes >= ORDER_BYTES


def claim() -> list:
    """Every array waiting (for a fence, or for its event), taken out of the waiting lists: the
    caller lets go of them once its call is ordered after torch's stream, after their drop."""
    global _unfenced, _unfenced_bytes
    with _lock:
        claimed, _unfenced, _unfenced_bytes = _unfenced, [], 0
        while _fenced:
            claimed.extend(_fenced.popleft()[1])
    return claimed


def fence(recorded_event) -> None:
    """Called before a GPU execution when `waiting()`: `recorded_event()` (an event recorded on
    torch's current stream, see torch_stream_event) now covers the arrays dropped so far;
    arrays of earlier fences whose event has passed are released."""
    global _unfenced, _unfenced_bytes
    released = []  # let go outside the lock: freeing may run a collection that drops records
    with _lock:  # one fence at a time: two would each pop a batch as passed on one query
        if _unfenced:
            # Swapped before the event is recorded: every array in the batch was dropped before
            # it (one appended late to the old list was dropped before the swap, so before too).
            batch, _unfenced, _unfenced_bytes = _unfenced, [], 0
            _fenced.append((recorded_event(), batch))
        while _fenced and _fenced[0][0].query():
            released.append(_fenced.popleft())
    del released


def twin(t, device, bump: int = 0, owned: bool = False):
    """The jax Array on `device` that `t` is the twin of, or None. `bump`: how far the caller
    (AOTAutograd) moved `t`'s version since the record, without writing it. `owned`: only an
    array no DLPack export references (one the caller will donate on a GPU)."""
    rec = _table.get(t.data_ptr())
    if (rec is None or rec.device is not device or rec.dtype is not t.dtype or rec.shape != t.shape
            or not t.is_contiguous() or (owned and not rec.owned)):
        return None
    try:
        if rec.version + bump != t._version:
            return None
    except RuntimeError:  # an inference tensor over a result's memory: no version to trust
        return None
    return rec.array


def counts() -> dict:
    """`{"records": live records, "waiting": dropped GPU arrays not yet released}` (metrics)."""
    return {"records": len(_table), "waiting": len(_unfenced) + sum(len(b) for _, b in list(_fenced))}


def records() -> dict:
    """A snapshot of the table: data_ptr -> TwinRecord."""
    return dict(_table)

