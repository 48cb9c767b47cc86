"""Lower an FX graph of core ATen ops to a StableHLO module by tracing its rules with jax."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.fx

from ..errors import LoweringError, UnsupportedOpError
from .dtypes import to_jax_dtype
from .registry import LoweringContext, concrete_shape, is_array, lowering_for, prepare_args

# Python-level callables that appear in graphs on sizes (SymInt arithmetic) or tuples; they
# run directly on the concrete values the trace sees.
PYTHON_OPS = {
    operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
    operator.truediv, operator.mod, operator.pow, operator.neg, operator.eq, operator.ne,
    operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_,
    operator.not_, math.ceil, math.floor, math.sqrt, math.trunc, abs, max, min, int, float,
    torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_sqrt,
}


@dataclass(frozen=True)
class InputPlan:
    """How one graph input reaches the executable.

    kind: "tensor" (passed as is), "permuted" (passed as `t.permute(perm)`, a dense view of a
    non-row-major tensor, and permuted back in the graph), "contiguous" (copied dense first),
    "symint" (a size: specialises the executable, not passed).
    """

    kind: str
    perm: tuple[int, ...] | None = None


@dataclass(frozen=True)
class OutputPlan:
    """How one graph output is produced.

    kind: "tensor" (executable result `index`, then `.permute(inv_perm)` if set, or restrided
    to `stride` if set), "const" (a Python value fixed at lowering time, e.g. a size or None).
    """

    kind: str
    index: int = -1
    inv_perm: tuple[int, ...] | None = None
    stride: tuple[int, ...] | None = None
    value: Any = None
    # kind "input": graph input `index` itself, or a view of it replayed in torch with `views`
    # ((aten view op, args) pairs): no copy through the executable (e.g. saved activations).
    views: tuple = ()


# View ops whose result an output may be rebuilt with in torch, zero-copy, from a graph input
# (not expand: its overlapping elements could not be written to in place afterwards).
_VIEW_OPS = {
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.permute.default,
    torch.ops.aten.t.default, torch.ops.aten.transpose.int,
    torch.ops.aten.alias.default, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims, torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
    torch.ops.aten.diagonal.default,
}


def _input_view_chain(node, placeholder_index: dict):
    """(input position, ((op, args), ...)) if `node` is a graph input or a chain of view ops
    with static arguments on one; None otherwise."""
    views = []
    while node.op == "call_function" and node.target in _VIEW_OPS and not node.kwargs:
        src, *rest = node.args
        if not isinstance(src, torch.fx.Node) or any(
            isinstance(a, torch.fx.Node) or (isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a))
            for a in rest
        ):
            return None
        views.append((node.target, tuple(rest)))
        node = src
    if node.op == "placeholder" and node in placeholder_index:
        return placeholder_index[node], tuple(reversed(views))
    return None


@dataclass
class LoweredGraph:
    module_text: str
    inputs: list[InputPlan]
    outputs: list[OutputPlan]
    arg_shapes: list[tuple[tuple[int, ...], Any]] = field(default_factory=list)
    needs_seed: bool = False  # the executable takes one more input: an int64 seed


def dense_permutation(shape, stride) -> tuple[int, ...] | None:
    """The permutation `perm` such that `t.permute(perm)` is row-major contiguous, if `t` is
    dense (no gaps, no overlap); None otherwise. Identity means already contiguous."""
    dims = [d for d in range(len(shape))]
    perm = tuple(sorted(dims, key=lambda d: -stride[d]))  # stable: ties keep their order
    expected = 1
    for d in reversed(perm):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return perm


def _is_identity(perm) -> bool:
    return perm == tuple(range(len(perm)))


def plan_input(val) -> InputPlan:
    if isinstance(val, torch.SymInt) or isinstance(val, (int, float, bool)):
        return InputPlan("symint")
    if not isinstance(val, torch.Tensor):
        raise TypeError(f"fx2xla: unsupported graph input {val!r}")
    shape, stride = val.shape, val.stride()
    if any(isinstance(s, torch.SymInt) for s in list(shape) + list(stride)):
        return InputPlan("contiguous")
    if val.numel() <= 1 or val.is_contiguous():
        return InputPlan("tensor")
    perm = dense_permutation(tuple(shape), tuple(stride))
    if perm is not None and not _is_identity(perm):
        return InputPlan("permuted", perm)
    return InputPlan("contiguous")


def _inverse(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def _symbolic(shape) -> bool:
    return any(isinstance(s, torch.SymInt) for s in shape)


def _constant(t: torch.Tensor):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # lowering runs inside AOTAutograd's FakeTensorMode
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return jnp.asarray(t.float().numpy(), dtype=jnp.bfloat16)
        return jnp.asarray(t.resolve_conj().numpy(), dtype=to_jax_dtype(t.dtype))


def check_rules(gm: torch.fx.GraphModule) -> None:
    """Raise UnsupportedOpError for the first op in the graph that has no rule."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target not in PYTHON_OPS:
            if lowering_for(node.target) is None:
                raise UnsupportedOpError(node)


def lower_graph(gm: torch.fx.GraphModule, example_inputs, concrete_args=None) -> LoweredGraph:
    """Trace `gm` into StableHLO.

    example_inputs: FakeTensors / SymInts of the graph's placeholders (their shapes may be
    symbolic); concrete_args: the actual call's values, which fix every symbolic size.
    """
    check_rules(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    plans = [plan_input(v) for v in example_inputs]

    # Resolve symbolic sizes: bind each placeholder's symbols to the call's concrete values.
    bindings: dict = {}
    if concrete_args is not None:
        for ex, real in zip(example_inputs, concrete_args):
            if isinstance(ex, torch.SymInt):
                bindings[ex.node.expr] = int(real)
            elif isinstance(ex, torch.Tensor):
                for s, r in zip([*ex.shape, *ex.stride(), ex.storage_offset()],
                                [*real.shape, *real.stride(), real.storage_offset()]):
                    if isinstance(s, torch.SymInt):
                        bindings[s.node.expr] = int(r)

    def sizes(s):
        if not isinstance(s, torch.SymInt):
            return int(s)
        expr = s.node.expr
        if expr in bindings:
            return bindings[expr]
        return int(expr.xreplace(bindings))

    avals, arg_shapes = [], []
    for plan, ex, real in zip(plans, example_inputs, concrete_args or example_inputs):
        if plan.kind == "symint":
            continue
        shape = tuple(real.shape) if concrete_args is not None else concrete_shape(ex.shape, sizes)
        if plan.kind == "permuted":
            shape = tuple(shape[d] for d in plan.perm)
        dtype = to_jax_dtype(ex.dtype)
        avals.append(jax.ShapeDtypeStruct(shape, dtype))
        arg_shapes.append((shape, dtype))

    needs_seed = any(
        n.op == "call_function" and n.target not in PYTHON_OPS and lowering_for(n.target).random
        for n in gm.graph.nodes
    )
    if needs_seed:
        avals.append(jax.ShapeDtypeStruct((), np.int64))

    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_vals = list(output_node.args[0]) if isinstance(output_node.args[0], (list, tuple)) else [output_node.args[0]]
    out_plans: list[OutputPlan] = []

    def trace(*arrays):
        env: dict[torch.fx.Node, Any] = {}
        seed = arrays[-1] if needs_seed else None
        it = iter(arrays)
        for node, plan, ex, in zip(placeholders, plans, example_inputs):
            if plan.kind == "symint":
                env[node] = sizes(ex) if isinstance(ex, torch.SymInt) else ex
            else:
                a = next(it)
                if plan.kind == "permuted":
                    a = jnp.transpose(a, _inverse(plan.perm))
                env[node] = a
        for index, node in enumerate(gm.graph.nodes):
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":
                env[node] = _constant(getattr(gm, node.target))
                continue
            if node.op != "call_function":
                raise LoweringError(node, TypeError(f"unsupported FX node kind {node.op!r}"))
            args = torch.fx.node.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
            if node.target in PYTHON_OPS:
                env[node] = node.target(*args, **kwargs)
                continue
            rule = lowering_for(node.target)
            ctx = LoweringContext(node, sizes, seed if rule.random else None, index)
            try:
                args, kwargs = prepare_args(rule, ctx, list(args), dict(kwargs))
                out = rule.fn(ctx, *args, **kwargs)
                env[node] = _check_result(ctx, out)
            except (LoweringError, UnsupportedOpError):
                raise
            except Exception as e:  # a rule bug or an unsupported argument combination
                raise LoweringError(node, e) from e
        results = []
        out_plans.clear()
        tensor_inputs = {n: i for n, p, i in zip(placeholders, plans, range(len(plans))) if p.kind != "symint"}
        for v, meta in zip(out_vals, [getattr(o, "meta", {}).get("val") if isinstance(o, torch.fx.Node) else o for o in out_vals]):
            chain = _input_view_chain(v, tensor_inputs) if isinstance(v, torch.fx.Node) else None
            if chain is not None:
                out_plans.append(OutputPlan("input", index=chain[0], views=chain[1]))
                continue
            value = env[v] if isinstance(v, torch.fx.Node) else v
            if not is_array(value):
                out_plans.append(OutputPlan("const", value=value))
                continue
            plan = OutputPlan("tensor", index=len(results))
            if isinstance(meta, torch.Tensor) and value.ndim > 1 and not _symbolic(meta.shape):
                shape, stride = tuple(meta.shape), tuple(meta.stride())
                if meta.numel() > 1 and not meta.is_contiguous():
                    perm = dense_permutation(shape, stride)
                    if perm is not None and not _is_identity(perm):
                        value = jnp.transpose(value, perm)
                        plan = OutputPlan("tensor", index=len(results), inv_perm=_inverse(perm))
                    else:
                        plan = OutputPlan("tensor", index=len(results), stride=stride)
            results.append(value)
            out_plans.append(plan)
        return results

    with jax.enable_x64(True):
        lowered = jax.jit(trace, keep_unused=True).lower(*avals)
        text = lowered.as_text()
    return LoweredGraph(text, plans, list(out_plans), arg_shapes, needs_seed)


def _check_result(ctx: LoweringContext, out):
    """Cast rule results to the dtype torch's meta says; a shape mismatch is a rule bug."""
    meta = ctx.out
    if isinstance(meta, torch.Tensor):
        return _fix(ctx, out, meta)
    if isinstance(meta, (tuple, list)) and isinstance(out, (tuple, list)):
        return type(out)(_fix(ctx, o, m) if isinstance(m, torch.Tensor) else o for o, m in zip(out, meta))
    return out


def _fix(ctx, value, meta):
    if not is_array(value):
        value = jnp.asarray(value)
    shape = concrete_shape(meta.shape, ctx.sizes)
    if tuple(value.shape) != shape:
        raise ValueError(f"rule produced shape {tuple(value.shape)}, torch expects {shape}")
    dtype = to_jax_dtype(meta.dtype)
    if value.dtype != dtype:
        value = jax.lax.convert_element_type(value, dtype)
    return value
