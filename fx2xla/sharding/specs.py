"""Meshes, specs and annotations: `Mesh`, `mark_sharding`, `shard_module`, `fsdp`, and the
`fx2xla::mark_sharding` op that carries a constraint through Dynamo and AOTAutograd."""
from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from ..errors import Fx2XlaError
from ..runtime import client

# Meshes by id: the op carries an int, so a traced graph names its mesh without holding jax
# objects (ids are never reused within a process).
_meshes: dict[int, "Mesh"] = {}
_mesh_ids = itertools.count()
_lock = threading.Lock()

Spec = tuple  # per dim: a tuple of mesh axis names (empty: not sharded on that dim)


class ShardingError(Fx2XlaError, ValueError):
    """A sharding that cannot apply: unknown axis, wrong rank, an axis used twice, ... (raised
    while compiling, it reaches the caller as itself, not wrapped by Dynamo)."""


class Mesh:
    """A logical device mesh: `shape` (ints) over the first prod(shape) devices of a platform,
    or `devices` (runtime Devices or jax devices, flat or nested), named by `axis_names`."""

    def __init__(self, shape_or_devices, axis_names, *, platform: str | None = None):
        import numpy as np

        axis_names = tuple(axis_names)
        if len(set(axis_names)) != len(axis_names) or not all(isinstance(a, str) and a for a in axis_names):
            raise ShardingError(f"fx2xla.Mesh: axis names must be distinct non-empty strings, got {axis_names}")
        if all(isinstance(s, int) for s in shape_or_devices):
            shape = tuple(shape_or_devices)
            platform = platform or client.platform_from_env()
            devices = list(client.get_backend(platform).devices())
            if math.prod(shape) > len(devices) or any(s < 1 for s in shape):
                raise ShardingError(
                    f"fx2xla.Mesh{shape} needs {math.prod(shape)} {platform} devices; this process has "
                    f"{len(devices)} ({', '.join(str(d.id) for d in devices)}). On a CPU, "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count=N (before jax starts) gives N devices.")
            grid = np.array(devices[: math.prod(shape)], dtype=object).reshape(shape)
        else:
            arr = np.array(shape_or_devices, dtype=object)
            grid = np.vectorize(lambda d: d.jax_device if isinstance(d, client.Device) else d, otypes=[object])(arr)
            shape = grid.shape
        if len(shape) != len(axis_names):
            raise ShardingError(f"fx2xla.Mesh: {len(shape)} mesh dims {tuple(shape)} but {len(axis_names)} "
                                f"axis names {axis_names}")
        flat = list(grid.flat)
        if len({id(d) for d in flat}) != len(flat):
            raise ShardingError("fx2xla.Mesh: a device appears twice")
        # jax names CUDA devices' platform "gpu"; fx2xla's runtime (and PJRT_DEVICE) say "cuda".
        platforms = {"cuda" if d.platform == "gpu" else d.platform for d in flat}
        if len(platforms) != 1:
            raise ShardingError(f"fx2xla.Mesh: devices of several platforms {sorted(platforms)}")
        self.platform = platforms.pop()
        self.axis_names = axis_names
        self.shape = dict(zip(axis_names, (int(s) for s in shape)))
        self.devices = grid  # jax devices, in mesh order
        self.size = len(flat)
        from jax.sharding import AxisType
        from jax.sharding import Mesh as JaxMesh

        # Auto axes: shardings are hints Shardy propagates (jax's default is Explicit types).
        self.jax_mesh = JaxMesh(grid, axis_names, axis_types=(AxisType.Auto,) * len(axis_names))
        import jax

        # Devices of other processes (jax.distributed): each process hands in, and gets back,
        # only its own devices' shards; whole values are gathered by a collective.
        self.spans_processes = any(d.process_index != jax.process_index() for d in flat)
        with _lock:
            self.id = next(_mesh_ids)
            _meshes[self.id] = self

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices.flat)

    def named_sharding(self, spec: Spec):
        from jax.sharding import NamedSharding, PartitionSpec

        return NamedSharding(self.jax_mesh, PartitionSpec(*(axes if axes else None for axes in spec)))

    def __repr__(self) -> str:
        dims = ", ".join(f"{a}={n}" for a, n in self.shape.items())
        return f"fx2xla.Mesh({dims}; {self.platform} devices {list(self.device_ids)})"


def mesh_by_id(mesh_id: int) -> Mesh:
    try:
        return _meshes[mesh_id]
    except KeyError:
        raise ShardingError(f"fx2xla: no mesh with id {mesh_id} in this process") from None


def normalize_spec(spec, ndim: int, mesh: Mesh, what: str = "tensor") -> Spec:
    """`spec` (axis names / None / tuples per dim, or DTensor placements per mesh axis) as a
    tuple of axis-name tuples, one per dim; raises ShardingError naming what is wrong."""
    if _is_placements(spec):
        return _from_placements(spec, ndim, mesh, what)
    spec = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
    if len(spec) > ndim:
        raise ShardingError(f"fx2xla.mark_sharding: spec {spec} has {len(spec)} entries for a {ndim}-d {what}")
    out, used = [], set()
    for d, entry in enumerate(spec + (None,) * (ndim - len(spec))):
        axes = () if entry is None else (entry,) if isinstance(entry, (str, int)) else tuple(entry)
        names = []
        for a in axes:
            if isinstance(a, int) and not isinstance(a, bool):  # PyTorch/XLA: mesh axis index
                if not 0 <= a < len(mesh.axis_names):
                    raise ShardingError(f"fx2xla.mark_sharding: mesh axis index {a} out of range for {mesh}")
                a = mesh.axis_names[a]
            if a not in mesh.shape:
                raise ShardingError(f"fx2xla.mark_sharding: unknown mesh axis {a!r} in spec {spec} "
                                    f"(mesh axes: {mesh.axis_names})")
            if a in used:
                raise ShardingError(f"fx2xla.mark_sharding: mesh axis {a!r} used twice in spec {spec}")
            used.add(a)
            names.append(a)
        out.append(tuple(names))
    return tuple(out)


def _is_placements(spec) -> bool:
    try:
        from torch.distributed.tensor.placement_types import Placement
    except ImportError:
        return False
    return isinstance(spec, (tuple, list)) and len(spec) > 0 and all(isinstance(p, Placement) for p in spec)


def _from_placements(placements, ndim: int, mesh: Mesh, what: str) -> Spec:
    from torch.distributed.tensor.placement_types import Replicate, Shard

    if len(placements) != len(mesh.axis_names):
        raise ShardingError(f"fx2xla.mark_sharding: {len(placements)} placements for a mesh of "
                            f"{len(mesh.axis_names)} axes {mesh.axis_names}")
    dims: list[list[str]] = [[] for _ in range(ndim)]
    for axis, p in zip(mesh.axis_names, placements):
        if isinstance(p, Shard):
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise ShardingError(f"fx2xla.mark_sharding: {p} on a {ndim}-d {what}")
            dims[d].append(axis)
        elif not isinstance(p, Replicate):
            raise ShardingError(f"fx2xla.mark_sharding: placement {p} is not supported (Shard or Replicate)")
    return tuple(tuple(a) for a in dims)


def encode_spec(spec: Spec) -> str:
    """The op's string form of a spec: "<ndim>:" then dims separated by "|", axes by ","."""
    return f"{len(spec)}:" + "|".join(",".join(axes) for axes in spec)


def decode_spec(text: str) -> Spec:
    ndim, _, body = text.partition(":")
    if int(ndim) == 0:
        return ()
    return tuple(tuple(a for a in dim.split(",") if a) for dim in body.split("|"))


def describe_spec(spec: Spec) -> str:
    """("data", None, ("x", "y")) style, as a user writes it."""
    parts = ["None" if not a else repr(a[0]) if len(a) == 1 else repr(a) for a in spec]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


@dataclass(frozen=True)
class Annotation:
    """An eager tensor's sharding (set by mark_sharding, read when a graph is planned)."""

    mesh_id: int
    spec: Spec
    source: str = "user"  # or "forward": a saved activation's sharding, given to its backward graph

    @property
    def mesh(self) -> Mesh:
        return mesh_by_id(self.mesh_id)


def annotation_of(t) -> Annotation | None:
    return getattr(t, "_fx2xla_sharding", None) if isinstance(t, torch.Tensor) else None


@torch.library.custom_op("fx2xla::mark_sharding", mutates_args=())
def _mark_sharding_op(x: torch.Tensor, mesh: int, spec: str) -> torch.Tensor:
    # Eager (outside fx2xla's executables) a constraint changes nothing: the values are equal.
    return x.clone()


@_mark_sharding_op.register_fake
def _(x, mesh, spec):
    return torch.empty_like(x)


def _mark_backward(ctx, grad):
    return torch.ops.fx2xla.mark_sharding(grad, ctx.mesh, ctx.spec), None, None


def _mark_setup(ctx, inputs, output):
    _, ctx.mesh, ctx.spec = inputs


_mark_sharding_op.register_autograd(_mark_backward, setup_context=_mark_setup)

MARK_SHARDING = torch.ops.fx2xla.mark_sharding.default


def is_mark(node) -> bool:
    """A constraint node: the overload in AOTAutograd's graphs, the packet in Dynamo's."""
    return node.op == "call_function" and node.target in (MARK_SHARDING, torch.ops.fx2xla.mark_sharding)


# Not dead code when its result is unused: the `sharding_annotations` pass gives the
# constraint to the value's later uses.
torch.fx.node.has_side_effect(MARK_SHARDING)


@torch.compiler.assume_constant_result
def _spec_key(mesh_id: int, spec, ndim: int) -> str:
    return encode_spec(normalize_spec(spec, ndim, mesh_by_id(mesh_id)))


def mark_sharding(t: torch.Tensor, mesh: Mesh, spec) -> torch.Tensor:
    """Shard `t` over `mesh` by `spec` (see the module doc). Eager: records it on `t` (an input,
    parameter or buffer of a compiled graph) and returns `t`. Inside compiled code: a sharding
    constraint; returns the constrained value."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fx2xla.mark_sharding: expected a tensor, got {type(t).__name__}")
    if torch.compiler.is_compiling():
        return torch.ops.fx2xla.mark_sharding(t, mesh.id, _spec_key(mesh.id, spec, t.dim()))
    normalized = normalize_spec(spec, t.dim(), mesh)
    t._fx2xla_sharding = Annotation(mesh.id, normalized)
    return t


def clear_sharding(t: torch.Tensor) -> None:
    """Forget an eager tensor's sharding (graphs compiled since keep theirs)."""
    if hasattr(t, "_fx2xla_sharding"):
        del t._fx2xla_sharding


def shard_module(module: torch.nn.Module, mesh: Mesh, plan: dict[str, Any]) -> dict[str, Spec]:
    """Mark the parameters and buffers of `module` whose qualified names match a pattern of
    `plan` (fnmatch: `*` spans dots, e.g. "layers.*.mlp.up.weight" or "*.q_proj.weight") with its
    spec; the first matching pattern wins. Returns {name: spec} of what was marked. A pattern
    that matches nothing raises: a silent typo would leave the model replicated."""
    marked: dict[str, Spec] = {}
    hits = {p: 0 for p in plan}
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        for pattern, spec in plan.items():
            if fnmatchcase(name, pattern):
                mark_sharding(t, mesh, spec)
                marked[name] = t._fx2xla_sharding.spec
                hits[pattern] += 1
                break
    unused = [p for p, n in hits.items() if not n]
    if unused:
        raise ShardingError(f"fx2xla.shard_module: pattern(s) {unused} match no parameter or buffer of "
                            f"{type(module).__name__}")
    return marked


def fsdp(module: torch.nn.Module, mesh: Mesh, axis: str = "fsdp", min_elements: int = 0) -> dict[str, Spec]:
    """Fully sharded data parallel: every parameter is split over mesh axis `axis` along its
    largest dim the axis size divides (dim 0 first on ties); gradients inherit the sharding
    through the backward constraint and optimizer state follows its parameter in compiled
    optimizer steps. Parameters under `min_elements`, or with no divisible dim, stay replicated.
    Returns {name: spec}. Batches are sharded on the same axis by the caller (`mark_sharding(x,
    mesh, (axis, None))`), as in PyTorch/XLA's FSDPv2."""
    if axis not in mesh.shape:
        raise ShardingError(f"fx2xla.fsdp: mesh {mesh} has no axis {axis!r}")
    n = mesh.shape[axis]
    marked = {}
    for name, p in module.named_parameters():
        dims = [d for d in range(p.dim()) if p.shape[d] % n == 0 and p.shape[d] >= n]
        if not dims or p.numel() < min_elements:
            continue
        d = max(dims, key=lambda d: (p.shape[d], -d))
        spec = tuple(axis if i == d else None for i in range(p.dim()))
        mark_sharding(p, mesh, spec)
        marked[name] = p._fx2xla_sharding.spec
    return marked
