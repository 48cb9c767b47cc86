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

from .report import Collective, collectives, explain_sharding, fmt_bytes, graphs_of, note_compile_origin, per_device_bytes
from .specs import (MARK_SHARDING, Annotation, Mesh, ShardingError, Spec, annotation_of, clear_sharding, decode_spec,
                    describe_spec, encode_spec, fsdp, is_mark, mark_sharding, mesh_by_id, normalize_spec, shard_module)
from .tensor import ShardedTensor, forget_sharded_twins, keep_sharded_twin, sharded_twin, sharded_twins

__all__ = ["MARK_SHARDING", "Annotation", "Collective", "Mesh", "ShardedTensor", "ShardingError", "Spec",
           "annotation_of", "clear_sharding", "collectives", "decode_spec", "describe_spec", "encode_spec",
           "explain_sharding", "fmt_bytes", "forget_sharded_twins", "fsdp", "graphs_of", "is_mark",
           "keep_sharded_twin", "mark_sharding", "mesh_by_id", "normalize_spec", "note_compile_origin",
           "per_device_bytes", "shard_module", "sharded_twin", "sharded_twins"]
