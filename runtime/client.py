"""Device selection: `PJRT_DEVICE=CPU|CUDA|TPU` (default CPU) picks jaxlib's PJRT client.

Memory policy: jax's GPU client takes 75% of the GPU when it starts, leaving torch the rest.
fx2xla shares the GPU with torch, so unless the user set `XLA_PYTHON_CLIENT_PREALLOCATE` (or
`XLA_PYTHON_CLIENT_MEM_FRACTION` / `XLA_CLIENT_MEM_FRACTION` / `XLA_PYTHON_CLIENT_ALLOCATOR`) themselves, it turns the
preallocation off before any client starts: XLA then allocates what its executables need, as
they need it. This takes effect only if jax's GPU client was not started before fx2xla was
imported (a process that used jax on the GPU first keeps jax's defaults).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

# (XLA_CLIENT_MEM_FRACTION is the newer spelling of the fraction that jax also reads.)
_USER_MEMORY_SETTINGS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                         "XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
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

    if platform == "cpu":  # read as the client starts, which is when jax reads it too
        _cpu_async_dispatch.append(_async_dispatch_setting())
    return jax.extend.backend.get_backend(platform)


_cpu_async_dispatch: list = []  # the setting when fx2xla first asked for the CPU client


def _async_dispatch_setting() -> bool:
    import jax

    try:
        return bool(jax.config.read("jax_cpu_enable_async_dispatch"))
    except (AttributeError, KeyError):  # a jax without the setting dispatches asynchronously
        return True


def cpu_dispatch_is_async() -> bool:
    """Whether jax's CPU client runs an execution on its own threads, as it does by default,
    rather than on the launching thread until it ends (jax config `jax_cpu_enable_async_dispatch`
    set False before the client started; jax reads it once, then, and so does this: at
    fx2xla's first use of the CPU client, which starts it unless jax code ran before)."""
    get_backend("cpu")  # records the setting the first time
    return _cpu_async_dispatch[0]


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
        return self.client.local_devices()[local_position(self.platform, self.index)]

    @property
    def kind(self) -> str:
        return self.jax_device.device_kind

    def __str__(self) -> str:
        return f"{self.platform}:{self.index}"

    @property
    def torch_device(self):
        """This device as torch names it, or None where this torch cannot hold tensors there
        (a CPU build of torch beside jax's CUDA plugin)."""
        import torch

        if self.platform == "cpu":
            return torch.device("cpu")
        if self.platform in ("cuda", "rocm") and torch.cuda.is_available():
            return torch.device("cuda", self.index)
        return None

    def holds(self, device) -> bool:
        """Whether torch tensors on `device` (a torch.device) live on this PJRT device."""
        if device.type == "cpu":
            return self.platform == "cpu"
        return device.type == "cuda" and self.platform in ("cuda", "rocm") and (device.index or 0) == self.index


def _hardware_ids(devices) -> list | None:
    """Each local device's number on its host, where jax.distributed gave this process only
    some of the host's accelerators (local_device_ids: one GPU per torchrun process); None where
    jax numbers them as the host does (every CPU, every unrestricted process)."""
    ids = [getattr(d, "local_hardware_id", None) for d in devices]
    if not ids or None in ids or ids == list(range(len(ids))):
        return None
    return ids


def local_position(platform: str, index: int) -> int:
    """The position in `platform`'s local_devices() of the device torch numbers `index`: the
    same number, unless this process was given some of its host's GPUs only (jax numbers those
    from 0, torch keeps the host's numbers: cuda:3 is jax's local device 0 under torchrun's
    fourth process)."""
    if platform == "cpu":
        return index
    ids = _hardware_ids(get_backend(platform).local_devices())
    if ids is None:
        return index
    try:
        return ids.index(index)
    except ValueError:
        raise ValueError(f"fx2xla: {platform}:{index} is not one of this process's devices (its "
                         f"{platform} devices are {', '.join(f'{platform}:{i}' for i in ids)}; "
                         "jax.distributed gave it those)") from None


def torch_index(jax_device) -> int:
    """The number torch gives one of this process's jax devices (see local_position)."""
    platform = "cuda" if jax_device.platform == "gpu" else jax_device.platform
    devices = get_backend(platform).local_devices()
    position = next(i for i, d in enumerate(devices) if d.id == jax_device.id)
    ids = None if platform == "cpu" else _hardware_ids(devices)
    return position if ids is None else ids[position]


def device_of(device) -> Device:
    """The PJRT device that holds torch tensors on `device` (cpu -> CPU 0, cuda:N -> CUDA N)."""
    if device.type == "cpu":
        return Device("cpu", 0)
    return Device(_platform_of(device), device.index or 0)


def platform_from_env() -> str:
    name = os.environ.get("PJRT_DEVICE", "CPU").strip().upper()
    if name not in _PLATFORMS:
        raise ValueError(
            f"fx2xla: PJRT_DEVICE={name!r} is not one of {sorted(_PLATFORMS)}; "
            "unset it for the CPU client"
        )
    return _PLATFORMS[name]


def local_device(platform: str, index: int, why: str) -> Device:
    """Device `index` of `platform`'s client; `why` says what chose it (for the errors)."""
    try:
        n = len(get_backend(platform).local_devices())
    except RuntimeError as e:  # no plugin for that platform installed
        hint = "pip install 'fx2xla[cuda13]' (jax's CUDA plugin)" if platform == "cuda" else "install the jax plugin for it"
        raise RuntimeError(f"fx2xla: {why} needs jax's {platform!r} PJRT client, which is not available ({e}); "
                           f"{hint}, or set PJRT_DEVICE to a platform you have") from e
    if platform != "cpu" and _hardware_ids(get_backend(platform).local_devices()) is not None:
        local_position(platform, index)  # raises, naming this process's devices, if not one of them
    elif not 0 <= index < n:
        raise ValueError(f"fx2xla: device index {index} ({why}) but {platform} has {n} devices")
    return Device(platform, index)


def _explicit_index(index: int | None) -> int | None:
    if index is not None:
        return int(index)
    env = os.environ.get("FX2XLA_DEVICE_INDEX")
    return int(env) if env not in (None, "") else None


def default_device(index: int | None = None) -> Device:
    """The device `PJRT_DEVICE` names (default CPU): device `index`, else `FX2XLA_DEVICE_INDEX`,
    else 0."""
    platform = platform_from_env()
    index = _explicit_index(index)
    return local_device(platform, 0 if index is None else index, f"PJRT_DEVICE={platform}")


def _platform_of(device) -> str:
    """The jax platform of a torch device (a ROCm build of torch calls its GPUs "cuda" too)."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        import torch

        return "rocm" if torch.version.hip else "cuda"
    raise ValueError(f"fx2xla: tensors on {device} have no jax PJRT client to run on; move them to cuda or cpu")


def device_for(devices, index: int | None = None) -> Device:
    """The PJRT device a graph runs on, as Inductor picks it: where its tensors live. `devices`:
    the torch devices of the graph's tensor inputs (0-d CPU scalars left out: they mix with any
    device). Tensors on `cuda:N` run on CUDA device N; CPU tensors on the CPU client; tensors on
    two accelerators are an error. `PJRT_DEVICE`, when set, overrides the platform, and `index`
    (option device_index) or `FX2XLA_DEVICE_INDEX` the device index."""
    if os.environ.get("PJRT_DEVICE", "").strip():
        return default_device(index)
    accelerators = sorted({d for d in devices if d.type != "cpu"}, key=str)
    if len(accelerators) > 1:
        raise ValueError(f"fx2xla: one graph reads tensors on {', '.join(map(str, accelerators))}; "
                         "eager PyTorch refuses that too: move them to one device")
    explicit = _explicit_index(index)
    if not accelerators:
        return local_device("cpu", 0 if explicit is None else explicit, "CPU tensors")
    device = accelerators[0]
    chosen = (device.index or 0) if explicit is None else explicit
    return local_device(_platform_of(device), chosen, f"tensors on {device}")


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
