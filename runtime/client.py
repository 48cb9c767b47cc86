"""Device selection: `PJRT_DEVICE=CPU|CUDA|TPU` (default CPU) picks jaxlib's PJRT client.

Memory policy: jax's GPU client takes 75% of the GPU when it starts, leaving torch the rest.
fx2xla shares the GPU with torch, so unless the user set `XLA_PYTHON_CLIENT_PREALLOCATE` (or
`XLA_PYTHON_CLIENT_MEM_FRACTION` / `XLA_PYTHON_CLIENT_ALLOCATOR`) themselves, it turns the
preallocation off before any client starts: XLA then allocates what its executables need, as
they need it. This takes effect only if jax's GPU client was not started before fx2xla was
imported (a process that used jax on the GPU first keeps jax's defaults).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

_USER_MEMORY_SETTINGS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                         "XLA_PYTHON_CLIENT_ALLOCATOR")
if not any(v in os.environ for v in _USER_MEMORY_SETTINGS):
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

# Devices fx2xla compiled for (noted at compile time, never per call): what metrics() reports on.
used_devices: set = set()

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


def device_memory(device: Device) -> dict:
    """Memory XLA holds on `device`: the platform's own counters where it reports them (GPU,
    TPU: bytes in use, peak and limit), else the bytes of the client's live buffers there."""
    stats = device.jax_device.memory_stats()
    if stats:
        return {"bytes_in_use": stats.get("bytes_in_use"), "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                "bytes_limit": stats.get("bytes_limit")}
    jax_device = device.jax_device
    in_use = sum(b.nbytes for b in device.client.live_buffers() if b.device == jax_device) \
        if hasattr(device.client, "live_buffers") else None
    return {"bytes_in_use": in_use, "peak_bytes_in_use": None, "bytes_limit": None}
