"""Loops that compile to ONE loop: `scan` (like `jax.lax.scan`) and `scan_layers` (a stack of
identical layers applied in order).

Under `torch.compile(..., backend="fx2xla")` both become a single StableHLO while loop whose body
is compiled once, however many steps there are (a Python loop would be unrolled: N copies of
the body, N times the compile time). In eager mode they are a plain Python loop, with the same
results.

    final, ys = fx2xla.scan(lambda c, x: (c * 0.9 + x, c.sum()), init, xs)
    h = fx2xla.scan_layers(model.layers, h, attention_mask)

`scan_layers(model)` (no x) changes no code of the model: it marks the model's stacks of
identical layers so that Dynamo traces one layer once instead of once per layer (see
`_mark_layers`), and the scan-folding pass turns the calls into the same single loop.
"""
from __future__ import annotations

import itertools
import logging
import types
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

log = logging.getLogger("fx2xla.scan")

__all__ = ["scan", "scan_layers"]


def torch_scan_op():
    """torch's scan higher-order op (`torch._higher_order_ops.scan.scan`, a private API), or None
    when this torch does not have it. The only place fx2xla touches it."""
    try:
        from torch._higher_order_ops.scan import scan as torch_scan
    except (ImportError, AttributeError):
        return None
    return torch_scan


def scan(fn: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any, *, reverse: bool = False):
    """Loop `fn` over the leading dimension of `xs`, threading a carry, like `jax.lax.scan`:

        carry = init
        for i in range(n):            # reversed(range(n)) if reverse
            carry, ys[i] = fn(carry, xs[i])
        return carry, stack(ys)

    init, xs: pytrees (tensors, tuples, lists, dicts) of tensors; every leaf of xs has the same
    leading size n >= 1 and fn sees slice i of each. fn returns `(new_carry, y)`: new_carry
    with init's structure and each leaf's shape and dtype; y a pytree of tensors (no None
    leaves), or None for no per-step output. Returns `(final_carry, ys)`, ys with y's structure,
    each leaf stacked on a new dim 0 (ys[i] is the output of the step that consumed xs[i], also
    when reverse=True); ys is None when y has no tensors (None, ()).

    Compiled (torch.compile), this is torch's scan higher-order op, which fx2xla lowers to one
    while loop; random ops in fn draw different bits in every iteration. On a torch without
    that op, the Python loop is used and Dynamo unrolls it (same results, n copies of fn). Gradients flow to
    init, xs and tensors fn closes over (parameters), compiled and in eager. fn must be
    traceable by Dynamo without graph breaks and must not mutate its inputs in place.

    Raises ValueError (naming the shapes) when xs has no tensors, leading sizes differ or are
    0, init has non-tensor leaves, or fn changes the carry's structure, shape or dtype. Under
    `torch.compile(fullgraph=True)` Dynamo reports such an error as its own exception type, with
    this message inside; without fullgraph it graph-breaks and the eager check raises it.
    """
    init_leaves, init_spec = pytree.tree_flatten(init)
    xs_leaves, xs_spec = pytree.tree_flatten(xs)
    n = _check_inputs(init_leaves, xs_leaves)
    # Eager: the plain loop. torch's op would itself run a Python loop, after compiling fn with
    # Dynamo (and recompiling for every new fn).
    torch_scan = torch_scan_op() if torch.compiler.is_compiling() else None
    if torch_scan is None:
        return _python_scan(fn, init, xs_leaves, xs_spec, n, reverse)

    def combine(carry, x):
        new_carry, y = fn(carry, x)
        new_leaves, y_leaves = _check_step(carry, new_carry, y)
        # torch's op rejects outputs aliasing inputs or each other (`return c, c`, a carry
        # passed through) and None outputs: copies make them distinct (XLA elides the copies).
        y = pytree.tree_unflatten([t.clone() for t in y_leaves], pytree.tree_structure(y)) if y_leaves else ()
        return pytree.tree_unflatten([t.clone() for t in new_leaves], init_spec), y

    carry, ys = torch_scan(combine, init, xs, reverse=reverse)
    return carry, (ys if pytree.tree_leaves(ys) else None)


def _check_inputs(init_leaves, xs_leaves) -> int:
    """The scan length; ValueError for unusable inputs."""
    for t in init_leaves:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"scan: every leaf of init must be a tensor, got {type(t).__name__}")
    if not xs_leaves:
        raise ValueError("scan: xs has no tensors, so there is nothing to scan over")
    for t in xs_leaves:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            what = "a 0-d tensor" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"scan: every leaf of xs must be a tensor with a leading dimension, got {what}")
    sizes = [tuple(t.shape) for t in xs_leaves]
    if any(s[0] != sizes[0][0] for s in sizes):
        raise ValueError(f"scan: the leaves of xs must have the same leading size, got shapes {sizes}")
    if sizes[0][0] == 0:
        raise ValueError(f"scan: xs has length 0 (shapes {sizes}); scan needs at least one step")
    return sizes[0][0]


def _check_step(carry, new_carry, y):
    """(new carry leaves, y leaves) after checking fn's outputs; ValueError otherwise."""
    old_leaves, old_spec = pytree.tree_flatten(carry)
    new_leaves, new_spec = pytree.tree_flatten(new_carry)
    if new_spec != old_spec:
        raise ValueError(f"scan: fn changed the carry's structure from {old_spec} to {new_spec}")
    for i, (a, b) in enumerate(zip(old_leaves, new_leaves)):
        if not isinstance(b, torch.Tensor):
            raise ValueError(f"scan: fn returned a carry leaf {i} of type {type(b).__name__}, not a tensor")
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"scan: fn changed carry leaf {i} from shape {tuple(a.shape)} {a.dtype} "
                             f"to shape {tuple(b.shape)} {b.dtype}; a carry must keep its shape and dtype")
    if y is None:
        return new_leaves, []
    y_leaves = pytree.tree_leaves(y, is_leaf=lambda v: v is None)  # None counts: it is rejected
    if any(not isinstance(t, torch.Tensor) for t in y_leaves):
        raise ValueError(f"scan: fn's per-step output y must be None or a pytree of tensors without None, got {y!r}")
    return new_leaves, y_leaves


def _python_scan(fn, init, xs_leaves, xs_spec, n, reverse):
    """The eager path (and the fallback when torch has no scan op): a loop and torch.stack."""
    carry, ys, y_spec = init, [None] * n, None
    for i in (reversed(range(n)) if reverse else range(n)):
        new_carry, y = fn(carry, pytree.tree_unflatten([t[i] for t in xs_leaves], xs_spec))
        _, y_leaves = _check_step(carry, new_carry, y)
        spec = pytree.tree_structure(y)
        if y_spec is not None and spec != y_spec:
            raise ValueError(f"scan: fn's per-step output changed structure from {y_spec} to {spec}")
        carry, ys[i], y_spec = new_carry, y_leaves, spec
    if not ys[0]:
        return carry, None
    stacked = [torch.stack([y[j] for y in ys]) for j in range(len(ys[0]))]
    return carry, pytree.tree_unflatten(stacked, y_spec)


_MARK = object()  # scan_layers(model) without x: mark the model's layer stacks


def scan_layers(layers: Sequence[torch.nn.Module] | torch.nn.Module, x: torch.Tensor = _MARK, *args, **kwargs):
    """`for layer in layers: x = layer(x, *args, **kwargs)`, as ONE loop over the layers.

    `scan_layers(model)`, without x, instead marks every stack of identical layers in `model`
    (see below) so that torch.compile traces each stack's layer once; it returns `model`.

    layers: a list / nn.ModuleList / nn.Sequential of structurally identical modules (same
    class, same parameter and buffer names, shapes, dtypes, devices and requires_grad, same
    train/eval mode); ValueError names the first difference. Each parameter and buffer is
    stacked across the layers with torch.stack (differentiable: gradients reach every layer's
    own parameters) and the loop calls `torch.func.functional_call(layers[0], slice, ...)`,
    so layers[0]'s non-tensor attributes (config, flags, a layer index) are used for all
    layers. args/kwargs are passed unchanged to every layer (e.g. an attention mask).

    A layer may return x, or a tuple/list whose first element is the next x (transformers'
    decoder layers); its other elements must be None (e.g. no attention weights, no cache),
    otherwise ValueError: scan_layers does not silently drop per-layer tensors. Layers must
    not update buffers in place (BatchNorm in training mode): ValueError in eager mode, torch's
    scan op rejects it when compiled. No layers: x is returned unchanged.

    Compiled with backend="fx2xla", the loop is one while loop whose body (one layer) is
    compiled once.

    `scan_layers(model)`: the same single loop without changing the model's code. Every
    nn.ModuleList / nn.Sequential in `model` whose children (two or more) are structurally
    identical as above (and are not torch.nn's own leaf modules) has its children marked, in
    place: each gets a `forward` that, under torch.compile, calls its class's forward as a
    `torch.compiler.nested_compile_region` (all layers of a class share one region, so Dynamo
    traces the layer once and stamps out the other calls; it checks each stamped call with the
    guards of the first). The scan-folding pass then folds the run of calls into one loop. In
    eager mode, and for a call whose arguments are not tensors, numbers, strings, None or
    tuples/lists of those (a KV cache object), a marked layer runs its own forward unchanged;
    layers in training mode that own buffers (BatchNorm's running statistics, which torch's
    regions cannot update under autograd) do too. What a marked layer still needs: its forward
    must trace without graph breaks (torch raises UncapturedHigherOrderOpError for a graph break
    inside a region, with every backend and also without fullgraph). Marking again is a no-op;
    `del layer.forward` unmarks a layer. Containers inside marked layers are left alone.
    """
    if x is _MARK:
        if args or kwargs:
            raise TypeError("scan_layers(model) marks a model's layer stacks and takes no other arguments; "
                            "scan_layers(layers, x, ...) runs the layers on x")
        return _mark_layers(layers)
    layers = list(layers)
    if not layers:
        return x
    # named_parameters() once per layer: under torch.compile, Dynamo traces every traversal
    named = [(dict(layer.named_parameters()), dict(layer.named_buffers()))
             if isinstance(layer, torch.nn.Module) else None for layer in layers]
    _check_homogeneous(layers, named)
    first = layers[0]
    params = {name: torch.stack([p[name] for p, _ in named]) for name in named[0][0]}
    buffers = {name: torch.stack([b[name] for _, b in named]) for name in named[0][1]}
    # (Inference tensors have no version counter: under inference_mode the check is skipped.)
    versions = (None if torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
                else [t._version for t in buffers.values()])

    def step(h, state):
        out = torch.func.functional_call(first, state, (h, *args), kwargs)
        return _next_x(out, h), None

    h, _ = scan(step, x, {**params, **buffers})
    if versions is not None and versions != [t._version for t in buffers.values()]:
        changed = [n for (n, t), v in zip(buffers.items(), versions) if t._version != v]
        raise ValueError(f"scan_layers: the layers update buffers {changed} in place, which scan_layers "
                         "cannot write back to each layer (e.g. BatchNorm in training mode)")
    return h


def _next_x(out, h):
    if isinstance(out, (tuple, list)):
        if not out:
            raise ValueError("scan_layers: a layer returned an empty tuple")
        rest = [i for i, o in enumerate(out[1:], 1) if o is not None]
        if rest:
            raise ValueError(f"scan_layers: a layer returned a {type(out).__name__} with non-None elements at "
                             f"positions {rest}; only the first element (the next x) is carried and the others "
                             "would be dropped. Make the layer return just x (or None for the others).")
        out = out[0]
    if not isinstance(out, torch.Tensor):
        raise ValueError("scan_layers: a layer must return a tensor (or a tuple starting with one), "
                         f"got {type(out).__name__}")
    if out.shape != h.shape or out.dtype != h.dtype:
        raise ValueError(f"scan_layers: a layer maps x of shape {tuple(h.shape)} {h.dtype} to shape "
                         f"{tuple(out.shape)} {out.dtype}; layers must keep x's shape and dtype")
    return out


def _describe(module: torch.nn.Module, params: dict, buffers: dict) -> dict:
    """What must agree across layers, in a stable order."""
    tensors = {}
    for kind, named in (("parameter", params), ("buffer", buffers)):
        for name, t in named.items():
            tensors[f"{kind} {name!r}"] = (tuple(t.shape), t.dtype, t.device, t.requires_grad)
    return {"class": type(module).__qualname__, "tensors": tensors,
            "training": [m.training for m in module.modules()]}


def _check_homogeneous(layers: list, named: list) -> None:
    for i, layer in enumerate(layers):
        if not isinstance(layer, torch.nn.Module):
            raise ValueError(f"scan_layers: layer {i} is a {type(layer).__name__}, not an nn.Module")
    ref = _describe(layers[0], *named[0])
    for i, layer in enumerate(layers[1:], 1):
        d = _describe(layer, *named[i])
        if d["class"] != ref["class"]:
            raise ValueError(f"scan_layers: layer {i} is a {d['class']}, layer 0 a {ref['class']}")
        names, ref_names = list(d["tensors"]), list(ref["tensors"])
        if names != ref_names:
            missing = [n for n in ref_names if n not in names]
            extra = [n for n in names if n not in ref_names]
            raise ValueError(f"scan_layers: layer {i}'s tensors differ from layer 0's: "
                             f"missing {missing}, extra {extra}" if missing or extra else
                             f"scan_layers: layer {i} registers its tensors in another order than layer 0")
        for name in ref_names:
            if d["tensors"][name] != ref["tensors"][name]:
                fields = ("shape", "dtype", "device", "requires_grad")
                diffs = ", ".join(f"{f} {a} vs {b}" for f, a, b
                                  in zip(fields, d["tensors"][name], ref["tensors"][name]) if a != b)
                raise ValueError(f"scan_layers: layer {i}'s {name} differs from layer 0's: {diffs}")
        if d["training"] != ref["training"]:
            raise ValueError(f"scan_layers: layer {i} is not in the same train/eval mode as layer 0")


# ------------------------------------------------------------------ scan_layers(model): marking
#
# Why a mark and not the backend: a torch.compile backend receives Dynamo's graph after Dynamo
# traced every layer, so it cannot make Dynamo trace less; the model's modules have to say so
# before the trace, which is what torch.compiler.nested_compile_region is for. Dynamo (torch
# >= 2.9) traces the first call of a region and "stamps out" the later calls after checking
# the first call's guards against the new layer. Two costs of that check are avoidable from
# here: arguments passed by keyword (and tuples such as LLaMA's position embeddings) make
# Dynamo flatten them with pytree on every call, traced; and a region keyed on a class's own
# forward would share its reuse cache with any other marking of that class. The marked
# forward therefore calls a per-class region function with positional leaves only (tensors,
# numbers, strings, None) plus one constant string that says how to rebuild the call.

_LEAVES = (torch.Tensor, bool, int, float, str, type(None), torch.SymInt, torch.SymFloat, torch.SymBool)
_regions: dict = {}  # layer class -> its region function (one per class: one Dynamo reuse cache)
_region_ids = itertools.count()


def _flatten_call(args: tuple, kwargs: dict):
    """(leaves, layout) for a call whose arguments are leaves or tuples/lists of leaves, else
    (None, None). layout is a constant string: "." a leaf, "(n" / "[n" a tuple / list of n
    leaves, "=name" the keyword of the next item. Runs under Dynamo (plain Python on purpose)."""
    leaves, layout = [], []
    items = [(None, a) for a in args] + list(kwargs.items())
    for name, value in items:
        if name is not None:
            layout.append("=" + name)
        if isinstance(value, _LEAVES):
            layout.append(".")
            leaves.append(value)
        elif isinstance(value, (tuple, list)) and all(isinstance(v, _LEAVES) for v in value):
            layout.append(("(" if isinstance(value, tuple) else "[") + str(len(value)))
            leaves.extend(value)
        else:
            return None, None
    return leaves, ",".join(layout)


def _unflatten_call(layout: str, leaves: tuple):
    args, kwargs, name, i = [], {}, None, 0
    for item in layout.split(",") if layout else ():
        if item[0] == "=":
            name = item[1:]
            continue
        if item == ".":
            value, i = leaves[i], i + 1
        else:
            n = int(item[1:])
            value, i = (tuple if item[0] == "(" else list)(leaves[i:i + n]), i + n
        if name is None:
            args.append(value)
        else:
            kwargs[name] = value
    return args, kwargs


def _layer_region_template(self, layout, *leaves):
    args, kwargs = _unflatten_call(layout, leaves)
    return type(self).forward(self, *args, **kwargs)


def _region_for(cls) -> Callable:
    """The nested_compile_region function of layer class `cls`. Dynamo keys its reuse cache
    on the function's code object, so each class gets its own copy of the template's code
    (a distinct name). max_reuse_entries only bounds how many variants Dynamo keeps before it
    raises; a layer whose guards differ from every earlier variant is traced again, as
    unmarked, so no bound is wanted."""
    if cls not in _regions:
        name = f"fx2xla_layer_{next(_region_ids)}_{cls.__name__}"
        code = _layer_region_template.__code__.replace(co_name=name, co_qualname=name)
        fn = types.FunctionType(code, _layer_region_template.__globals__, name)
        _regions[cls] = torch.compiler.nested_compile_region(fn, max_reuse_entries=1 << 30)
    return _regions[cls]


def _marked_forward(region: Callable, owns_buffers: bool) -> Callable:
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling() and not (owns_buffers and self.training):
            leaves, layout = _flatten_call(args, kwargs)
            if leaves is not None:
                return region(self, layout, *leaves)
        return type(self).forward(self, *args, **kwargs)

    forward._fx2xla_trace_once = True
    return forward


def is_marked(layer: torch.nn.Module) -> bool:
    """Whether `layer` was marked by scan_layers(model)."""
    return getattr(layer.__dict__.get("forward"), "_fx2xla_trace_once", False)


def _markable(layers: list) -> bool:
    if len(layers) < 2 or not all(isinstance(m, torch.nn.Module) for m in layers):
        return False
    cls = type(layers[0])
    if cls.__module__.startswith("torch.nn.") or hasattr(cls.forward, "__marked_compile_region_fn__"):
        return False  # torch's own leaf modules: nothing to trace once; already a region
    if any("forward" in m.__dict__ and not is_marked(m) for m in layers):
        return False  # a forward the user set on the instance is theirs
    try:
        _check_homogeneous(layers, [(dict(m.named_parameters()), dict(m.named_buffers())) for m in layers])
    except ValueError:
        return False
    return True


def _mark_layers(model: torch.nn.Module) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"scan_layers(model) marks an nn.Module's layer stacks, got {type(model).__name__}; "
                        "scan_layers(layers, x, ...) runs the layers on x")
    if torch.compiler.is_compiling():
        raise RuntimeError("scan_layers(model) marks the model before torch.compile traces it; call it "
                           "outside the compiled function")
    done: list[str] = []
    for path, container in model.named_modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        if any(path == d or path.startswith(d + ".") for d in done):
            continue  # inside a marked layer: the outer region covers it
        layers = list(container)
        if not _markable(layers):
            continue
        region = _region_for(type(layers[0]))
        owns_buffers = any(True for _ in layers[0].buffers())
        for layer in layers:
            if not is_marked(layer):
                layer.forward = types.MethodType(_marked_forward(region, owns_buffers), layer)
        prefix = f"{path}." if path else ""
        done.extend(f"{prefix}{i}" for i in range(len(layers)))
        log.info("scan_layers: %s.0..%d (%s) traced once per compile", path or "<model>", len(layers) - 1,
                 type(layers[0]).__qualname__)
    return model
