"""Device selection: `PJRT_DEVICE=CPU|CUDA|TPU` (default CPU) picks jaxlib's PJRT client."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

# PJRT_DEVICE values (PyTorch/XLA's spelling) -> jax platform names.
_PLATFORMS = {"CPU": "cpu", "CUDA": "cuda", "GPU": "cuda", "ROCM": "rocm", "TPU": "tpu"}


@functools.cache
def get_backend(platform: str):
    """The jaxlib PJRT client for a jax platform name ("cpu", "cuda", "tpu")."""
    import jax.extend.backend  # a submodule import is required

    return jax.extend.backend.get_backend(platform)


@dataclass(frozen=True)
class Device:
    """One PJRT device: the client that owns it and the jax device object."""

    platform: str
    index: int

    @property
    def client(self):
        return get_backend(self.platform)

    @property
    def jax_device(self):
        return self.client.local_devices()[self.index]

    @property
    def kind(self) -> str:
        return self.jax_device.device_kind

    def __str__(self) -> str:
        return f"{self.platform}:{self.index}"


def platform_from_env() -> str:
    name = os.environ.get("PJRT_DEVICE", "CPU").strip().upper()
    if name not in _PLATFORMS:
        raise ValueError(
            f"fx2xla: PJRT_DEVICE={name!r} is not one of {sorted(_PLATFORMS)}; "
            "unset it for the CPU client"
        )
    return _PLATFORMS[name]


def default_device() -> Device:
    """The device fx2xla compiles for: `PJRT_DEVICE` picks the platform, `FX2XLA_DEVICE_INDEX`
    the local device (default 0)."""
    platform = platform_from_env()
    index = int(os.environ.get("FX2XLA_DEVICE_INDEX", "0"))
    try:
        n = len(get_backend(platform).local_devices())
    except RuntimeError as e:  # no plugin for that platform installed
        raise RuntimeError(
            f"fx2xla: no PJRT client for PJRT_DEVICE={platform!r} ({e}); install the jax "
            "plugin for it or unset PJRT_DEVICE"
        ) from e
    if not 0 <= index < n:
        raise ValueError(f"fx2xla: FX2XLA_DEVICE_INDEX={index} but {platform} has {n} devices")
    return Device(platform, index)
