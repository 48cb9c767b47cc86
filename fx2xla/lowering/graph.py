"""Lower an FX graph of core ATen ops to a StableHLO module by tracing its rules with jax."""
from __future__ import annotations

import dataclasses
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
from .checks import CheckVerdict, RuntimeChecks
from . import channels_last, memory
from . import linalg as _linalg
from . import regions as _regions
from ..layouts import inverse
from ..plan import GraphPlan, OutputPlan
from ..sharding import mesh_by_id
from .. import torch_kernels as _torch_kernels
from .registry import (PYTHON_OPS, LoweringContext, RejectedInput, complex_to_real, concrete_shape, current_platform,
                       is_array, data_dependent, lowering_for, lowering_for_node, lowering_platform,
                       prepare_args)



@dataclass
class LoweredGraph:
    """The module `lower_graph` emitted for a plan, at one specialization's concrete shapes."""

    module_text: str
    plan: GraphPlan
    outputs: list[OutputPlan]  # the plan's, with sizes resolved for these shapes
    arg_shapes: list[tuple[tuple[int, ...], Any]] = field(default_factory=list)
    # Run-time index checks (checks.CheckRecord): the executable's LAST result is an int32
    # code, 0 when all passed, else 1 + the position of the first failed check here.
    checks: tuple = ()
    result_shapes: list = field(default_factory=list)  # every result's shape, the checks' code last

    @property
    def needs_seed(self) -> bool:
        return self.plan.seed

    @property
    def input_concats(self) -> list[tuple[int, ...]]:
        return [c for _, c in self.plan.concats]

    @property
    def mutations(self) -> list[tuple[int, int]]:
        return self.plan.mutations


def _constant(t: torch.Tensor):
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # lowering runs inside AOTAutograd's FakeTensorMode
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return jnp.asarray(t.float().numpy(), dtype=jnp.bfloat16)
        return jnp.asarray(t.resolve_conj().numpy(), dtype=to_jax_dtype(t.dtype))


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


def check_rules(gm: torch.fx.GraphModule) -> None:
    """Raise UnsupportedOpError for the first op in the graph that has no rule."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target not in PYTHON_OPS:
            if data_dependent(node):
                raise UnsupportedOpError(node, "its result's size depends on the input's values, and an XLA "
                                               "executable's result sizes are fixed when it is compiled "
                                               "(options={'fallback': 'eager'} runs it eagerly)")
            rule = lowering_for_node(node)
            if rule is None:
                raise UnsupportedOpError(node, "fx2xla's rule for it does not cover these arguments"
                                         if lowering_for(node.target) is not None else None)
            for sub in (rule.subgraphs(gm, node) if rule.subgraphs is not None else ()):
                check_rules(sub)  # ops inside loop bodies too



def symbol_bindings(example_inputs, concrete_args) -> dict:
    """Each symbolic size of the placeholders' examples -> its value in the call's arguments."""
    bindings: dict = {}
    if concrete_args is None:
        return bindings
    for ex, real in zip(example_inputs, concrete_args):
        if isinstance(ex, torch.SymInt):
            bindings[ex.node.expr] = int(real)
        elif isinstance(ex, torch.Tensor) and real is not None:  # (None: an effect token)
            for s, r in zip([*ex.shape, *ex.stride(), ex.storage_offset()],
                            [*real.shape, *real.stride(), real.storage_offset()]):
                if isinstance(s, torch.SymInt):
                    bindings[s.node.expr] = int(r)
    return bindings


def _resolve(value, bindings):
    """A constant output's value, or a view's arguments, at these shapes (a symbolic size or
    index becomes its number, in tuples and lists too)."""
    if isinstance(value, (tuple, list)):
        return type(value)(_resolve(v, bindings) for v in value)
    for sym, cast in ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool)):
        if isinstance(value, sym):
            return cast(value.node.expr.xreplace(bindings))
    return value


def lower_graph(gm: torch.fx.GraphModule, plan: GraphPlan, example_inputs, concrete_args=None,
                check_indices: bool = True, torch_kernels=True) -> LoweredGraph:
    """Trace `gm` into a StableHLO module for `plan`, lowered for the plan's platform.

    example_inputs: FakeTensors / SymInts of the graph's placeholders (their shapes may be
    symbolic); concrete_args: the actual call's values, which fix every symbolic size.
    check_indices: lower run-time checks of index values (see checks.py).
    torch_kernels: on the CPU, which of the kernel library's custom calls rules may use, where
    it is built (fx2xla/torch_kernels.py: True = all, or some of its KINDS); False: XLA's
    kernels only, as a package's portable module needs.
    """
    check_rules(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # (A value passed to the executable binds no symbol: its uses are traced, not baked in.)
    bindings = symbol_bindings([None if p.kind == "scalar" else ex for p, ex in zip(plan.inputs, example_inputs)],
                               concrete_args)

    def sizes(s):
        if not isinstance(s, torch.SymInt):
            return int(s)
        expr = s.node.expr
        if expr in bindings:
            return bindings[expr]
        return int(expr.xreplace(bindings))

    avals, arg_shapes = [], []
    for plan_in, ex, real in zip(plan.inputs, example_inputs, concrete_args or example_inputs):
        if not plan_in.passed:
            continue
        if plan_in.kind == "scalar":
            avals.append(jax.ShapeDtypeStruct((), np.int64))
            arg_shapes.append(((), np.dtype(np.int64)))
            continue
        shape = tuple(real.shape) if concrete_args is not None else concrete_shape(ex.shape, sizes)
        if plan_in.kind in ("permuted", "relaid"):
            shape = tuple(shape[d] for d in plan_in.perm)
        dtype = np.dtype(np.float32) if plan_in.kind == "widened" else to_jax_dtype(ex.dtype)
        avals.append(jax.ShapeDtypeStruct(shape, dtype))
        arg_shapes.append((shape, dtype))
    for node, _ in plan.concats:
        meta = node.meta["val"]
        avals.append(jax.ShapeDtypeStruct(tuple(meta.shape), to_jax_dtype(meta.dtype)))
    if plan.seed:
        avals.append(jax.ShapeDtypeStruct((), np.int64))
    pinned = reads = None
    if plan.constraints:
        mesh = mesh_by_id(plan.mesh_id)
        pinned = {node: mesh.named_sharding(spec) for node, spec in plan.constraints.items()}
        reads = {node: {u: mesh.named_sharding(spec) for u, spec in specs.items()}
                 for node, specs in plan.operand_constraints.items()}

    def trace(*arrays):
        env: dict[torch.fx.Node, Any] = {}
        wide = {}  # a widened weight's placeholder -> its float32 copy
        it = iter(arrays)
        for node, plan_in, ex in zip(placeholders, plan.inputs, example_inputs):
            if plan_in.kind == "symint":
                env[node] = sizes(ex) if isinstance(ex, torch.SymInt) else ex
            elif plan_in.kind == "token":  # no value: with_effects rules pass it on
                env[node] = None
            elif plan_in.passed:
                a = next(it)
                if plan_in.memory_kind is not None:  # host offloading: XLA brings it to the device
                    a = memory.to_device(a)
                if plan_in.kind == "widened":  # its matmuls read the copy; anything else, the weight
                    wide[node] = a
                    a = a.astype(to_jax_dtype(ex.dtype))
                env[node] = jnp.transpose(a, inverse(plan_in.perm)) if plan_in.kind in ("permuted", "relaid") else a
        for node, _ in plan.concats:
            env[node] = next(it)
        seed = next(it) if plan.seed else None
        _bind_constants(plan.constants, env)
        checks = RuntimeChecks() if check_indices else None
        run_nodes(gm, gm.graph.nodes, env, sizes, seed, checks, pinned, reads, plan.channels_last.nodes,
                  plan.weight_lhs, plan.few_rows, plan.regions,
                  {u: wide[w] for u, w in _linalg.widened_matmuls(gm, wide).items()})
        results = []
        for r in plan.results:
            value = env[r.node]
            value = _literal(value) if isinstance(value, torch.Tensor) else value
            if r.memory_kind is None and memory.placed_on_host(r.node):  # torch's tensors: device memory
                value = memory.to_device(value)
            results.append(jnp.transpose(value, r.perm) if r.perm is not None else value)
        # Last: the index checks' verdict, its records in the output tree (no result if none).
        return results, checks.verdict() if checks is not None else CheckVerdict()

    kernels = _torch_kernels.only(_torch_kernels.kinds(torch_kernels))
    with jax.enable_x64(True), warnings.catch_warnings(), lowering_platform(plan.platform, plan.mesh_id is not None), \
            kernels:
        # A complex value silently cast to real is a wrong answer, never a warning for users.
        warnings.simplefilter("error", np.exceptions.ComplexWarning)
        traced = jax.jit(trace, keep_unused=True, **spmd_shardings(plan)).trace(*avals)
        lowered = traced.lower(lowering_platforms=(plan.platform,))
        aliases = written_aliases(plan)
        if aliases:
            alias_inputs(lowered.compiler_ir(), aliases)
        text = lowered.as_text()
        out_info = traced.out_info  # (results, CheckVerdict): the records are the tree's aux data
        result_shapes = [tuple(o.shape) for o in jax.tree.leaves(out_info)]
    verdict = out_info[1]
    outputs = [dataclasses.replace(p, value=_resolve(p.value, bindings)) if p.kind == "const"
               else dataclasses.replace(p, views=tuple((op, _resolve(args, bindings)) for op, args in p.views))
               if p.views else p
               for p in plan.outputs]
    return LoweredGraph(text, plan, outputs, arg_shapes, verdict.records, result_shapes)


def written_aliases(plan: GraphPlan) -> dict[int, int]:
    """Executable argument -> the result it is written back from, for every donated input."""
    argument = {i: k for k, i in enumerate(i for i, p in enumerate(plan.inputs) if p.passed)}
    return {argument[m.input]: m.result for m in plan.mutations if plan.inputs[m.input].donated}


def alias_inputs(module, aliases: dict[int, int]) -> None:
    """Mark, in `module` (jax's lowered MLIR, edited in place), each argument of `aliases` as
    donated into its result. Set here rather than with jit's donate_argnums, which pairs each
    result, in order, with the first donated argument of the same shape and dtype still
    unpaired: an optimizer step's first update result would land in the buffer of the first
    parameter of its shape, not of the one it belongs to."""
    from jax.extend.mlir import ir

    with module.context:
        main = next(op for op in module.body.operations
                    if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main")
        i32 = ir.IntegerType.get_signless(32)
        count = len(main.regions[0].blocks[0].arguments)
        current = (list(ir.ArrayAttr(main.attributes["arg_attrs"])) if "arg_attrs" in main.attributes
                   else [ir.DictAttr.get({})] * count)
        attrs = []
        for k, a in enumerate(current):
            entries = {n.name: n.attr for n in ir.DictAttr(a) if n.name not in ("tf.aliasing_output", "jax.buffer_donor")}
            if k in aliases:
                entries["tf.aliasing_output"] = ir.IntegerAttr.get(i32, aliases[k])
            attrs.append(ir.DictAttr.get(entries))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)


def passed_spec(spec, perm):
    """A torch-order spec in the order of the value the executable sees (`t.permute(perm)`)."""
    return spec if perm is None else tuple(spec[d] for d in perm)


def spmd_shardings(plan: GraphPlan) -> dict:
    """jax.jit's in_shardings/out_shardings for a plan over a mesh: the inputs' and results'
    specs (in their memory kinds, where host offloading put them in host memory), replicated
    for stacked weights, the seed and the index checks' verdict. For one device: nothing, unless
    the plan offloads (memory.single_device_shardings)."""
    if plan.mesh_id is None:
        return memory.single_device_shardings(plan)  # {} unless host offloading
    mesh = mesh_by_id(plan.mesh_id)
    replicated = mesh.named_sharding(())
    ins = [memory.with_kind(mesh.named_sharding(passed_spec(p.sharding, p.perm if p.kind == "permuted" else None)),
                            p.memory_kind)
           for p in plan.inputs if p.passed]
    ins += [replicated] * (len(plan.concats) + int(plan.seed))
    outs = [memory.with_kind(mesh.named_sharding(passed_spec(r.sharding, r.perm)), r.memory_kind) for r in plan.results]
    return {"in_shardings": tuple(ins), "out_shardings": (outs, replicated)}


def run_nodes(gm: torch.fx.GraphModule, nodes, env: dict, sizes, seed, checks=None, pinned=None,
              reads=None, laid=frozenset(), weight_lhs=frozenset(), few_rows=frozenset(), regions=(),
              wide=None) -> dict:
    """Evaluate `nodes` (call_function / get_attr nodes of `gm`, in order) with their rules, on
    the traced jax values in `env` (updated and returned). Placeholders and the output node are
    skipped: the caller binds the first and reads the second. `seed` is the per-call int64 seed
    or a PRNG key (inside loop bodies: a key folded with the iteration), or None. `checks`: the
    RuntimeChecks of this trace level, where rules record index checks (None: no checks).
    `pinned`: node -> jax sharding each such value is constrained to (the plan's constraints).
    `reads`: node -> {operand node: jax sharding}: the layouts the node reads those operands in.
    `laid`: the nodes lowered on channels-last values (channels_last.py); every value in `env`
    is in torch's layout all the same. `weight_lhs`: the matmuls computed with their weight as
    the dot's left operand (GraphPlan.weight_lhs); `few_rows`: those in the kernel library's
    few-row matmul (GraphPlan.few_rows). `regions`: elementwise regions (GraphPlan.regions),
    computed at their last node, by the kernel library's handler or else op by op. `wide`:
    matmul node -> the float32 copy of its widened weight (InputKind.WIDENED), which it
    multiplies instead."""
    region_of = {n: r for r in regions for n in r.nodes}
    for index, node in enumerate(nodes):
        if node.op in ("placeholder", "output") or node in env:  # bound by the caller
            continue
        if node in region_of:
            region = region_of[node]
            if node is not region.last:  # only the region's outputs are read, after its last op
                continue
            values = _regions.lower(region, env)
            if values is None:
                run_nodes(gm, region.nodes, env, sizes, seed, checks, pinned, reads, laid, weight_lhs, few_rows,
                          wide=wide)
            else:
                env.update(zip(region.outputs, values))
            continue
        if node.op == "get_attr":
            attr = getattr(gm, node.target)
            # Subgraphs (scan bodies) stay modules for the rule that lowers them.
            env[node] = attr if isinstance(attr, torch.nn.Module) else _constant(attr)
            continue
        if node.op != "call_function":
            raise LoweringError(node, TypeError(f"unsupported FX node kind {node.op!r}"))
        look = env.__getitem__
        if reads is not None and node in reads:
            constrained = {u: jax.lax.with_sharding_constraint(env[u], sh) for u, sh in reads[node].items()}

            def look(u, constrained=constrained):
                return constrained[u] if u in constrained else env[u]
        args = torch.fx.node.map_arg(node.args, look)
        kwargs = torch.fx.node.map_arg(node.kwargs, look)
        if node.target in PYTHON_OPS:
            env[node] = node.target(*args, **kwargs)
            continue
        rule = lowering_for_node(node, current_platform())
        if rule is None:
            raise UnsupportedOpError(node)
        nhwc = node in laid
        ctx = LoweringContext(node, sizes, seed if (rule.draws(node) or rule.subgraphs) else None, index, gm,
                              env if rule.subgraphs or rule.reads_values else None, checks, nhwc,
                              node in weight_lhs, node in few_rows, wide.get(node) if wide else None)
        try:
            if nhwc:
                out = channels_last.lower(rule, ctx, list(args), dict(kwargs),
                                          lambda a, k, ctx=ctx, rule=rule: prepare_args(rule, ctx, a, k))
            else:
                args, kwargs = prepare_args(rule, ctx, list(args), dict(kwargs))
                out = rule.fn(ctx, *args, **kwargs)
            env[node] = _check_result(ctx, out)
            if pinned is not None and node in pinned:
                env[node] = jax.lax.with_sharding_constraint(env[node], pinned[node])
        except (LoweringError, UnsupportedOpError, InvalidInputError):
            raise
        except RejectedInput as e:  # eager rejects these inputs: the user's error, not a rule's
            raise InvalidInputError(node, str(e)) from None
        except Exception as e:  # a rule bug or an unsupported argument combination
            raise LoweringError(node, e) from e
    return env


def _check_result(ctx: LoweringContext, out):
    """Cast rule results to the dtype torch's meta says; a shape mismatch is a rule bug."""
    meta = ctx.out
    if isinstance(meta, torch.Tensor):
        return _fix(ctx, out, meta)
    if isinstance(meta, (tuple, list)) and isinstance(out, (tuple, list)):
        # (None: an effect token, which has no value in the executable; plan.effect_tokens)
        return type(out)(_fix(ctx, o, m) if isinstance(m, torch.Tensor) and o is not None else o
                         for o, m in zip(out, meta))
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
