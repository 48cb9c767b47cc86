"""Serving warm-up and recompilation control.

    compiled = torch.compile(model, backend="fx2xla", options={"no_recompile": True})
    fx2xla.warmup(compiled, [ids_8x128, ids_8x256, fx2xla.TensorSpec((16, 128), torch.int64)])
    # from here on, a request with an unseen shape raises RecompileError instead of compiling

`fx2xla.no_recompile()` does the same for a region of code, for every compiled model.
"""
from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch

from .errors import Fx2XlaError
from .lowering.dtypes import dtype_name
from .metrics import metrics


class RecompileError(Fx2XlaError):
    """A compile was requested where recompilation is forbidden."""


@dataclass(frozen=True)
class TensorSpec:
    """A shape and dtype to warm up with; the input is made of zeros (valid token ids too).
    device: where it is made; None: where the model's parameters live (else the CPU)."""

    shape: tuple
    dtype: torch.dtype = torch.float32
    device: torch.device | str | None = None

    def materialize(self, device=None) -> torch.Tensor:
        return torch.zeros(tuple(self.shape), dtype=self.dtype, device=self.device or device)


def _model_device(compiled):
    """The device of the first parameter or buffer of a compiled module (None otherwise)."""
    module = getattr(compiled, "_orig_mod", compiled)
    if isinstance(module, torch.nn.Module):
        for t in (*module.parameters(), *module.buffers()):
            return t.device
    return None


class _State(threading.local):
    def __init__(self):
        self.forbidden = 0  # depth of no_recompile() regions
        self.warming_up = 0  # depth of warmup() calls


_state = _State()


@contextlib.contextmanager
def no_recompile():
    """Inside this block, any fx2xla compile (a new graph or a new input shape) raises
    RecompileError; warm up first with `fx2xla.warmup`."""
    _state.forbidden += 1
    try:
        yield
    finally:
        _state.forbidden -= 1


def compile_allowed(option_no_recompile: bool = False) -> bool:
    return bool(_state.warming_up) or not (_state.forbidden or option_no_recompile)


def check_compile_allowed(what: str, option_no_recompile: bool = False, changed: str = "") -> None:
    """Raise RecompileError if compiling `what` is forbidden here (called on every compile).
    `changed` says what differs from the signatures compiled before (see `signature_change`)."""
    if compile_allowed(option_no_recompile):
        return
    where = "inside fx2xla.no_recompile()" if _state.forbidden else 'with options={"no_recompile": True}'
    raise RecompileError(
        f"fx2xla: compile of {what} requested {where}, after warm-up"
        + (f": {changed}" if changed else "") + ". Add this input signature to "
        "fx2xla.warmup(...) or allow recompilation."
    )


def _concrete(size):
    """A size as the int it is in this call (a symbolic size's hint), or its symbol's name."""
    if isinstance(size, torch.SymInt):
        hint = getattr(size.node, "hint", None)
        return int(hint) if hint is not None else str(size)
    return int(size)


@dataclass(frozen=True)
class InputSignature:
    """What a compile specialises on, for one input: its name, shape and dtype (None: a size)."""

    name: str
    shape: tuple | None
    dtype: torch.dtype | None

    @classmethod
    def of(cls, name: str, value) -> "InputSignature":
        if isinstance(value, torch.Tensor):
            return cls(name, tuple(_concrete(s) for s in value.shape), value.dtype)
        return cls(name, None, None)

    def describe(self) -> str:
        if self.dtype is None:
            return "a size"
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


def signature_change(seen: list, new: tuple) -> str:
    """What tells `new` (a tuple of InputSignature) from the closest signature in `seen`:
    'input x: dtype float32 -> float64' (or 'a new function, never compiled before')."""
    if not seen:
        return "a function or graph never compiled before"
    def diffs(old):
        before = {o.name: o for o in old if o.dtype is not None}
        out = [f"new input {n.name} ({n.describe()})" for n in new if n.dtype is not None and n.name not in before]
        for n in new:
            o = before.get(n.name)
            if o is None or n.dtype is None:
                continue
            if o.dtype != n.dtype:
                out.append(f"input {n.name}: dtype {dtype_name(o.dtype)} -> {dtype_name(n.dtype)}")
            elif o.shape != n.shape:
                out.append(f"input {n.name}: shape {o.describe()} -> {n.describe()}")
        return out or ["the same input signature (something else the guards check changed: a "
                       "Python value, a module attribute, grad mode...)"]

    best = min((diffs(old) for old in seen), key=len)
    return ", ".join(best[:4]) + (f" and {len(best) - 4} more" if len(best) > 4 else "")


def _as_call(item, device=None):
    """A warm-up item -> (args, kwargs): a tensor, a TensorSpec, a torch.Size (float32 zeros),
    a tuple/list of those (positional arguments) or a dict (keyword arguments). Zeros are made
    on `device` (a TensorSpec's own device first)."""
    def one(x):
        if isinstance(x, TensorSpec):
            return x.materialize(device)
        if isinstance(x, torch.Size):
            return torch.zeros(x, device=device)
        return x

    if isinstance(item, dict):
        return (), {k: one(v) for k, v in item.items()}
    if isinstance(item, (tuple, list)) and not isinstance(item, torch.Size):
        return tuple(one(x) for x in item), {}
    return (one(item),), {}


def warmup(compiled, inputs, progress: bool = True, device=None) -> dict:
    """Compile (or load from the disk cache) `compiled` for every input signature in `inputs`
    before traffic arrives, running it once on each. Returns what it took: signatures, XLA
    compiles, disk-cache loads and seconds. TensorSpec/torch.Size inputs are made on `device`,
    by default where the model's parameters live (a CUDA model warms up on its GPU)."""
    from tqdm.auto import tqdm

    before, t0 = metrics(), time.perf_counter()
    items = list(inputs)
    device = device if device is not None else _model_device(compiled)
    _state.warming_up += 1
    try:
        # Dynamo tries its newest graph first: once a later shape made a graph dynamic, earlier
        # shapes are served by it, so repeat until a pass specialises nothing new.
        for attempt in range(3):
            seen = metrics()["specializations"] + metrics()["graphs"]
            desc = "fx2xla warm-up" if attempt == 0 else "fx2xla warm-up (dynamic graphs)"
            for item in tqdm(items, desc=desc, unit="shape", disable=not progress):
                args, kwargs = _as_call(item, device)
                compiled(*args, **kwargs)
            if metrics()["specializations"] + metrics()["graphs"] == seen:
                break
    finally:
        _state.warming_up -= 1
    after = metrics()
    return {
        "signatures": len(items),
        "compiles": after["compiles"] - before["compiles"],
        "disk_loads": after["disk_hits"] - before["disk_hits"],
        "seconds": time.perf_counter() - t0,
    }
