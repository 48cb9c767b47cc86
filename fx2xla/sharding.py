"""SPMD: a device mesh, sharding annotations that survive compilation, and FSDP.

    mesh = fx2xla.Mesh((2, 4), ("data", "model"))       # 8 devices of the default platform
    fx2xla.mark_sharding(x, mesh, ("data", None))       # eager: on an input, parameter, buffer
    fx2xla.shard_module(model, mesh, {"*.fc1.weight": ("model", None)})
    fx2xla.fsdp(model, mesh_1d, axis="fsdp")
    compiled = torch.compile(model, backend="fx2xla")   # one SPMD executable over the mesh

A spec has one entry per tensor dim: None (not sharded), a mesh axis name, or a tuple of axis
names (the dim is split over their product), as PyTorch/XLA and JAX spell it; a list of
DTensor placements (`Shard(d)`, `Replicate()`, one per mesh axis) is accepted too.

Eager, `mark_sharding(t, ...)` records the sharding on `t` itself and returns it: compiled
graphs that take `t` as an input (or parameter) hand it to the executable as per-device shards.
Inside compiled code it is the op `fx2xla::mark_sharding`, a sharding constraint on the value,
which Dynamo and AOTAutograd carry through forward and backward (its gradient gets the same
constraint). Its result is the constrained tensor; when it is discarded the constraint still
applies to the value's later uses (the `sharding_annotations` pass rewires them).
"""
from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from .errors import Fx2XlaError

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

        from .runtime.client import Device, get_backend, platform_from_env

        axis_names = tuple(axis_names)
        if len(set(axis_names)) != len(axis_names) or not all(isinstance(a, str) and a for a in axis_names):
            raise ShardingError(f"fx2xla.Mesh: axis names must be distinct non-empty strings, got {axis_names}")
        if all(isinstance(s, int) for s in shape_or_devices):
            shape = tuple(shape_or_devices)
            platform = platform or platform_from_env()
            devices = list(get_backend(platform).devices())
            if math.prod(shape) > len(devices) or any(s < 1 for s in shape):
                raise ShardingError(
                    f"fx2xla.Mesh{shape} needs {math.prod(shape)} {platform} devices; this process has "
                    f"{len(devices)} ({', '.join(str(d.id) for d in devices)}). On a CPU, "
                    f"XLA_FLAGS=--xla_force_host_platform_device_count=N (before jax starts) gives N devices.")
            grid = np.array(devices[: math.prod(shape)], dtype=object).reshape(shape)
        else:
            arr = np.array(shape_or_devices, dtype=object)
            grid = np.vectorize(lambda d: d.jax_device if isinstance(d, Device) else d, otypes=[object])(arr)
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


class ShardedTensor(torch.Tensor):
    """A compiled graph's output left on its devices (`options={"outputs": "sharded"}`): a torch
    tensor of the global shape whose data stays as the executable's per-device shards.

    - `shards()`: the distinct pieces, each a torch tensor sharing its device's buffer, with its
      index (a tuple of slices into the global shape). No copy, no collective.
    - `full_tensor()`: the whole value as a plain tensor, assembled once (in one process; in
      several, every process must call it: it gathers the others' shards) and kept.
    - Any torch op on it works, on the whole value (assembled on first use). An fx2xla graph over
      the same mesh that reads it takes its shards as they are.
    - `array`: the global jax Array; `mesh`, `spec`: its layout (`fx2xla.mark_sharding` terms)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, array, mesh_id: int, spec: Spec, dtype: torch.dtype, device: torch.device, assemble=None,
                whole=None):
        shape = tuple(array.shape) if array is not None else tuple(whole.shape)
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        t._array, t._assemble, t._whole, t._lock = array, assemble, whole, threading.Lock()
        t._fx2xla_sharding = Annotation(mesh_id, spec)
        return t

    @property
    def array(self):
        return self._array

    @property
    def mesh(self) -> Mesh:
        return self._fx2xla_sharding.mesh

    @property
    def spec(self) -> Spec:
        return self._fx2xla_sharding.spec

    def shards(self) -> list[tuple[tuple[slice, ...], torch.Tensor]]:
        """(index, piece) per distinct shard this process holds, in device order; each piece
        shares its device buffer's memory (a replica over another mesh axis is listed once)."""
        out = []
        with _recording():
            for shard in self._array.addressable_shards:
                if shard.replica_id == 0:
                    out.append((shard.index, torch.from_dlpack(shard.data)))
        return out

    def local_tensor(self) -> torch.Tensor:
        """The block of the value this process's devices hold, as one tensor (the whole value in
        a single process). Raises where those shards do not tile one block."""
        pieces = self.shards()
        lo = [min(i[d].start or 0 for i, _ in pieces) for d in range(self.dim())]
        hi = [max(i[d].stop if i[d].stop is not None else self.shape[d] for i, _ in pieces)
              for d in range(self.dim())]
        box = math.prod(h - l for l, h in zip(lo, hi))
        if box != sum(p.numel() for _, p in pieces):
            raise ShardingError(f"fx2xla: this process's shards of a {tuple(self.shape)} tensor sharded "
                                f"{describe_spec(self.spec)} over {self.mesh} do not form one block")
        block = torch.empty([h - l for l, h in zip(lo, hi)], dtype=self.dtype, device=self.device)
        for index, piece in pieces:
            block[tuple(slice((s.start or 0) - l, (s.stop if s.stop is not None else n) - l)
                        for s, l, n in zip(index, lo, self.shape))] = piece
        return block

    @classmethod
    def from_local(cls, local: torch.Tensor, mesh: Mesh, spec) -> "ShardedTensor":
        """A global tensor from each process's own part of it (a data loader's batch per process):
        `local` is this process's block, laid out by `spec` over `mesh`; the global shape scales
        each sharded dim by the number of processes along it. Every process calls it."""
        import jax

        spec = normalize_spec(spec, local.dim(), mesh)
        with _recording():
            data = jax.dlpack.from_dlpack(local.detach().cpu().contiguous())
            array = jax.make_array_from_process_local_data(mesh.named_sharding(spec), data)
        return cls(array, mesh.id, spec, local.dtype, local.device)

    def full_tensor(self) -> torch.Tensor:
        whole = self._whole
        if whole is not None:
            return whole
        with self._lock:
            if self._whole is None:
                self._whole = self._materialize()
            return self._whole

    def _materialize(self) -> torch.Tensor:
        with _recording():
            if self._array.is_fully_addressable:
                whole = self._assemble() if self._assemble is not None else _assemble(self)
            else:
                whole = gather(self._array, self.device)
        from .compiled_graph import _keep_sharded_twin

        _keep_sharded_twin(whole, self._array)  # a sharded graph reading it takes the shards
        return whole

    # Dynamo and AOTAutograd see the whole value (assembled when a traced graph first reads it;
    # an fx2xla graph then finds its shards through the twin recorded above).
    def __tensor_flatten__(self):
        return ["_full"], (self._fx2xla_sharding.mesh_id, self.spec)

    @property
    def _full(self) -> torch.Tensor:
        return self.full_tensor()

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        # Tracing's stand-in: the whole (fake) value, with the layout.
        whole = inner["_full"]
        return ShardedTensor(None, *meta, whole.dtype, whole.device, whole=whole)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def whole(x):
            return x.full_tensor() if isinstance(x, ShardedTensor) else x

        args, kwargs = torch.utils._pytree.tree_map(whole, (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"ShardedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, spec={describe_spec(self.spec)}, "
                f"mesh={self.mesh!r})")


def _recording():
    """Recording of jax tracebacks on while making jax objects that outlive the call (another
    thread's compiled call may have paused it, see runtime/executor.py)."""
    from .runtime.executor import make_recording

    return make_recording()()


def gather(array, device: torch.device) -> torch.Tensor:
    """The whole value of a global jax Array whose shards live in several processes (each holds
    its own devices'): a collective every process must take part in, in the same order."""
    from jax.experimental import multihost_utils

    whole = multihost_utils.process_allgather(array, tiled=True)
    return torch.from_numpy(whole if whole.flags.writeable else whole.copy()).to(device)


def _assemble(t: ShardedTensor) -> torch.Tensor:
    whole = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    for index, piece in t.shards():
        whole[index] = piece
    return whole


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


# -- explain ---------------------------------------------------------------------------------

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
              "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclass(frozen=True)
class Collective:
    """One collective in an optimized HLO module: op, result type (per device), bytes of the
    result, and the devices in each of its groups (0: not read from the HLO)."""

    op: str
    type: str
    bytes: int
    group: int = 0

    @property
    def moved(self) -> float:
        """Bytes each device sends by a ring over its group: what the auto-sharding cost model
        prices. An all-reduce moves 2 (n-1)/n of its result, an all-gather or all-to-all
        (n-1)/n, a reduce-scatter (n-1) times its result (a 1/n share of its operand), a
        permute its result. Unknown group: the result's bytes."""
        n = self.group
        if n == 1:
            return 0.0
        if n < 1 or self.op == "collective-permute":
            return float(self.bytes)
        share = {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": n - 1}.get(self.op, (n - 1) / n)
        return self.bytes * share


def collectives(hlo_text: str) -> list[Collective]:
    """The collectives XLA's partitioner put in an optimized (per-device) HLO module, with the
    bytes of each result (async pairs are counted once, at their start)."""
    import re

    pattern = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(")
    found = []
    for line in hlo_text.splitlines():
        # A long tuple's shape numbers its elements in comments, "/*index=5*/", whose "=" would
        # end the match early and drop the shapes before it.
        m = pattern.search(re.sub(r"/\*.*?\*/", "", line))
        if m is None:
            continue
        types = re.findall(r"([a-z]+\d*)\[([\d,]*)\]", m.group(1))
        sizes = [_HLO_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in types]
        # An async start returns (operand, result, ...): its last shape is the result.
        nbytes = sizes[-1] if m.group(3) and sizes else sum(sizes)
        found.append(Collective(m.group(2), m.group(1).strip(), nbytes, _group_size(line)))
    return found


def _group_size(line: str) -> int:
    """The devices in each replica group of an HLO collective, in any of the forms XLA prints:
    `mesh['x'=2,'y'=4] {'y'}` (the named axes' sizes), `[2,4]<=[8]` (groups x size, an iota),
    `{{0,1},{2,3}}` (explicit). 0 if there is none to read."""
    import re

    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m is not None:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", m.group(2)))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)
    if m is not None:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m is not None:
        return len([d for d in m.group(1).split(",") if d])
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _per_device(shape, spec, mesh: Mesh) -> int:
    parts = 1
    for axes in spec:
        parts *= math.prod(mesh.shape[a] for a in axes)
    return math.prod(shape) // parts if parts else 0


# -- which compiled object a graph belongs to --------------------------------------------------

# The graphs of one Dynamo compile share a name prefix ("g<frame>_<compile>_", see the backend's
# _graph_name); a backward graph, compiled later by autograd, has its forward's. Names repeat
# after torch._dynamo.reset(), so each prefix keeps a list of origins, newest last: the
# torch.compile context that was running (a weak reference), what it compiled in words, whether
# that is an optimizer's step, and which graphs are its: those of the prefix made after it was
# noted (the live ones then are `before`), until the prefix is noted again (then fixed, `mine`).
_origins: dict = {}


@dataclass
class _Origin:
    ctx: Any
    label: str
    optimizer: bool
    before: Any
    mine: Any = None

    def owns(self, g) -> bool:
        return g in self.mine if self.mine is not None else g not in self.before


def note_compile_origin(prefix: str) -> None:
    """Called by the backend as Dynamo hands it a graph (the graph names start with `prefix`):
    records which `torch.compile(...)` result is running, found as the innermost of Dynamo's
    compile wrappers on the Python stack (each result has its own context object)."""
    import sys
    import weakref

    from .metrics import live_graphs

    ctx_type = _dynamo_context_type()
    if ctx_type is None:
        return
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "compile_wrapper":
            local = f.f_locals
            ctx = local.get("self")
            if isinstance(ctx, ctx_type):
                try:
                    ref = weakref.ref(ctx)
                except TypeError:
                    return
                fn = local.get("fn")
                for k in list(_origins):  # contexts gone
                    _origins[k] = [o for o in _origins[k] if o.ctx() is not None]
                    if not _origins[k]:
                        del _origins[k]
                live = weakref.WeakSet(g for g in list(live_graphs) if g.name.startswith(prefix))
                entries = _origins.setdefault(prefix, [])
                if entries and entries[-1].mine is None:
                    last = entries[-1]
                    last.mine = weakref.WeakSet(g for g in live if g not in last.before)
                entries.append(_Origin(ref, _describe_callable(fn), _is_optimizer_step(fn), live))
                return
        f = f.f_back


def _origin_of(g):
    for prefix, entries in _origins.items():
        if g.name.startswith(prefix):
            return next((o for o in reversed(entries) if o.owns(g)), None)
    return None


def _dynamo_context_type():
    try:
        from torch._dynamo.eval_frame import _TorchDynamoContext
    except ImportError:  # a torch without it: compiled objects are not recognised
        return None
    return _TorchDynamoContext


def _is_optimizer_step(fn) -> bool:
    return isinstance(getattr(fn, "__self__", None), torch.optim.Optimizer)


def _describe_callable(fn) -> str:
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return f"{type(owner).__name__}"
    if owner is not None and not isinstance(owner, type(torch)):
        return f"{type(owner).__name__}.{getattr(fn, '__name__', '?')}"
    wrapped = getattr(fn, "__wrapped__", None)
    if isinstance(wrapped, torch.nn.Module):
        return type(wrapped).__name__
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _dynamo_context_of(obj):
    """The torch.compile context of what torch.compile returned (an OptimizedModule, or a
    compiled function or method); None for anything else."""
    ctx_type = _dynamo_context_type()
    if ctx_type is None:
        return None
    ctx = getattr(obj, "dynamo_ctx", None) if isinstance(obj, torch.nn.Module) else None
    if isinstance(ctx, ctx_type):
        return ctx
    if callable(obj) and hasattr(obj, "_torchdynamo_orig_callable"):
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, ctx_type):
                return value
    return None


def _role(g) -> str:
    """What a graph is, in words: forward, backward, optimizer step, inference; and of what."""
    origin = _origin_of(g)
    kind = next((k for k in ("forward", "backward", "inference") if f"_{k}" in g.name), "graph")
    if origin is None:
        return kind
    if origin.optimizer:
        return f"optimizer step ({origin.label})"
    return f"{kind} of {origin.label}"


def _graph_order(g):
    """Compile order: the numbers in the graph's name, forward before backward."""
    import re

    kinds = {"forward": 0, "backward": 1, "inference": 2}
    kind = next((v for k, v in kinds.items() if f"_{k}" in g.name), 3)
    return [int(n) for n in re.findall(r"\d+", g.name.split("_forward")[0].split("_backward")[0]
                                          .split("_inference")[0])], kind, g.name


def graphs_of(compiled) -> list:
    """The live fx2xla graphs (CompiledGraph) of what `torch.compile(..., backend="fx2xla")`
    returned: a compiled module's forward and backward graphs, a compiled function's or
    optimizer step's graphs, in compile order. Raises TypeError for anything that is not a
    compiled module or function."""
    from .metrics import live_graphs

    ctx = _dynamo_context_of(compiled)
    if ctx is None:
        raise TypeError(f"fx2xla.explain_sharding: expected what torch.compile(..., backend=\"fx2xla\") returned "
                        f"(a compiled module, function or optimizer step), a CompiledGraph, a list of them, or None "
                        f"for every live sharded graph; got {type(compiled).__name__}")
    found = []
    for g in list(live_graphs):
        origin = _origin_of(g)
        if origin is not None and origin.ctx() is ctx:
            found.append(g)
    return sorted(found, key=_graph_order)


def explain_sharding(graph=None, file=None) -> str:
    """A report of how compiled graphs are sharded: per input and per result its spec, where
    the spec came from (user, propagated, default), bytes per device; the constraints inside;
    the collectives XLA's partitioner inserted (from the optimized HLO); each device's memory.
    `graph`: what `torch.compile(..., backend="fx2xla")` returned (a compiled module: its
    forward and backward graphs; a compiled function or optimizer step: its graphs), once it
    has run; a CompiledGraph; a list of any of these; or None for every live sharded graph.
    Each graph is named, with what it is (forward, backward, optimizer step) and of what.
    Printed to `file` when given; returned."""
    from .compiled_graph import CompiledGraph
    from .metrics import live_graphs
    from .runtime.executor import optimized_hlo_text

    if graph is None:
        graphs = sorted((g for g in list(live_graphs) if g.mesh is not None), key=_graph_order)
    else:
        graphs = []
        for item in (list(graph) if isinstance(graph, (list, tuple)) else [graph]):
            if isinstance(item, CompiledGraph):
                graphs.append(item)
                continue
            found = graphs_of(item)
            if not found:
                what = _describe_callable(getattr(item, "_orig_mod", None) and item._orig_mod.forward
                                          or getattr(item, "_torchdynamo_orig_callable", item))
                ctx = _dynamo_context_of(item)
                if any(o.ctx() is ctx for entries in _origins.values() for o in entries):
                    raise ValueError(f"fx2xla.explain_sharding: the compiled {what} ran, but its fx2xla graphs are "
                                     f"gone (torch._dynamo.reset() or a recompile dropped them): call it again")
                raise ValueError(f"fx2xla.explain_sharding: the compiled {what} has no fx2xla graphs yet: call it "
                                 f"once first (torch.compile compiles at the first call; a training step's backward "
                                 f"graph at the first backward), with backend=\"fx2xla\"")
            graphs += [g for g in found if g not in graphs]
    lines = []
    for g in graphs:
        plan = g.plan
        role = _role(g)
        if g.mesh is None:
            lines.append(f"graph {g.name} ({role}): one device ({g.device}), not sharded")
            continue
        mesh, sh = g.mesh, plan.shardings
        lines.append(f"graph {g.name} ({role}) over {mesh}")
        solution = getattr(g, "auto_sharding", None)
        if solution is not None:
            origin = f" (reused from the {solution.cached} cache)" if getattr(solution, "cached", None) else ""
            lines.append(f"  auto-sharding{origin}: {solution.status} in {solution.seconds:.2f} s ({solution.variables} "
                         f"variables); predicted: {_fmt_bytes(solution.collective_bytes)} of collectives per device, "
                         f"peak {_fmt_bytes(solution.memory_bytes)} per device ({_fmt_bytes(solution.input_bytes)} of "
                         f"inputs), ~{solution.objective * 1e3:.3f} ms"
                         + (f"; compiled peak {_fmt_bytes(solution.xla_peak_bytes)} per device (XLA's memory analysis)"
                            if getattr(solution, "xla_peak_bytes", None) is not None else ""))
        placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
        names = getattr(g, "input_names", None) or [n.name for n in placeholders]
        rows = [("input", n, p.sharding, name) for n, p, name in zip(placeholders, plan.inputs, names) if p.passed]
        rows += [("result", r.node, r.sharding, r.node.name) for r in plan.results]
        rows += [("constraint", n, sh.spec(n), n.name) for n in g.gm.graph.nodes if is_mark(n)]
        width = max([24] + [len(r[3]) for r in rows])
        for kind, node, spec, name in rows:
            val = node.meta.get("val")
            shape = tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else ()
            dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "?"
            whole = math.prod(shape) * (val.element_size() if isinstance(val, torch.Tensor) else 0)
            mine = _per_device(shape, spec, mesh) * (val.element_size() if isinstance(val, torch.Tensor) else 0)
            lines.append(f"  {kind:10s} {name:{width}s} {dtype:>8s}{list(shape)!s:>16s}  {describe_spec(spec):24s} "
                         f"{sh.source(node):10s} {_fmt_bytes(mine)}/device of {_fmt_bytes(whole)}")
        spec_ = g._static
        if spec_ is None:
            lines.append("  (dynamic shapes: collectives and memory per specialization, once compiled)")
            continue
        found = collectives(optimized_hlo_text(spec_.exe))
        if found:
            by_op: dict = {}
            for c in found:
                n, b = by_op.get(c.op, (0, 0))
                by_op[c.op] = (n + 1, b + c.bytes)
            lines.append("  collectives: " + ", ".join(f"{op} x{n} ({_fmt_bytes(b)})" for op, (n, b) in by_op.items()))
            for c in found:
                lines.append(f"    {c.op:20s} {c.type}")
        else:
            lines.append("  collectives: none")
        stats = spec_.exe.get_compiled_memory_stats()
        lines.append(f"  memory per device: arguments {_fmt_bytes(stats.argument_size_in_bytes)}, outputs "
                     f"{_fmt_bytes(stats.output_size_in_bytes)}, temporaries {_fmt_bytes(stats.temp_size_in_bytes)}")
    text = "\n".join(lines)
    if file is not None:
        print(text, file=file)
    return text
