"""Loops that compile to ONE loop: `scan` (like `jax.lax.scan`) and `scan_layers` (a stack of
identical layers applied in order).

Under `torch.compile(..., backend="fx2xla")` both become a single StableHLO while loop whose body
is compiled once, however many steps there are (a Python loop would be unrolled: N copies of
the body, N times the compile time). In eager mode they are a plain Python loop, with the same
results.

    final, ys = fx2xla.scan(lambda c, x: (c * 0.9 + x, c.sum()), init, xs)
    h = fx2xla.scan_layers(model.layers, h, attention_mask)
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

__all__ = ["scan", "scan_layers"]


def _torch_scan():
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
    torch_scan = _torch_scan() if torch.compiler.is_compiling() else None
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


def scan_layers(layers: Sequence[torch.nn.Module], x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """`for layer in layers: x = layer(x, *args, **kwargs)`, as ONE loop over the layers.

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
    """
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
    versions = None if torch.compiler.is_compiling() else [t._version for t in buffers.values()]

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
