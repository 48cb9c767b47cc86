"""Lowering rules: torch's control-flow higher-order ops (scan, cond, while_loop), each lowered
to ONE structured StableHLO op (while / case) whose body is the traced subgraph, so a loop of N
steps compiles its body once instead of unrolling it N times.

The subgraphs arrive as GraphModules (get_attr nodes); their nodes run through the same rules
as the outer graph (`run_nodes`). Random ops inside a body get a key folded with the node's
position and the iteration, so every iteration draws different bits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
import torch.fx
from jax import lax

from .. import torch_kernels
from . import linalg as _linalg
from .checks import CODE_DTYPE, first_failure, no_failure
from .dtypes import to_jax_dtype
from .graph import run_nodes
from .registry import PYTHON_OPS, base_key, lowering_for_node, register_lowering

higher_order = torch.ops.higher_order


def _placeholders(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _outputs(gm: torch.fx.GraphModule, env: dict) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    out = list(out) if isinstance(out, (list, tuple)) else [out]
    return [env[o] if isinstance(o, torch.fx.Node) else o for o in out]


def run_subgraph(ctx, gm: torch.fx.GraphModule, inputs, key, known: dict | None = None, checks=None):
    """Evaluate `gm` on `inputs` (bound to its placeholders in order); its outputs as a list.
    `known`: values of nodes computed already (hoisted out of a loop), not evaluated again.
    `checks`: the RuntimeChecks of the level `gm` is traced at (None: no checks)."""
    placeholders = _placeholders(gm)
    if len(placeholders) != len(inputs):
        raise ValueError(f"subgraph takes {len(placeholders)} inputs, got {len(inputs)}")
    env = {**(known or {}), **dict(zip(placeholders, inputs))}
    run_nodes(gm, gm.graph.nodes, env, ctx.sizes, key, checks)
    return _outputs(gm, env)


def _nested(ctx):
    """A check collector for a body traced inside a loop or branch, or None (checks off)."""
    return ctx.checks.nested() if ctx.checks is not None else None


def _merge_code(code, inner):
    """`code` (a carried int32: the first failure so far) updated with `inner`'s checks."""
    body = inner.code() if inner is not None else None
    return code if body is None else first_failure([code, body])


def _hoist_invariants(ctx, body: torch.fx.GraphModule, invariant_inputs: dict, key) -> dict:
    """Evaluate, once and outside the loop, the body's nodes that depend only on loop-invariant
    inputs (attention masks and what is derived from them): XLA's loop-invariant code motion
    leaves size-inflating ops (broadcasts, iota masks) in the loop, unrolled layers share them.
    Returns their values (plus `invariant_inputs`) for `run_subgraph(known=...)`."""
    invariant = set(invariant_inputs)
    hoisted = []
    for n in body.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.op == "call_function" and n.target not in PYTHON_OPS:
            rule = lowering_for_node(n)
            if rule is None or rule.random or rule.subgraphs is not None:
                continue
        if all(i in invariant for i in n.all_input_nodes):
            invariant.add(n)
            hoisted.append(n)
    env = dict(invariant_inputs)
    if hoisted:
        run_nodes(body, hoisted, env, ctx.sizes, key, ctx.checks)  # outside the loop
    return env


def _node_key(ctx):
    """This node's PRNG key, or None when the graph draws no random bits."""
    if ctx.seed is None:
        return None
    return jax.random.fold_in(base_key(ctx.seed), ctx.index)


def _like(value, ref):
    """`value` with `ref`'s dtype and shape, strongly typed: loop carries must keep their type."""
    value = jnp.asarray(value)
    if value.dtype != ref.dtype or getattr(value, "weak_type", False):
        value = lax.convert_element_type(value, ref.dtype)
    if value.shape != ref.shape:
        raise ValueError(f"loop carry changed shape: {tuple(ref.shape)} -> {tuple(value.shape)}")
    return value


def _attr_subgraphs(*positions):
    """subgraphs= callback: the GraphModules held by the get_attr nodes at `positions`."""
    def subgraphs(gm, node):
        return [getattr(gm, node.args[p].target) for p in positions
                if isinstance(node.args[p], torch.fx.Node) and node.args[p].op == "get_attr"]
    return subgraphs


@register_lowering(higher_order.scan, subgraphs=_attr_subgraphs(0))
def _scan(ctx, body, init, xs, additional_inputs):
    # The HOP always scans dim 0 forwards: torch's `scan(dim=, reverse=)` moves/flips xs
    # outside it, so those are ordinary ops of the graph.
    init, xs, extra = list(init), list(xs), list(additional_inputs)
    if not xs:  # torch returns the carry unchanged and no ys
        return [*init]
    length = int(xs[0].shape[0])
    key = _node_key(ctx)
    n_carry = len(init)
    # AOTAutograd's backward scans flipped inputs and flips the results back: scan the
    # unflipped inputs in reverse instead (no copies; the flips become dead code).
    unflipped = _unflipped(ctx, ctx.node.args[2])
    reverse = unflipped is not None
    if reverse:
        xs = unflipped

    placeholders = _placeholders(body)
    known = _hoist_invariants(ctx, body, dict(zip(placeholders[len(placeholders) - len(extra):], extra)), None)
    # Stacked inputs that matmuls read as their right operand (a folded layer's weights, a
    # backward's saved activations): not sliced by the scan; those matmuls read the iteration's
    # slice where it lies (linalg._stacked_matmul). The slice made for their other readers, if
    # any, is what the scan made before, and dead code where none is left.
    per_step = placeholders[n_carry:n_carry + len(xs)]
    cpu_single = ctx.platform == "cpu" and not ctx.spmd
    stacks = {}
    if cpu_single and torch_kernels.available("stacked_matmul"):
        reads = _linalg.stacked_matmul_reads(per_step)
        stacks = {k: xs[k] for k, p in enumerate(per_step) if p in reads}
    scanned = [x for k, x in enumerate(xs) if k not in stacks]

    def step(state, x):
        carry, code = state
        i, x = x
        sliced = iter(x)
        x = [lax.dynamic_index_in_dim(stacks[k], i, keepdims=False) if k in stacks else next(sliced)
             for k in range(len(per_step))]
        body_key = None if key is None else jax.random.fold_in(key, i)
        inner = _nested(ctx)
        token = _linalg.STACKED.set({per_step[k]: (s, i) for k, s in stacks.items()} or None)
        try:
            outs = run_subgraph(ctx, body, [*carry, *x, *extra], body_key, known, inner)
        finally:
            _linalg.STACKED.reset(token)
        new = [_like(o, c) for o, c in zip(outs[:n_carry], carry)]
        return (new, _merge_code(code, inner)), outs[n_carry:]

    if cpu_single and torch_kernels.available("scan_outputs"):
        carry, code, ys = _scan_into_buffers(step, init, scanned, length, reverse)
    else:
        (carry, code), ys = lax.scan(step, (init, no_failure()), (jnp.arange(length, dtype=jnp.int32), scanned),
                                     length=length, reverse=reverse)
    if ctx.checks is not None:
        ctx.checks.add_code(code)
    if reverse:  # torch's ys are in scan order: flipped (a flip of them back then cancels out)
        ys = [lax.rev(y, (0,)) for y in ys]
    return [*carry, *ys]


def _scan_into_buffers(step, init, xs, length: int, reverse: bool):
    """lax.scan(step, (init, no_failure()), (arange(length), xs), reverse=reverse) as a loop that
    writes each iteration's outputs into stacks the kernel library's `fx2xla_uninitialized`
    allocates and leaves unfilled: every element is written, slice i by iteration i. jax's scan
    zero-fills its output stacks first, a pass over all of them (a folded GPT-2 24-layer training
    step's saved activations and gradients; docs/benchmarks.md, "Loop outputs not zero-filled").
    The body is traced once, by make_jaxpr, and run in the loop as that jaxpr."""
    from jax.extend.core import jaxpr_as_fun

    init = [_like(v, jnp.asarray(v)) for v in init]  # strongly typed, as the body returns them
    carry_specs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in init]
    x_specs = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in xs]
    code_spec, index_spec = jax.ShapeDtypeStruct((), CODE_DTYPE), jax.ShapeDtypeStruct((), jnp.int32)
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)((carry_specs, code_spec), (index_spec, x_specs))
    body = jaxpr_as_fun(closed)
    out_tree = jax.tree.structure(out_shape)
    y_shapes = out_shape[1]
    stacks = [jax.ffi.ffi_call("fx2xla_uninitialized", jax.ShapeDtypeStruct((length, *y.shape), y.dtype))()
              for y in y_shapes]

    def run(t, state):
        carry, code, stacks = state
        t = lax.convert_element_type(t, jnp.int32)  # the traced body takes an int32 index
        i = (length - 1 - t) if reverse else t
        x = [lax.dynamic_index_in_dim(v, i, keepdims=False) for v in xs]
        (carry, code), ys = jax.tree.unflatten(out_tree, body(*jax.tree.leaves(((carry, code), (i, x)))))
        stacks = [lax.dynamic_update_index_in_dim(s, y, i, 0) for s, y in zip(stacks, ys)]
        return carry, code, stacks

    return lax.fori_loop(0, length, run, (init, no_failure(), stacks))


def _unflipped(ctx, xs_nodes):
    """The sources of `xs` when every one is `aten.flip(src, [0])` already lowered, else None."""
    if ctx.values is None or not xs_nodes:
        return None
    sources = []
    for n in xs_nodes:
        if not (isinstance(n, torch.fx.Node) and n.target is torch.ops.aten.flip.default):
            return None
        src, dims = n.args[0], list(n.args[1])
        ndim = n.meta["val"].dim() if "val" in n.meta else None
        if ndim is None or [d % ndim for d in dims] != [0] or src not in ctx.values:
            return None
        sources.append(ctx.values[src])
    return sources


@register_lowering(higher_order.cond, subgraphs=_attr_subgraphs(1, 2))
def _cond(ctx, pred, true_fn, false_fn, operands):
    operands = list(operands)
    key = _node_key(ctx)
    meta = ctx.out if isinstance(ctx.out, (list, tuple)) else [ctx.out]

    def branch(gm, which):
        def run(ops):
            k = None if key is None else jax.random.fold_in(key, which)
            inner = _nested(ctx)
            outs = run_subgraph(ctx, gm, list(ops), k, checks=inner)
            # Both branches must return identically typed values: torch's meta decides.
            outs = [lax.convert_element_type(jnp.asarray(o), to_jax_dtype(m.dtype))
                    if isinstance(m, torch.Tensor) else o for o, m in zip(outs, meta)]
            return [*outs, _merge_code(no_failure(), inner)]
        return run

    pred = jnp.asarray(pred).astype(jnp.bool_).reshape(())
    *outs, code = lax.cond(pred, branch(true_fn, 1), branch(false_fn, 0), operands)
    if ctx.checks is not None:
        ctx.checks.add_code(code)
    return outs


@register_lowering(higher_order.while_loop, subgraphs=_attr_subgraphs(0, 1))
def _while_loop(ctx, cond_fn, body_fn, carried_inputs, additional_inputs, mutated_arg_indices=""):
    if mutated_arg_indices:  # in-place updates of loop inputs have no functional equivalent here
        raise NotImplementedError(f"while_loop body mutates inputs {mutated_arg_indices}")
    carried, extra = list(carried_inputs), list(additional_inputs)
    key = _node_key(ctx)

    def predicate(i, carry, checks):
        k = None if key is None else jax.random.fold_in(jax.random.fold_in(key, 0), i)
        (pred,) = run_subgraph(ctx, cond_fn, [*carry, *extra], k, checks=checks)
        return jnp.asarray(pred).astype(jnp.bool_).reshape(())

    def cond(state):
        i, carry, _ = state
        return predicate(i, carry, None)  # its checks run in the body and after the loop

    def body(state):
        i, carry, code = state
        inner = _nested(ctx)
        predicate(i, carry, inner)
        k = None if key is None else jax.random.fold_in(jax.random.fold_in(key, 1), i)
        outs = run_subgraph(ctx, body_fn, [*carry, *extra], k, checks=inner)
        return i + 1, [_like(o, c) for o, c in zip(outs, carry)], _merge_code(code, inner)

    i, carry, code = lax.while_loop(cond, body, (jnp.asarray(0, jnp.int32), carried, no_failure()))
    if ctx.checks is not None:
        predicate(i, carry, ctx.checks)  # the last evaluation, which ended the loop
        ctx.checks.add_code(code)
    return list(carry)


@register_lowering(higher_order.invoke_subgraph, subgraphs=_attr_subgraphs(0))
def _invoke_subgraph(ctx, subgraph, identifier, *operands):
    # The body of a torch.compiler.nested_compile_region, traced once by Dynamo and
    # AOTAutograd and called at each use. XLA inlines calls anyway, so it is inlined here;
    # runs of calls that only thread a carry are folded into one loop by the scan_folding pass.
    return run_subgraph(ctx, subgraph, list(operands), _node_key(ctx), checks=ctx.checks)
