"""PJRT executor: device selection, executable cache, tensor hand-off and execution.

Nothing here imports the fx2xla frontend or passes; the backend composes them.
"""
from .client import Device, default_device, device_for, get_backend
from .cache import ExecutableCache, executable_cache
from .executor import compile_module, optimized_hlo_text

__all__ = [
    "Device",
    "default_device",
    "device_for",
    "get_backend",
    "ExecutableCache",
    "executable_cache",
    "compile_module",
    "optimized_hlo_text",
]
