"""Zero-copy tensor hand-off between torch and PJRT buffers through DLPack.

The fast paths are private jaxlib calls; each sits behind one small function here
(`_private_importer`, `_private_exporter`), with jax's public DLPack API as the fallback.
`FX2XLA_PUBLIC_DLPACK=1` forces the public paths.
"""
from __future__ import annotations

import os

import torch
import torch.utils.dlpack

_DLPACK_CPU = 1  # kDLCPU
_to_capsule = torch.utils.dlpack.to_dlpack  # public, and ~4 µs cheaper than Tensor.__dlpack__
_from_capsule = torch.utils.dlpack.from_dlpack


def _private_importer():
    """jaxlib's direct DLPack import (~5 µs; keeps int64 with x64 off), or None if absent."""
    try:
        from jax._src.lib import _jax

        fn = _jax.dlpack_managed_tensor_to_buffer
    except (ImportError, AttributeError):
        return None

    def import_private(t: torch.Tensor, device):
        return fn(_to_capsule(t), device, None, None, None)

    return import_private


def _public_importer():
    import jax
    import jax.dlpack

    def import_public(t: torch.Tensor, device):
        # x64 scoped to this call so int64 stays int64 without touching the global flag.
        with jax.enable_x64(True):
            return jax.device_put(jax.dlpack.from_dlpack(t), device)

    return import_public


def _private_exporter():
    """jaxlib's direct buffer -> DLPack capsule (skips ~5 µs of Python in `Array.__dlpack__`)."""
    try:
        from jax._src.lib import _jax

        fn = _jax.buffer_to_dlpack_managed_tensor
    except (ImportError, AttributeError):
        return None

    # torch's C entry point skips from_dlpack's Python checks (~0.7 µs); public one if absent.
    from_capsule = getattr(torch._C, "_from_dlpack", _from_capsule)

    def export_private(a) -> torch.Tensor:
        return from_capsule(fn(a, None))

    return export_private


def _public_exporter():
    def export_public(a) -> torch.Tensor:
        return _from_capsule(a.__dlpack__())

    return export_public


def _use_public(public: bool | None, switch: str = "FX2XLA_PUBLIC_DLPACK") -> bool:
    if public is None:
        return os.environ.get(switch, "") not in ("", "0")
    return public


def make_importer(public: bool | None = None):
    """`import_tensor(t, jax_device) -> jax.Array`, sharing memory with `t` where possible
    (a copy when `t` is not 64-byte aligned). `t` must be dense and row-major; callers make
    it so with a plan decided once per graph, not per call."""
    private = None if _use_public(public) else _private_importer()
    return private or _public_importer()


def make_exporter(public: bool | None = None):
    """`export_array(a) -> torch.Tensor` sharing the PJRT buffer's memory; it waits for a
    result that is still being computed."""
    private = None if _use_public(public) else _private_exporter()
    return private or _public_exporter()


import_tensor = make_importer()
export_array = make_exporter()
