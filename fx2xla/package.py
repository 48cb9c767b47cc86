"""Export a model to a package, and load it with no tracing.

    fx2xla.export(model, (ids,), "gpt2.fx2xla")     # torch.export -> the same lowering -> StableHLO
    run = fx2xla.load("gpt2.fx2xla")                # no Dynamo, no AOTAutograd, no lowering
    logits = run(ids)

A package is a folder:
    manifest.json         format and version, the versions that built it, the calling
                          convention (inputs with their static sizes and dynamic ranges,
                          outputs, written buffers, index checks), sha256 of every other file
    weights.safetensors   parameters, buffers and constant tensors, by their names
    module-N.stablehlo    per set of input shapes N, the portable StableHLO artifact
                          (versioned MLIR bytecode): what any jaxlib that reads its version
                          compiles from
    executable-N-<key>.bin  its executable for the device and jaxlib it was built with
    program.pt2           with dynamic_shapes: the exported program, lowered at load time for
                          each new shape (no tracing)

`load` deserializes the executable when one fits the device and jaxlib, else compiles the
portable module. Without dynamic_shapes the package serves the example inputs' shapes, and
says so when a call differs.

A loaded model returns what the model returned: tensors in the same tuples, lists, dicts,
namedtuples and transformers ModelOutputs, with its None and Python numbers, and transformers'
dynamic caches (DynamicCache, EncoderDecoderCache: what an LM returns with use_cache=True)
rebuilt around the new key/value tensors (the manifest's "output_tree" holds that structure).
Other objects are refused at export, with what to change.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
import warnings

import safetensors.torch
import torch

from .compiled_graph import compile_lowered
from .decompositions import decomposition_table
from .errors import Fx2XlaError
from .layouts import inverse
from .lowering.checks import INDEX, CheckRecord
from .lowering.graph import lower_graph, symbol_bindings
from .lowering.linalg import check_linear_layout
from .plan import (InputKind, build_plan, from_json, json_value, outputs_from_record, outputs_record, plan_from_record,
                   plan_record)
from .plan_executor import PlanExecutor, Specialization, install_input
from . import torch_kernels as _torch_kernels
from .runtime import compile_module, default_device, device_for
from .runtime.client import local_device
from .runtime.executor import compile_options
from .sharding import annotation_of, is_mark
from .version import __version__

FORMAT = "fx2xla-package"
# 2: the manifest holds the plan's record (plan.plan_record); 1 kept its fields beside the
# inputs and is still read. 3: effect tokens among the inputs and outputs (a graph with
# torch.linalg's error checks); written only for such graphs, which an fx2xla reading 2 cannot run.
FORMAT_VERSION = 3
_MANIFEST = "manifest.json"
_WEIGHTS = "weights.safetensors"
_PROGRAM = "program.pt2"


class PackageError(Fx2XlaError, ValueError):
    """A package that cannot be loaded: foreign, from a newer format, corrupted, or called with
    inputs it was not built for."""


def _export_table() -> dict:
    """AOTAutograd's decomposition table minus the attention entries: torch.export keeps the
    composite SDPA op (which has its own rule), and its math decomposition re-traced here
    gives the attention output other strides than the model's later views expect."""

    return {k: v for k, v in decomposition_table().items() if "dot_product" not in str(k)}


def _executable_key(device, platform_version: str, kernels: bool = False) -> str:
    """The key of an executable for `device` and this jaxlib; `kernels`: one that calls the
    kernel library's custom calls, which only this build of the library may run."""
    import jaxlib

    raw = f"{jaxlib.version.__version__}|{device.platform}|{device.kind}|{platform_version}"
    if kernels:
        raw += f"|torch_kernels-{_torch_kernels.build_key()}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def _kernels_here(device) -> bool:
    """Whether modules lowered here for `device` may call the kernel library (a CPU where it is
    built, loaded and not turned off)."""
    return device.platform == "cpu" and any(_torch_kernels.available(k) for k in _torch_kernels.KINDS)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _target_version() -> str:
    """The StableHLO version to write: ~12 weeks old, so a jaxlib of the last three months reads it."""
    from jaxlib.mlir.dialects import stablehlo

    return stablehlo.get_version_from_compatibility_requirement(stablehlo.StablehloCompatibilityRequirement.WEEK_12)


def _portable_private(module_text: str) -> tuple[str, bytes]:
    # jaxlib's serializer (jax.export's), which also legalizes CHLO ops (chlo.square, ...).
    from jax._src.lib import _jax

    return "portable", _jax.mlir.serialize_portable_artifact(module_text, _target_version(), False)


def _portable_public(module_text: str) -> tuple[str, bytes]:
    # The public StableHLO serializer refuses CHLO ops; such modules are kept as MLIR text,
    # which PJRT compiles as well, though only a jaxlib that parses this one's text can.
    from jaxlib.mlir.dialects import stablehlo

    try:
        return "portable", stablehlo.serialize_portable_artifact_str(module_text, _target_version())
    except Exception:  # noqa: BLE001
        return "text", module_text.encode()


def portable_module(module_text: str, public: bool | None = None) -> tuple[str, bytes]:
    """(format, bytes): the module as a versioned StableHLO portable artifact ("portable"),
    or as MLIR text ("text") where only that is possible. Private jaxlib serializer first;
    `FX2XLA_PUBLIC_EXPORT=1` (or `public=True`) forces the public path."""
    if public is None:
        public = os.environ.get("FX2XLA_PUBLIC_EXPORT", "") not in ("", "0")
    if not public:
        try:
            return _portable_private(module_text)
        except (ImportError, AttributeError):
            pass
    return _portable_public(module_text)


# The model's return value. torch.export takes flat outputs, and refuses objects it has no pytree
# for (a transformers LM's DynamicCache): the model is exported through _FlatOutputs, which
# returns the tensors of its result as a flat tuple and records the result's structure as a JSON
# tree (node kinds below); the loaded model rebuilds that structure around its results with
# closures made once at load.
#   {"leaf": i}                              the i-th flat output (a tensor, or a SymInt)
#   {"const": v}                             None, bool, int, float, str or dtype, as exported
#   {"tuple": [n...]}, {"list": [n...]}      {"dict": [[key, n]...]}
#   {"named": cls, "items": [n...], "structseq": bool}   a namedtuple, or torch.return_types.*
#   {"output": cls, "fields": [[name, n]...]}             a transformers ModelOutput
#   {"object": cls, "state": [[attr, n]...]}              a cache (_CARRIED_OBJECTS), by its state
#   {"class": cls}                           a class held by a cache (layer_class_to_replicate)
#   {"device": true}                         a torch.device held by a cache: the loaded model's
_WRAPPED = "model"  # the attribute _FlatOutputs holds the model in; stripped from weight names
# Caches carried by their attributes (their tensors as outputs, the rest in the tree), rebuilt
# without running their __init__: transformers' dynamic caches, the default of every LM.
_CARRIED_OBJECTS = ("transformers.cache_utils:DynamicCache", "transformers.cache_utils:EncoderDecoderCache",
                    "transformers.cache_utils:DynamicLayer", "transformers.cache_utils:DynamicSlidingWindowLayer",
                    "transformers.cache_utils:DummyLayer")


def _class_name(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(name: str):
    import importlib

    module, qualname = name.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _cannot_carry(value, where: str, why: str = "", cache: str | None = None) -> PackageError:
    """The error for an output (at `where`, inside the cache of class `cache` if any) that a
    package cannot carry, with what to change."""
    name = _class_name(type(value)).replace(":", ".")
    is_cache = any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in type(value).__mro__)
    if is_cache or cache is not None:
        held = f" (held by the model's {cache.replace(':', '.')})" if cache is not None and not is_cache else ""
        hint = (f"{held}: pass use_cache=False to the model (or set model.config.use_cache = False), keep the "
                "default DynamicCache (no offloading, no quantization, not static), or wrap the model to return "
                "the cache's tensors")
    else:
        hint = (": return tensors, or tuples, lists, dicts, namedtuples or transformers ModelOutputs of them (or "
                "wrap the model so it does); for a transformers cache other than DynamicCache / "
                "EncoderDecoderCache, pass use_cache=False")
    return PackageError(f"fx2xla.export: the model returns {where}, a {name}, which a package cannot carry"
                        f"{why}{hint}")


def _importable(cls, value, where: str, cache: str | None = None) -> str:
    name = _class_name(cls)
    try:
        ok = _import_class(name) is cls
    except (ImportError, AttributeError, ValueError):
        ok = False
    if not ok:
        raise _cannot_carry(value, where, " (its class cannot be imported by name where the package is loaded)", cache)
    return name


def _flatten_output(value, leaves: list, where: str = "output", cache: str | None = None):
    """The JSON tree of `value` (see above), appending its tensors (and SymInts) to `leaves`.
    `where`: the value's place in the model's result, for errors; `cache`: the class of the
    cache it is part of, if any."""
    import sys

    if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        leaves.append(value)
        return {"leaf": len(leaves) - 1}
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return {"const": json_value(value)}
    cls = type(value)
    generic = sys.modules.get("transformers.utils.generic")
    if generic is not None and isinstance(value, generic.ModelOutput):
        return {"output": _importable(cls, value, where, cache),
                "fields": [[k, _flatten_output(v, leaves, f"{where}.{k}", cache)] for k, v in value.items()]}
    if _class_name(cls) in _CARRIED_OBJECTS:
        cache = cache or _class_name(cls)
        state = []
        for k, v in vars(value).items():
            if isinstance(v, type):
                state.append([k, {"class": _importable(v, v, f"{where}.{k}", cache)}])
            elif isinstance(v, torch.device):
                state.append([k, {"device": True}])
            else:
                state.append([k, _flatten_output(v, leaves, f"{where}.{k}", cache)])
        return {"object": _class_name(cls), "state": state}
    if cls in (tuple, list):
        return {cls.__name__: [_flatten_output(v, leaves, f"{where}[{i}]", cache) for i, v in enumerate(value)]}
    if isinstance(value, tuple) and (hasattr(cls, "_fields") or cls.__module__ == "torch.return_types"):
        return {"named": _importable(cls, value, where, cache), "structseq": not hasattr(cls, "_fields"),
                "items": [_flatten_output(v, leaves, f"{where}[{i}]", cache) for i, v in enumerate(value)]}
    if cls is dict:
        items = []
        for k, v in value.items():
            if not (k is None or isinstance(k, (bool, int, float, str))):
                raise _cannot_carry(value, where, f" (its key {k!r} is not a str, int, float, bool or None)", cache)
            items.append([k, _flatten_output(v, leaves, f"{where}[{k!r}]", cache)])
        return {"dict": items}
    raise _cannot_carry(value, where, cache=cache)


class _FlatOutputs(torch.nn.Module):
    """`model` as torch.export takes it: its result's tensors as a flat tuple, the structure in
    `record["tree"]`. Its forward has the model's signature, so dynamic_shapes keyed by the
    model's argument names and the graph's input names are the model's. (`record` is no
    attribute of the module: torch.export restores the attributes a forward assigns.)"""

    def __init__(self, model: torch.nn.Module, record: dict):
        import inspect

        super().__init__()
        setattr(self, _WRAPPED, model)
        self.training = model.training  # its own flag only: the model's modules keep theirs

        def forward(*args, **kwargs):
            leaves = []
            try:
                record["tree"] = _flatten_output(model(*args, **kwargs), leaves)
            except PackageError as e:
                record["error"] = e  # raised by export() as it is, whatever torch.export makes of it
                raise
            return tuple(leaves)

        try:
            forward.__signature__ = inspect.signature(model.forward)
        except (TypeError, ValueError):
            pass
        self.forward = forward


def _output_builder(tree, torch_device):
    """A function results -> the model's return value, made once at load. Packages written
    before the tree was recorded return their outputs flat (one, or a tuple)."""
    if tree is None:
        return lambda results: results[0] if len(results) == 1 else tuple(results)
    if "leaf" in tree:
        i = tree["leaf"]
        return lambda results: results[i]
    if "tuple" in tree and all("leaf" in n for n in tree["tuple"]):
        order = [n["leaf"] for n in tree["tuple"]]
        if order == list(range(len(order))):
            return tuple  # the results are the tuple's items, in order
    return _builder(tree, torch_device)


def _builder(node, torch_device):
    if "leaf" in node:
        i = node["leaf"]
        return lambda r: r[i]
    if "const" in node:
        value = from_json(node["const"])
        return lambda r: value
    if "device" in node:
        return lambda r: torch_device
    if "class" in node:
        cls = _import_class(node["class"])
        return lambda r: cls
    if "tuple" in node or "list" in node:
        kind = tuple if "tuple" in node else list
        parts = [_builder(n, torch_device) for n in node[kind.__name__]]
        return lambda r: kind([f(r) for f in parts])
    if "dict" in node:
        parts = [(k, _builder(n, torch_device)) for k, n in node["dict"]]
        return lambda r: {k: f(r) for k, f in parts}
    if "named" in node:
        cls = _import_class(node["named"])
        parts = [_builder(n, torch_device) for n in node["items"]]
        if node["structseq"]:
            return lambda r: cls([f(r) for f in parts])
        return lambda r: cls(*[f(r) for f in parts])
    if "output" in node:
        cls = _import_class(node["output"])
        parts = [(k, _builder(n, torch_device)) for k, n in node["fields"]]
        return lambda r: cls(**{k: f(r) for k, f in parts})
    if "object" in node:
        if node["object"] not in _CARRIED_OBJECTS:
            raise PackageError(f"fx2xla.load: the package returns a {node['object']}, which this fx2xla "
                               "does not rebuild: upgrade fx2xla")
        cls = _import_class(node["object"])
        new = cls.__new__
        parts = [(k, _builder(n, torch_device)) for k, n in node["state"]]

        def build(r):
            obj = new(cls)
            obj.__dict__.update({k: f(r) for k, f in parts})
            return obj
        return build
    raise PackageError(f"fx2xla.load: an output node {node!r} in the manifest is not one this fx2xla reads")


def _warn_unsharded(model, example_inputs, gm) -> None:
    """Packages hold one-device executables: say so when the model was sharded (values are the
    same; only the layout over devices is not kept)."""

    tensors = [*model.parameters(), *model.buffers(), *example_inputs]
    if any(annotation_of(t) is not None for t in tensors) or any(is_mark(n) for n in gm.graph.nodes):
        warnings.warn("fx2xla.export: the model is sharded (mark_sharding / shard_module / fsdp), but packages "
                      "do not keep shardings yet: the package runs on one device, with the same values",
                      stacklevel=3)


def export(model: torch.nn.Module, example_inputs, path: str, dynamic_shapes=None,
           check_indices: bool = True, transposed_linear_weights: bool | str = True,
           linear_weight_lhs: bool = True) -> str:
    """Export `model` at `example_inputs` (positional tensors) through `torch.export`, lower it
    with fx2xla's rules for the device its parameters live on, compile it, and write a package
    to the folder `path` (created; an existing package there is replaced). Returns `path`.

    dynamic_shapes: as `torch.export.export` takes them (e.g. `{"x": {0: Dim("batch")}}`). The
    package then also holds the exported program; a loaded model lowers and compiles each new
    shape once (no tracing), through the disk cache.

    The model may return tensors in tuples, lists, dicts (keys: str, int, float, bool, None),
    namedtuples, torch.return_types and transformers ModelOutputs, Python numbers and None, and
    transformers' DynamicCache / EncoderDecoderCache (a causal LM with use_cache=True); the
    loaded model returns the same structure. Anything else (a StaticCache, an offloaded or
    quantized cache, another object) raises PackageError naming it and what to change.

    transposed_linear_weights: exported on a CPU, float32 nn.Linear weights that only matmuls of
    two rows or more read are laid out [in, out] where XLA:CPU's dot reads them faster so on the
    exporting machine, as torch.compile's option of that name decides it (the loaded model holds
    them so, once); "always": every such weight; False keeps them as torch holds them.

    linear_weight_lhs: exported on a CPU with static shapes, float32 matmuls of 4-64 rows against
    such a weight compute (W . x^T)^T, the weight as torch holds it, as torch.compile's option of
    that name does (a dynamic batch has no static row count: its matmuls stay x . W^T); those of
    2-8 rows run in the kernel library's few-row matmul where the library is built (as
    torch.compile's option torch_kernels does by default; the package's portable module computes
    them as (W . x^T)^T). False: x . W^T, on weights laid out as transposed_linear_weights says."""

    example_inputs = tuple(example_inputs)
    if not all(isinstance(x, torch.Tensor) for x in example_inputs):
        raise TypeError("fx2xla.export: example_inputs must be a tuple of tensors (the model's positional inputs)")
    check_linear_layout(transposed_linear_weights, "fx2xla.export: ")
    if not isinstance(linear_weight_lhs, bool):
        raise ValueError(f"fx2xla.export: linear_weight_lhs={linear_weight_lhs!r}; expected True or False")
    t0 = time.perf_counter()
    record = {}  # the output tree, or the PackageError that refused an output
    try:
        program = torch.export.export(_FlatOutputs(model, record), example_inputs, dynamic_shapes=dynamic_shapes)
    except Exception:
        if "error" in record:
            raise record["error"] from None
        raise
    program = program.run_decompositions(_export_table())
    gm = program.graph_module
    _warn_unsharded(model, example_inputs, gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [n.meta["val"] for n in placeholders]
    signature = program.graph_signature
    state = {**program.state_dict, **program.constants}
    inputs, weights, shared, concrete = [], {}, {}, []
    user = iter(example_inputs)
    for spec, node, fake in zip(signature.input_specs, placeholders, fakes):
        kind = spec.kind.name.lower()  # parameter, buffer, constant_tensor, user_input, ...
        if kind == "user_input":
            inputs.append({"kind": "user", "name": node.name, "dims": _dims(fake, program.range_constraints)})
            concrete.append(next(user))
            continue
        if kind == "token":  # with_effects' token: no value (plan.effect_tokens)
            inputs.append({"kind": "token", "name": node.name})
            concrete.append(None)
            continue
        if kind not in ("parameter", "buffer", "constant_tensor"):
            raise PackageError(f"fx2xla.export: graph input {node.name} of kind {kind} is not supported")
        tensor = state[spec.target].detach()
        name = _model_name(spec.target)
        # Tied weights (an LM head sharing the embedding) are stored once.
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)
        stored = shared.setdefault(key, name)
        if stored == name:
            weights[name] = tensor.contiguous()
        inputs.append({"kind": kind, "name": name, "weight": stored})
        concrete.append(tensor)
    dynamic = any(isinstance(d, dict) for spec in inputs for d in spec.get("dims", ()))
    device = device_for([v.device for v in fakes if isinstance(v, torch.Tensor) and not (v.device.type == "cpu" and v.dim() == 0)])
    # On a CPU, weights laid out as a compiled CPU inference graph has them (plan.build_plan):
    # convolution weights channels-last (pinned, for torch's convolutions to pack once where the
    # package's executable with them runs), float32 nn.Linear weights [in, out]. The plan's
    # record keeps the layouts, and a dynamic package lowers new shapes with them (_lower's
    # `layouts`); the manifest's "linear_weights_kn" says which export option made them.
    cpu = device.platform == "cpu"
    kn = transposed_linear_weights if cpu and transposed_linear_weights else False
    lhs = cpu and linear_weight_lhs
    # Matmuls of 2-8 rows in the kernel library's few-row matmul where it is built here: the
    # native module calls it; the portable one computes them with the weight on the left.
    few = lhs and _torch_kernels.available("few_rows_matmul")
    plan, lowered = _lower(gm, fakes, device, inputs, concrete if dynamic else None, check_indices, kn,
                           relaid_weights=cpu, linear_weight_lhs=lhs, few_row_kernel=few)
    # XLA's kernels only in the portable module: a package compiles anywhere, with or without a
    # build of the kernel library. Beside it, an executable with the library's custom calls,
    # which loads where the same build of the library runs (its key says which).
    native = _native(gm, fakes, plan, concrete if dynamic else None, check_indices, device, lowered)
    for spec, fake in zip(inputs, fakes):
        spec["dtype"] = str(fake.dtype).removeprefix("torch.")
    # Inputs the graph writes (BatchNorm statistics, counters, caches; user inputs written in
    # place): torch.export returns their new contents as leading outputs, which the loaded
    # model installs in them after each call instead of returning them.
    position = {spec["name"]: i for i, spec in enumerate(inputs)}  # buffer FQNs, user input names
    written, tokens = [], []
    for j, spec in enumerate(signature.output_specs):
        kind = spec.kind.name.lower()
        if kind in ("buffer_mutation", "user_input_mutation"):
            written.append([position[_model_name(spec.target)], j])
        elif kind == "token":
            tokens.append(j)
        elif kind != "user_output":
            raise PackageError(f"fx2xla.export: a graph output of kind {kind} is not supported")

    os.makedirs(path, exist_ok=True)
    for old in os.listdir(path):
        if old in (_MANIFEST, _WEIGHTS, _PROGRAM) or old.startswith(("module-", "executable-")):
            os.remove(os.path.join(path, old))
    safetensors.torch.save_file({k: v.cpu() for k, v in weights.items()}, os.path.join(path, _WEIGHTS))
    files = [_WEIGHTS]
    if dynamic:
        torch.export.save(program, os.path.join(path, _PROGRAM))
        files.append(_PROGRAM)
    shapes = [list(x.shape) for x in example_inputs]
    variant = _write_variant(path, 0, device, lowered, shapes, compile_here=True, native=native)
    files += [variant["module"], *variant["executables"].values()]
    import jax
    import jaxlib


    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION if tokens else 2,
        "built_with": {"fx2xla": _version(), "torch": torch.__version__, "jax": jax.__version__,
                       "jaxlib": jaxlib.version.__version__},
        "platform": device.platform, "device_kind": device.kind,
        "compile_options": compile_options(device.platform).SerializeAsString().hex(),
        "inputs": inputs, "plan": plan_record(plan), "written_outputs": written, "token_outputs": tokens,
        "output_tree": record["tree"],
        "dynamic": dynamic, "check_indices": check_indices, "linear_weights_kn": kn,
        "weight_lhs_matmuls": len(plan.weight_lhs), "few_row_matmuls": len(plan.few_rows), "variants": [variant],
        "export_seconds": time.perf_counter() - t0,
        "files": {name: {"sha256": _sha256(os.path.join(path, name)), "bytes": os.path.getsize(os.path.join(path, name))}
                  for name in files},
    }
    with open(os.path.join(path, _MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return path


def _model_name(target: str) -> str:
    """A parameter's, buffer's or constant's name in the model (not in _FlatOutputs)."""
    prefix = _WRAPPED + "."
    return target[len(prefix):] if target.startswith(prefix) else target


def _dims(fake: torch.Tensor, ranges) -> list:
    """Per dim of an input: its size, or {"min", "max"} for a dynamic one (max None: unbounded)."""
    dims = []
    for d in fake.shape:
        if isinstance(d, torch.SymInt):
            r = ranges.get(d.node.expr)
            low = int(r.lower) if r is not None else 0
            high = int(r.upper) if r is not None and r.upper.is_finite else None
            dims.append({"min": low, "max": high})
        else:
            dims.append(int(d))
    return dims


def _lower(gm, fakes, device, inputs, concrete, check_indices, linear_weights_kn: bool = False,
           kernels: bool = False, relaid_weights: bool = False, layouts=None, linear_weight_lhs: bool = False,
           few_row_kernel: bool = False):
    """(plan, lowered) of an exported graph on `device`, at the shapes of `concrete` (all
    placeholders' values) or, for static graphs (None), at the example shapes.
    `linear_weights_kn`, `relaid_weights` (and pinned weights with it), `linear_weight_lhs`,
    `few_row_kernel`: plan.build_plan's.
    `kernels`: the module may call the kernel library (a module for this machine only; the
    portable one never does). `layouts`: per input, the (kind, perm) a loaded package's plan
    passes it in, which the module takes whatever this device's plan would choose (the
    lowering permutes every input back to torch's order, so any recorded layout is sound)."""

    resident = {i for i, spec in enumerate(inputs) if spec["kind"] != "user"}
    plan = build_plan(gm, fakes, device, resident, relaid_weights=relaid_weights, pinned_weights=relaid_weights,
                      linear_weights_kn=linear_weights_kn, linear_weight_lhs=linear_weight_lhs,
                      few_row_kernel=few_row_kernel)
    if layouts is not None:
        plan.inputs = [dataclasses.replace(p, kind=kind, perm=perm) for p, (kind, perm) in zip(plan.inputs, layouts)]
    if plan.concats:
        raise PackageError("fx2xla.export: graphs that concatenate their inputs in torch are not supported")
    lowered = lower_graph(gm, plan, fakes, concrete, check_indices=check_indices, torch_kernels=kernels)
    return plan, (lowered if concrete is None else _at_shapes(lowered, fakes, concrete))


def _native(gm, fakes, plan, concrete, check_indices, device, portable):
    """The module of `plan` lowered with the kernel library's custom calls (torch's oneDNN
    convolutions, the skinny bf16 matmul), where this machine has the library and the module
    differs from the `portable` one (LoweredGraph); else None."""
    if not _kernels_here(device):
        return None
    native = lower_graph(gm, plan, fakes, concrete, check_indices=check_indices,
                         torch_kernels=_torch_kernels.for_graph(True, training=False))
    native = native if concrete is None else _at_shapes(native, fakes, concrete)
    if native.module_text == portable.module_text or outputs_record(native.outputs) != outputs_record(portable.outputs):
        return None
    return native


def _at_shapes(lowered, fakes, concrete):
    """`lowered` with its outputs' strides and view arguments (symbolic in a dynamic graph: a
    slice of a cache) as numbers at the shapes of `concrete`, as a variant stores them."""

    bindings = symbol_bindings(fakes, concrete)

    def fix(v):
        if isinstance(v, (tuple, list)):
            return type(v)(fix(x) for x in v)
        for sym, cast in ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool)):
            if isinstance(v, sym):
                return cast(v.node.expr.xreplace(bindings))
        return v

    outputs = [dataclasses.replace(o, stride=fix(o.stride), views=tuple((op, fix(args)) for op, args in o.views))
               for o in lowered.outputs]
    return dataclasses.replace(lowered, outputs=outputs)


def _variant_json(lowered, shapes) -> dict:
    try:
        outputs = outputs_record(lowered.outputs)
    except TypeError as e:
        raise PackageError(f"fx2xla.export: {e}") from None
    record = {"shapes": shapes, "outputs": outputs, "checks": [r.message for r in lowered.checks]}
    if any(r.error != INDEX for r in lowered.checks):
        # Beside "checks", so that an fx2xla that predates it still reads the package (and
        # raises its index error for a failed linear-algebra check).
        record["check_errors"] = [r.error for r in lowered.checks]
    return record


def _write_variant(path, n, device, lowered, shapes, compile_here: bool, native=None) -> dict:
    """Write variant `n` (one set of input shapes): its portable module and, when
    `compile_here`, its executable for `device`, and the executable of `native` (the module with
    the kernel library's custom calls) where there is one. Returns its manifest entry."""

    variant = _variant_json(lowered, shapes)
    module_format, module_bytes = portable_module(lowered.module_text)
    variant["module"], variant["module_format"] = f"module-{n}.stablehlo", module_format
    with open(os.path.join(path, variant["module"]), "wb") as f:
        f.write(module_bytes)
    variant["executables"] = {}
    if compile_here:
        for module, kernels in ((lowered, False), (native, True)):
            if module is None:
                continue
            # Compiled afresh, not taken from the caches: an executable that was itself
            # deserialized (the disk cache's) serializes without its object code on XLA:CPU.
            exe = device.client.compile_and_load(module.module_text, [device.jax_device], compile_options(device.platform))
            key = _executable_key(device, device.client.platform_version, kernels)
            variant["executables"][key] = f"executable-{n}-{key}.bin"
            with open(os.path.join(path, variant["executables"][key]), "wb") as f:
                f.write(device.client.serialize_executable(exe))
    return variant


def _version() -> str:
    return __version__


def _read_manifest(path: str) -> dict:
    file = os.path.join(path, _MANIFEST)
    if not os.path.isfile(file):
        raise PackageError(f"fx2xla.load: {path!r} is not an fx2xla package (no {_MANIFEST})")
    try:
        with open(file) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise PackageError(f"fx2xla.load: {file} is unreadable ({e}): a corrupted package") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PackageError(f"fx2xla.load: {path!r} is not an fx2xla package (format {manifest.get('format')!r})"
                           if isinstance(manifest, dict) else f"fx2xla.load: {path!r} is not an fx2xla package")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise PackageError(f"fx2xla.load: {path!r} has package format version {version!r}; this fx2xla "
                           f"({_version()}) reads versions up to {FORMAT_VERSION}: upgrade fx2xla")
    return manifest


def _check_file(path: str, name: str, entry: dict, full: bool) -> str:
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise PackageError(f"fx2xla.load: {file} is missing: a corrupted package")
    if os.path.getsize(file) != entry["bytes"] or (full and _sha256(file) != entry["sha256"]):
        raise PackageError(f"fx2xla.load: {file} does not match the checksum in {_MANIFEST}: a corrupted package")
    return file


class LoadedModel:
    """A package ready to run: `model(*tensors) -> output(s)`, as the exported model returned
    them. Thread-safe: any number of threads may call it. Calls run the package's plan through
    the same executor as a compiled graph (plan_executor.PlanExecutor): the weights are its
    resident inputs, imported once and again only after the model writes them."""

    def __init__(self, path: str, verify: bool = True):
        t0 = time.perf_counter()
        manifest = _read_manifest(path)
        self.path = path
        self.manifest = manifest
        files = manifest["files"]
        # The weights' size is checked always, their sha256 with verify (it reads every byte).
        weights_file = _check_file(path, _WEIGHTS, files[_WEIGHTS], verify)
        self.device = device = _load_device(manifest["platform"])
        torch_device = device.torch_device
        if torch_device is None:
            raise PackageError(f"fx2xla.load: torch has no tensors on {device}; load the package on a device torch uses")
        try:
            weights = safetensors.torch.load_file(weights_file, device=str(torch_device))
        except Exception as e:  # noqa: BLE001  a truncated or foreign file
            raise PackageError(f"fx2xla.load: {weights_file} is unreadable ({e}): a corrupted package") from None
        self._inputs = manifest["inputs"]
        self._user = [i for i, spec in enumerate(self._inputs) if spec["kind"] == "user"]
        self._dtypes = {i: getattr(torch, spec["dtype"]) for i, spec in enumerate(self._inputs)}
        first = manifest["variants"][0]
        plan = plan_from_record(_plan_of(manifest), device, outputs_from_record(first["outputs"]))
        # A weight the plan imports as a copy in another order (RELAID: nn.Linear's laid out
        # [in, out]) is held here in that order instead, and passed as a view (PERMUTED): the
        # executable sees the same buffer, and no second copy of the weight is kept.
        self.plan = dataclasses.replace(plan, inputs=[
            dataclasses.replace(p, kind=InputKind.PERMUTED) if p.kind is InputKind.RELAID else p for p in plan.inputs])
        # The call's arguments: the weights (laid out as the plan passes them) at their
        # positions, the user's tensors filled in per call.
        self._args = [None if spec["kind"] in ("user", "token")
                      else _laid_out(weights[spec["weight"]], self.plan.inputs[i])
                      for i, spec in enumerate(self._inputs)]
        self._executor = PlanExecutor(self.plan)
        self.compiled_from_module = False  # some executable was compiled here from the portable module
        self._variants = {_shape_key(v["shapes"]): self._load_variant(v) for v in manifest["variants"]}
        self._program = None  # the exported program (dynamic packages), read at the first new shape
        self._written = [tuple(m) for m in manifest.get("written_outputs", [])]
        # Outputs that are no user's: written inputs' new contents, effect tokens (None).
        self._written_outputs = {j for _, j in self._written} | set(manifest.get("token_outputs", ()))
        self._build = _output_builder(manifest.get("output_tree"), torch_device)
        self._lock = threading.Lock()
        self.load_seconds = time.perf_counter() - t0

    def _load_variant(self, v: dict) -> Specialization:
        """Deserialize the executable that fits this device and jaxlib, else compile the module."""
        device, files = self.device, self.manifest["files"]
        module_file = _check_file(self.path, v["module"], files[v["module"]], True)
        exe = None
        # The executable with the kernel library's custom calls where this machine runs the same
        # build of the library (registered by _kernels_here), else the plain one.
        keys = [_executable_key(device, device.client.platform_version, kernels=True)] if _kernels_here(device) else []
        for key in keys + [_executable_key(device, device.client.platform_version)]:
            name = v["executables"].get(key)
            if name is None:
                continue
            exe_file = _check_file(self.path, name, files[name], True)
            try:
                with open(exe_file, "rb") as f:
                    exe = device.client.deserialize_executable(f.read(), [device.jax_device],
                                                               compile_options(device.platform))
                break
            except Exception:  # noqa: BLE001  built by an XLA this one cannot load: the next, or compile
                exe = None
        if exe is None:
            self.compiled_from_module = True
            with open(module_file, "rb") as f:
                blob = f.read()
            exe = _compile_portable(blob if v["module_format"] == "portable" else blob.decode(), device)
        return self._variant(exe, v)

    def _variant(self, exe, v: dict) -> Specialization:
        return Specialization(exe, self.plan, outputs_from_record(v["outputs"]),
                              tuple(CheckRecord(m, e) for m, e in zip(v["checks"], v.get("check_errors")
                                                                      or [INDEX] * len(v["checks"]))), None)

    def _new_variant(self, args) -> Specialization:
        """A dynamic package called with shapes it holds no executable for: lower its exported
        program at these shapes (no tracing) and compile, through the disk cache."""
        if self._program is None:
            program_file = _check_file(self.path, _PROGRAM, self.manifest["files"][_PROGRAM], True)
            self._program = torch.export.load(program_file)
        gm = self._program.graph_module
        fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        concrete = list(self._args)
        for i, a in zip(self._user, args):
            concrete[i] = a
        lowered, exe = compile_lowered(
            lambda: _lower(gm, fakes, self.device, self._inputs, concrete, self.manifest["check_indices"],
                           kernels=_kernels_here(self.device), layouts=[(p.kind, p.perm) for p in self.plan.inputs],
                           linear_weight_lhs=bool(self.manifest.get("weight_lhs_matmuls")),
                           few_row_kernel=bool(self.manifest.get("few_row_matmuls")))[1],
            lambda text: compile_module(text, self.device), f"package {self.path!r}")
        self.compiled_from_module = True
        return self._variant(exe, _variant_json(lowered, [list(a.shape) for a in args]))

    def __repr__(self) -> str:
        sig = ", ".join(f"{self._inputs[i]['name']}: {self._inputs[i]['dtype']}{_describe(self._inputs[i]['dims'])}"
                        for i in self._user)
        return f"fx2xla.LoadedModel({self.path!r}, ({sig}) on {self.device})"

    def _check_args(self, args) -> None:
        if len(args) != len(self._user):
            raise PackageError(f"fx2xla: the package {self.path!r} takes {len(self._user)} tensor input(s), got {len(args)}")
        for a, i in zip(args, self._user):
            spec = self._inputs[i]
            if not isinstance(a, torch.Tensor):
                raise PackageError(f"fx2xla: input {spec['name']} must be a tensor, got {type(a).__name__}")
            dims = spec["dims"]
            fits = a.dtype == self._dtypes[i] and a.dim() == len(dims) and all(
                n == d if isinstance(d, int) else d["min"] <= n and (d["max"] is None or n <= d["max"])
                for n, d in zip(a.shape, dims))
            if not fits:
                hint = ("" if self.manifest["dynamic"] else
                        " (a package serves the example inputs' shapes: export another, or export with dynamic_shapes)")
                raise PackageError(
                    f"fx2xla: input {spec['name']} is {str(a.dtype).removeprefix('torch.')}{list(a.shape)}; the package "
                    f"{self.path!r} was exported for {spec['dtype']}{_describe(dims)}{hint}")

    def __call__(self, *args):
        self._check_args(args)
        key = tuple(tuple(a.shape) for a in args)
        variant = self._variants.get(key)
        if variant is None:
            with self._lock:  # threads asking for one new shape compile it once
                variant = self._variants.get(key)
                if variant is None:
                    variant = self._variants[key] = self._new_variant(args)
        # No Dynamo guards here: each user tensor is brought to the device and the layout the
        # plan passes it in (no copy where it already is).
        call = list(self._args)
        inputs = self.plan.inputs
        for i, a in zip(self._user, args):
            call[i] = _laid_out(a if self.device.holds(a.device) else a.to(self.plan.torch_device), inputs[i])
        results = self._executor.run(variant, call)
        if self._written:
            # torch.export returns the new contents of written buffers and inputs as outputs:
            # installed in them (a written weight's resident buffer is renewed at the next call).
            with self._lock, torch.no_grad():
                for i, j in self._written:
                    dst = self._args[i] if self._args[i] is not None else args[self._user.index(i)]
                    install_input(dst, results[j])
        if self._written_outputs:
            results = [r for j, r in enumerate(results) if j not in self._written_outputs]
        return self._build(results)


def _shape_key(shapes) -> tuple:
    return tuple(tuple(s) for s in shapes)


def _describe(dims) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else f"{d['min']}..{'' if d['max'] is None else d['max']}"
                           for d in dims) + "]"


def _laid_out(t: torch.Tensor, p) -> torch.Tensor:
    """`t` (same values) in the layout input plan `p` passes it in: a PERMUTED input such that
    `t.permute(p.perm)` is dense, any other one contiguous."""
    if p.kind is InputKind.PERMUTED:
        return t.permute(p.perm).contiguous().permute(inverse(p.perm))
    return t.contiguous()


def _plan_of(manifest: dict) -> dict:
    """The manifest's plan record; format 1 kept the plan's fields beside the inputs."""
    if "plan" in manifest:
        return manifest["plan"]
    variant = manifest["variants"][0]
    inputs = [{"kind": spec.get("layout", "tensor"), "perm": spec.get("perm"), "resident": spec["kind"] != "user",
               "passed": True} for spec in manifest["inputs"]]
    used = [o["index"] + 1 for o in variant["outputs"] if o["kind"] == "tensor"] + [r + 1 for _, r in manifest["mutations"]]
    return {"inputs": inputs, "results": max(used, default=0), "mutations": manifest["mutations"],
            "seed": manifest["seed"]}


def _compile_portable(blob, device):

    return device.client.compile_and_load(blob, [device.jax_device], compile_options(device.platform))


def _load_device(platform: str):
    """The device to load on: PJRT_DEVICE when set, else the platform the package was built
    for, falling back to the CPU when that platform is absent here."""

    if os.environ.get("PJRT_DEVICE", "").strip():
        return default_device()
    try:
        return local_device(platform, 0, f"a package built for {platform}")
    except (RuntimeError, ValueError):
        return local_device("cpu", 0, "the CPU fallback")


def load(path: str, verify: bool = True) -> LoadedModel:
    """Load a package written by `fx2xla.export`: a callable taking the same positional
    tensors. No Dynamo, AOTAutograd or lowering runs; the executable is deserialized when one
    fits this device and jaxlib, else compiled from the portable StableHLO. `verify` checks
    the weights' sha256 too (reads them twice)."""
    return LoadedModel(path, verify)
