"""Lower an FX graph of core ATen ops to a StableHLO module by tracing its rules with jax."""
from __future__ import annotations

import math
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.fx

from ..errors import InvalidInputError, LoweringError, UnsupportedOpError
from .dtypes import to_jax_dtype
from .checks import RuntimeChecks
from .registry import LoweringContext, RejectedInput, complex_to_real, concrete_shape, is_array, lowering_for, prepare_args

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
    to `stride` if set, then `views` replayed), "const" (a Python value fixed at lowering time,
    e.g. a size or None), "input" (below), "concat" (the torch-side concatenation `index` of
    `LoweredGraph.input_concats`, then `views`).
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


def _view_chain(node):
    """(base node, ((view op, args), ...)): `node` as a chain of view ops with static arguments
    applied to `base` (no views: `node` itself)."""
    views = []
    while node.op == "call_function" and node.target in _VIEW_OPS and not node.kwargs:
        src, *rest = node.args
        if not isinstance(src, torch.fx.Node) or any(
            isinstance(a, torch.fx.Node) or (isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a))
            for a in rest
        ):
            break
        views.append((node.target, tuple(rest)))
        node = src
    return node, tuple(reversed(views))


@dataclass
class LoweredGraph:
    module_text: str
    inputs: list[InputPlan]
    outputs: list[OutputPlan]
    arg_shapes: list[tuple[tuple[int, ...], Any]] = field(default_factory=list)
    needs_seed: bool = False  # the executable takes one more input: an int64 seed
    # Concatenations of graph inputs along dim 0 (weights stacked for a scan), done in torch
    # before the call and passed as extra executable inputs after the graph's tensors: by
    # graph input position. The caller keeps the result while its inputs are unchanged.
    input_concats: list[tuple[int, ...]] = field(default_factory=list)
    # Graph inputs the graph writes (AOTAutograd's `copy_(input, new)` kept in inference
    # graphs): (graph input position, executable result index of the new contents). The
    # results come after the graph's own outputs; CompiledGraph installs them in the inputs.
    mutations: list[tuple[int, int]] = field(default_factory=list)
    # Run-time index checks (checks.CheckRecord): the executable's LAST result is an int32
    # code, 0 when all passed, else 1 + the position of the first failed check here.
    checks: tuple = ()


def input_mutations(gm: torch.fx.GraphModule) -> dict:
    """placeholder node -> the last `aten.copy_` node writing it (AOTAutograd's in-graph
    write-back of a mutated input)."""
    found = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
                and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "placeholder":
            found[node.args[0]] = node
    return found


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


# Input-independent values (shape-derived masks, position ids) up to this many elements are
# computed once, in torch, when the graph is lowered, and reach XLA as literals: no kernel to
# compile for them, no work per call. Larger ones stay computations (a literal that size
# bloats the module text, which is also the cache key).
CONSTANT_FOLD_MAX_ELEMENTS = 1 << 16
_NO_FOLD = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
            torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
            torch.ops.aten.new_empty_strided.default}  # uninitialised: never worth a literal


def _foldable_value(v) -> bool:
    if isinstance(v, torch.Tensor):
        fp8 = v.dtype.is_floating_point and v.dtype.itemsize == 1  # no numpy twin
        return (v.layout == torch.strided and v.device.type == "cpu" and not v.is_complex() and not fp8
                and all(isinstance(d, int) for d in v.shape)
                and math.prod(v.shape) <= CONSTANT_FOLD_MAX_ELEMENTS)
    if isinstance(v, (tuple, list)):
        return all(_foldable_value(x) for x in v)
    return isinstance(v, (bool, int, float))


def constant_values(gm: torch.fx.GraphModule) -> dict:
    """The graph's input-independent nodes (no placeholder or attribute among their
    ancestors, deterministic and functional ops, small static results), evaluated in torch:
    {node: value}. An op torch cannot evaluate here is simply left to XLA."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    values: dict = {}
    with unset_fake_temporarily(), torch.no_grad():
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target in _NO_FOLD:
                continue
            if not all(i in values for i in node.all_input_nodes):
                continue
            if node.target not in PYTHON_OPS:
                rule = lowering_for(node.target)
                schema = getattr(node.target, "_schema", None)
                if rule is None or rule.random or rule.subgraphs is not None or schema is None or schema.is_mutable:
                    continue
            if "val" not in node.meta or not _foldable_value(node.meta["val"]):
                continue
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
            try:
                value = node.target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - XLA computes it instead
                continue
            if _foldable_value(value):
                values[node] = value
    return values


def _bind_constants(values: dict, env: dict) -> None:
    """Bind folded nodes in `env`: as jax literals where a node outside the folded set (or the
    output) reads them, as the torch value otherwise (read by nothing run_nodes evaluates)."""
    for node, value in values.items():
        env[node] = _literal(value) if any(u not in values for u in node.users) else value


def _literal(value):
    if isinstance(value, torch.Tensor):
        return _constant(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_literal(v) for v in value)
    return value


def _input_concats(gm, placeholders, plans) -> list:
    """(cat node, graph input positions) for each `aten.cat(inputs, 0)` whose operands are all
    dense graph inputs of one shape and dtype (weights stacked by scan-folding): computing it in
    torch once per weight update beats a concatenation inside every call (and its kernels)."""
    index = {n: i for i, n in enumerate(placeholders)}
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
            continue
        tensors = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if dim != 0 or len(tensors) < 2 or not all(isinstance(t, torch.fx.Node) and t in index for t in tensors):
            continue
        metas = [t.meta.get("val") for t in tensors]
        if not all(isinstance(m, torch.Tensor) and m.dim() > 0 and not _symbolic(m.shape) for m in metas):
            continue
        if len({(tuple(m.shape), m.dtype) for m in metas}) != 1 or any(plans[index[t]].kind != "tensor" for t in tensors):
            continue
        found.append((node, tuple(index[t] for t in tensors)))
    return found


def concat_only_inputs(gm: torch.fx.GraphModule, example_inputs) -> set[int]:
    """Graph input positions read only by input concatenations (per-layer weights of a folded
    scan, stacked in torch before the call): the executable never sees them, so they are not
    passed to it (at depth that is hundreds of parameters fewer to lower and compile)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return _read_only_by(placeholders, _input_concats(gm, placeholders, [plan_input(v) for v in example_inputs]))


def _read_only_by(placeholders, concats) -> set[int]:
    nodes = {node for node, _ in concats}
    if not nodes:
        return set()
    return {i for i, n in enumerate(placeholders) if n.users and all(u in nodes for u in n.users)}


def check_rules(gm: torch.fx.GraphModule) -> None:
    """Raise UnsupportedOpError for the first op in the graph that has no rule."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target not in PYTHON_OPS:
            rule = lowering_for(node.target)
            if rule is None:
                raise UnsupportedOpError(node)
            for sub in (rule.subgraphs(gm, node) if rule.subgraphs is not None else ()):
                check_rules(sub)  # ops inside loop bodies too


def lower_graph(gm: torch.fx.GraphModule, example_inputs, concrete_args=None,
                check_indices: bool = True) -> LoweredGraph:
    """Trace `gm` into StableHLO.

    example_inputs: FakeTensors / SymInts of the graph's placeholders (their shapes may be
    symbolic); concrete_args: the actual call's values, which fix every symbolic size.
    check_indices: lower run-time checks of index values (see checks.py).
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

    concats = _input_concats(gm, placeholders, plans)
    skipped = _read_only_by(placeholders, concats)  # see concat_only_inputs
    avals, arg_shapes = [], []
    for i, (plan, ex, real) in enumerate(zip(plans, example_inputs, concrete_args or example_inputs)):
        if plan.kind == "symint" or i in skipped:
            continue
        shape = tuple(real.shape) if concrete_args is not None else concrete_shape(ex.shape, sizes)
        if plan.kind == "permuted":
            shape = tuple(shape[d] for d in plan.perm)
        dtype = to_jax_dtype(ex.dtype)
        avals.append(jax.ShapeDtypeStruct(shape, dtype))
        arg_shapes.append((shape, dtype))

    for node, _ in concats:
        meta = node.meta["val"]
        avals.append(jax.ShapeDtypeStruct(tuple(meta.shape), to_jax_dtype(meta.dtype)))
    needs_seed = graph_uses_randomness(gm)
    if needs_seed:
        avals.append(jax.ShapeDtypeStruct((), np.int64))

    constants = constant_values(gm)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_vals = list(output_node.args[0]) if isinstance(output_node.args[0], (list, tuple)) else [output_node.args[0]]
    out_plans: list[OutputPlan] = []
    written = input_mutations(gm)
    mutations: list[tuple[int, int]] = []
    check_records: list = []

    def trace(*arrays):
        env: dict[torch.fx.Node, Any] = {}
        seed = arrays[-1] if needs_seed else None
        it = iter(arrays)
        for i, (node, plan, ex) in enumerate(zip(placeholders, plans, example_inputs)):
            if plan.kind == "symint":
                env[node] = sizes(ex) if isinstance(ex, torch.SymInt) else ex
            elif i in skipped:  # read only by a concatenation bound below
                continue
            else:
                a = next(it)
                if plan.kind == "permuted":
                    a = jnp.transpose(a, _inverse(plan.perm))
                env[node] = a
        for node, _ in concats:
            env[node] = next(it)
        _bind_constants(constants, env)
        checks = RuntimeChecks() if check_indices else None
        run_nodes(gm, gm.graph.nodes, env, sizes, seed, checks)
        results = []
        out_plans.clear()
        tensor_inputs = {n: i for n, p, i in zip(placeholders, plans, range(len(plans))) if p.kind != "symint"}
        concat_index = {node: j for j, (node, _) in enumerate(concats)}
        base_result: dict = {}  # base node -> result index, for outputs that are views of it
        for v, meta in zip(out_vals, [getattr(o, "meta", {}).get("val") if isinstance(o, torch.fx.Node) else o for o in out_vals]):
            if isinstance(v, torch.fx.Node):
                base, views = _view_chain(v)
                if base in tensor_inputs:  # an input or a view of one: no copy through XLA
                    out_plans.append(OutputPlan("input", index=tensor_inputs[base], views=views))
                    continue
                if base in concat_index:  # weights stacked in torch before the call
                    out_plans.append(OutputPlan("concat", index=concat_index[base], views=views))
                    continue
                base_meta = base.meta.get("val")
                if views and isinstance(base_meta, torch.Tensor) and not _symbolic(base_meta.shape) \
                        and base_meta.is_contiguous() and is_array(env.get(base)):
                    # Views of one computed value (per-layer gradients of stacked weights): the
                    # value leaves the executable once, the views are taken in torch.
                    if base not in base_result:
                        base_result[base] = len(results)
                        results.append(env[base])
                    out_plans.append(OutputPlan("tensor", index=base_result[base], views=views))
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
        mutations.clear()
        for dst, node in written.items():  # the inputs' new contents, after the outputs
            mutations.append((placeholders.index(dst), len(results)))
            results.append(env[node])
        check_records.clear()
        code = checks.code() if checks is not None and checks.records else None
        if code is not None:  # last: the index checks' verdict
            check_records.extend(checks.records)
            results.append(code)
        return results

    with jax.enable_x64(True), warnings.catch_warnings():
        # A complex value silently cast to real is a wrong answer, never a warning for users.
        warnings.simplefilter("error", np.exceptions.ComplexWarning)
        lowered = jax.jit(trace, keep_unused=True).lower(*avals)
        text = lowered.as_text()
    return LoweredGraph(text, plans, list(out_plans), arg_shapes, needs_seed, [c for _, c in concats],
                        list(mutations), tuple(check_records))


def run_nodes(gm: torch.fx.GraphModule, nodes, env: dict, sizes, seed, checks=None) -> dict:
    """Evaluate `nodes` (call_function / get_attr nodes of `gm`, in order) with their rules, on
    the traced jax values in `env` (updated and returned). Placeholders and the output node are
    skipped: the caller binds the first and reads the second. `seed` is the per-call int64 seed
    or a PRNG key (inside loop bodies: a key folded with the iteration), or None. `checks`: the
    RuntimeChecks of this trace level, where rules record index checks (None: no checks)."""
    for index, node in enumerate(nodes):
        if node.op in ("placeholder", "output") or node in env:  # bound by the caller
            continue
        if node.op == "get_attr":
            attr = getattr(gm, node.target)
            # Subgraphs (scan bodies) stay modules for the rule that lowers them.
            env[node] = attr if isinstance(attr, torch.nn.Module) else _constant(attr)
            continue
        if node.op != "call_function":
            raise LoweringError(node, TypeError(f"unsupported FX node kind {node.op!r}"))
        args = torch.fx.node.map_arg(node.args, env.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.target in PYTHON_OPS:
            env[node] = node.target(*args, **kwargs)
            continue
        rule = lowering_for(node.target)
        if rule is None:
            raise UnsupportedOpError(node)
        ctx = LoweringContext(node, sizes, seed if (rule.random or rule.subgraphs) else None, index, gm,
                              env if rule.subgraphs else None, checks)
        try:
            args, kwargs = prepare_args(rule, ctx, list(args), dict(kwargs))
            out = rule.fn(ctx, *args, **kwargs)
            env[node] = _check_result(ctx, out)
        except (LoweringError, UnsupportedOpError, InvalidInputError):
            raise
        except RejectedInput as e:  # eager rejects these inputs: the user's error, not a rule's
            raise InvalidInputError(node, str(e)) from None
        except Exception as e:  # a rule bug or an unsupported argument combination
            raise LoweringError(node, e) from e
    return env


def graph_uses_randomness(gm: torch.fx.GraphModule) -> bool:
    """Whether any node of `gm` (or of a subgraph a rule lowers, e.g. a scan body) is random."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target in PYTHON_OPS:
            continue
        rule = lowering_for(n.target)
        if rule is not None and (rule.random or (rule.subgraphs is not None and any(
                graph_uses_randomness(sub) for sub in rule.subgraphs(gm, n)))):
            return True
    return False


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
        complex_to_real(value, dtype)
        value = jax.lax.convert_element_type(value, dtype)
    return value
