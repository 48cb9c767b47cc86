"""Zero-copy tensor hand-off between torch and PJRT buffers through DLPack.

The fast import is a private jaxlib call; it sits behind `_private_importer` alone, with the
public `jax.dlpack.from_dlpack` as the fallback (`FX2XLA_PUBLIC_DLPACK=1` forces it).
"""
from __future__ import annotations

import os

import torch
import torch.utils.dlpack

_DLPACK_CPU = 1  # kDLCPU


def _private_importer():
    """jaxlib's direct DLPack import (~5 µs; keeps int64 with x64 off), or None if absent."""
    try:
        from jax._src.lib import _jax

        fn = _jax.dlpack_managed_tensor_to_buffer
    except (ImportError, AttributeError):
        return None

    def import_private(t: torch.Tensor, device):
        return fn(t.__dlpack__(), device, None, None, _DLPACK_CPU if t.device.type == "cpu" else None)

    return import_private


def _public_importer():
    import jax
    import jax.dlpack

    def import_public(t: torch.Tensor, device):
        # x64 scoped to this call so int64 stays int64 without touching the global flag.
        with jax.enable_x64(True):
            return jax.device_put(jax.dlpack.from_dlpack(t), device)

    return import_public


def make_importer(public: bool | None = None):
    """Return `import_tensor(t, jax_device) -> jax.Array`, sharing memory with `t` where possible.

    `t` must be densely packed (contiguous); callers make it so once per graph, not per call.
    """
    if public is None:
        public = os.environ.get("FX2XLA_PUBLIC_DLPACK", "") not in ("", "0")
    if not public:
        private = _private_importer()
        if private is not None:
            return private
    return _public_importer()


import_tensor = make_importer()


def export_array(a) -> torch.Tensor:
    """A PJRT buffer as a torch tensor (zero-copy; waits for the value if still computing)."""
    return torch.utils.dlpack.from_dlpack(a.__dlpack__())
