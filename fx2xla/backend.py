"""The `torch.compile` backend: `torch.compile(model, backend="fx2xla", options={...})`.

Dynamo hands us a graph; AOTAutograd (with the core-ATen decomposition table) turns it into
forward/backward or inference graphs of core ATen ops; each becomes a CompiledGraph that
lowers to StableHLO and runs on the PJRT device its tensor inputs live on (`PJRT_DEVICE` and
the `device_index` option override it).
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import os
import re
import warnings
import weakref

import torch

from . import dump, precompile, torch_kernels
from .compiled_graph import CompiledGraph, static_input_indices
from .decompositions import attention_op_table, decomposition_table
from .distributed import process_share
from .errors import InvalidInputError, node_op
from .lowering.linalg import check_linear_layout
from .metrics import counters, live_graphs
from .offload import note_forward, parse_offload, plan_offload
from .partition import drop_unused_scalars, partitioned_graph, unsupported_nodes
from .passes import pass_options, run_passes
from .passes.auto_sharding import (InfeasibleBudget, Solution, graph_key, repeated_layers, solution_from_record,
                                   solution_record, solve_cached, solve_least)
from .passes.sharding import graph_mesh, input_annotations, input_tensors
from .runtime import device_for, executor
from .runtime.disk_cache import DiskCache
from .serving import InputSignature, RecompileError, check_compile_allowed, compile_allowed, signature_change
from .sharding import (Annotation, Mesh, ShardingError, annotation_of, is_mark, note_compile_origin,
                       per_device_bytes)

OPTIONS = {
    # name: (default, help)
    "device_index": (None, "local PJRT device index (default: FX2XLA_DEVICE_INDEX or 0)"),
    "no_recompile": (False, "compiles outside fx2xla.warmup() raise RecompileError"),
    "batch_buckets": (None, "inference with a dynamic batch dim: pad it up to these sizes (see docs/serving.md)"),
    "fallback": ("eager", '"eager": ops with no lowering rule run eagerly between XLA subgraphs; "error": raise'),
    "check_indices": (True, "check index values at run time (embedding, gather, scatter, x[i], ...): an "
                      "out-of-range index raises IndexOutOfRangeError as eager raises; False skips the checks, "
                      "and such an index then reads a clamped element or drops a scatter update"),
    "partitioner": ("min_cut", '"min_cut": the backward recomputes cheap ops instead of saving every activation '
                    '(fewer, smaller forward outputs; Inductor\'s choice); "default": AOTAutograd\'s save-everything split'),
    "sharding": (None, '"auto": shard the graph over `mesh` with no hints, by an integer program (your '
                 'mark_sharding annotations are kept as constraints); None: only what you annotate'),
    "mesh": (None, "the fx2xla.Mesh that sharding=\"auto\" shards over"),
    "outputs": ("whole", '"whole": every output of a sharded graph comes back as one torch tensor; "sharded": '
                'inference outputs that are sharded stay on their devices as fx2xla.ShardedTensor (assembled '
                'only when torch needs them whole)'),
    "memory_budget": (None, "sharding=\"auto\": peak bytes per device the graph may hold: its inputs and the values "
                      "live at once (in training, the parameters' gradients and two AdamW moments too), checked "
                      "against XLA's memory analysis of the compiled executable; None: no limit"),
    "offload": (None, '"activations": a training step\'s saved activations wait for the backward in host memory; '
                '"optimizer": the optimizer state a compiled step writes (AdamW\'s moments) stays in host memory; '
                'a list of both; None: nothing offloaded (see fx2xla/offload.py)'),
    "torch_kernels": (True, "on the CPU, the kernel library's custom calls inside the executable, where it is built "
                      "(python -m fx2xla kernels status; FX2XLA_TORCH_KERNELS=0 turns them off everywhere): "
                      "convolutions run torch's own kernels (oneDNN), attention of 32 query rows or more torch's "
                      "flash-attention kernel, bf16 matmuls of one row the library's streaming kernel, and "
                      "float32 inference matmuls of 2-8 rows against nn.Linear's weight its few-row kernel; "
                      "False: XLA's own kernels; \"convolution\", \"attention\", \"skinny_matmul\" or "
                      "\"few_rows_matmul\" (or a list): only those"),
    "channels_last": (True, "on the CPU, batch norm, pooling and pointwise ops between 2-D convolutions run on "
                      "channels-last values, and a training step's activations cross to its backward "
                      "channels-last; False: NCHW values, transposed around each convolution "
                      "(FX2XLA_CHANNELS_LAST=0 turns it off everywhere)"),
    "attention_op": (True, "inference graphs keep CPU attention as one op, whose rule scales the scores and reads "
                     "each kv head once for its group of query heads; False: torch's math decomposition, which "
                     "scales K and copies K and V per query head (training graphs always decompose it)"),
    "transposed_linear_weights": (True, "on the CPU, inference graphs import float32 weights that only matmuls of "
                                  "two rows or more read transposed (nn.Linear's) laid out [in, out], once while "
                                  "unchanged, where XLA:CPU's dot reads them faster so: weights up to 2 MiB always, "
                                  "larger ones where a dot of their shape, timed once per machine, takes at most "
                                  "0.85 of the time (the copy takes those weights' memory again); \"always\": every "
                                  "such weight; False: they are read as torch holds them"),
    "linear_weight_lhs": (True, "on the CPU, graphs (inference and training) compute float32 matmuls of 4-64 "
                          "rows against a transposed weight (nn.Linear's) as (W . x^T)^T, the weight as the dot's "
                          "left operand, which XLA:CPU's dot runs faster at those rows; their weights stay as "
                          "torch holds them (not laid out [in, out]); False: x . W^T"),
    "widened_linear_weights": (True, "on the CPU, inference graphs import bf16 and float16 weights that only "
                               "matmuls of 16 rows or more read (nn.Linear's, Conv1D's) as float32 copies, once "
                               "while unchanged, and multiply those: XLA:CPU's half-precision dot converts the "
                               "weight to float32 on every call (each copy takes twice its weight's memory), up to "
                               "1 GiB of copies per graph; \"always\": every such weight; False: the dot reads the "
                               "weights as torch holds them"),
    "merge_linears": (True, "on the CPU, inference graphs multiply one activation of 2-64 rows by the float32 "
                      "nn.Linear weights that read it (q/k/v projections, gate and up) in one matmul, against "
                      "the weights concatenated once per update in torch (the copy takes those weights' memory "
                      "again); False: one matmul per weight"),
    # Graph passes (passes/), each switchable by its name: e.g. {"scan_folding": False}.
    **pass_options(),
}


def _check_options(options: dict | None) -> dict:
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        guesses = {u: difflib.get_close_matches(u, OPTIONS, n=1) for u in unknown}
        hint = "".join(f" (did you mean {g[0]!r} for {u!r}?)" for u, g in guesses.items() if g)
        raise ValueError(f"fx2xla: unknown option(s) {unknown}{hint}; known: {sorted(OPTIONS)}")
    opts = {k: options.get(k, d) for k, (d, _) in OPTIONS.items()}
    opts["torch_kernels"] = torch_kernels.kinds(opts["torch_kernels"])  # a ValueError names a bad kind
    for name in ("channels_last", "attention_op", "merge_linears", "linear_weight_lhs"):
        if not isinstance(opts[name], bool):
            raise ValueError(f"fx2xla: option {name}={opts[name]!r}; expected True or False")
    check_linear_layout(opts["transposed_linear_weights"], "fx2xla: option ")
    check_linear_layout(opts["widened_linear_weights"], "fx2xla: option ", "widened_linear_weights")
    if opts["fallback"] not in ("eager", "error"):
        raise ValueError(f"fx2xla: option fallback={opts['fallback']!r}; expected 'eager' or 'error'")
    if opts["partitioner"] not in ("min_cut", "default"):
        raise ValueError(f"fx2xla: option partitioner={opts['partitioner']!r}; expected 'min_cut' or 'default'")
    if opts["outputs"] not in ("whole", "sharded"):
        raise ValueError(f"fx2xla: option outputs={opts['outputs']!r}; expected 'whole' or 'sharded'")
    if opts["sharding"] not in (None, "auto"):
        raise ValueError(f"fx2xla: option sharding={opts['sharding']!r}; expected 'auto' or None")
    opts["offload"] = parse_offload(opts["offload"])  # a frozenset of offload.OFFLOAD_VALUES
    if opts["sharding"] == "auto":
        if not isinstance(opts["mesh"], Mesh):
            raise ValueError("fx2xla: option sharding='auto' needs options['mesh'], an fx2xla.Mesh "
                             f"(got {type(opts['mesh']).__name__})")
    return opts


def _graph_name(kind: str) -> str:
    cid = torch._guards.CompileContext.current_compile_id()
    return f"g{cid}_{kind}".replace("/", "_") if cid is not None else kind


def _fw_metadata():
    """AOTAutograd's view/mutation metadata of the graph being compiled (private; or None)."""
    try:
        ctx = torch._guards.TracingContext.try_get()
        return ctx.fw_metadata if ctx is not None else None
    except AttributeError:
        return None


def _saved_for_backward(gm) -> tuple[frozenset, list] | None:
    """(positions of the forward graph `gm`'s outputs that only its backward reads, the list
    AOTAutograd collects the forward's output strides in, restriding the backward's inputs to
    match), from AOTAutograd's private state; None where either is missing or the outputs do not
    line up (tensor subclasses), or with FX2XLA_PUBLIC_STRIDES=1: those outputs then keep
    torch's strides."""
    if os.environ.get("FX2XLA_PUBLIC_STRIDES", "") not in ("", "0"):
        return None
    try:
        from torch._functorch._aot_autograd.schemas import SubclassCreationMeta

        ctx = torch._guards.TracingContext.try_get()
        if ctx is None or ctx.fw_metadata is None or ctx.output_strides is None:
            return None
        meta, strides = ctx.fw_metadata, ctx.output_strides
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved = range(*meta.tensors_saved_for_backwards_slice.indices(len(outputs)))
        # Subclass outputs are flattened in the graph, and AOTAutograd's positions are not its.
        if strides or saved.start != meta.num_forward or any(isinstance(m, SubclassCreationMeta)
                                                             for m in meta.subclass_fw_graph_out_meta or ()):
            return None
    except (ImportError, AttributeError, AssertionError, TypeError):
        return None
    return frozenset(saved), strides


def aot_wrappers_needed(meta, graph_inputs: int, dynamo_inputs: int) -> bool:
    """Whether AOTAutograd's runtime wrappers do any work for an inference graph.

    They write input mutations back, regenerate outputs that alias inputs or intermediates,
    and unwrap subclasses / dedupe inputs; when there is none of that they only add ~5 µs per
    call, and the compiled graph is called directly. Anything unrecognised keeps them.
    """
    try:
        from torch._functorch._aot_autograd.schemas import OutputType, SubclassCreationMeta

        if meta is None or graph_inputs != dynamo_inputs:
            return True
        if any(i.mutates_data or i.mutates_metadata or i.mutates_storage_metadata for i in meta.input_info):
            return True
        if any(o.output_type != OutputType.non_alias for o in meta.output_info):
            return True
        if meta.num_intermediate_bases or meta.tokens or getattr(meta, "is_rng_op_functionalized", True):
            return True
        metas = list(meta.subclass_inp_meta) + list(meta.subclass_fw_graph_out_meta)
        return any(isinstance(m, SubclassCreationMeta) for m in metas)
    except (ImportError, AttributeError):
        return True


def _compile(gm, example_inputs, *, kind: str, options: dict, made: list | None = None, dynamo_inputs=None,
             solution=None):
    # The device follows the data (PJRT_DEVICE and device_index are explicit overrides).
    device = device_for([v.device for v in example_inputs if isinstance(v, torch.Tensor)
                         and not (v.device.type == "cpu" and v.dim() == 0)], options["device_index"])
    name = _graph_name(kind)
    shapes = ", ".join(str(list(v.shape)) for v in example_inputs if isinstance(v, torch.Tensor))
    check_compile_allowed(f"graph {name} ({kind}) for input shapes {shapes}", bool(options["no_recompile"]))
    drop_unused_scalars(gm)
    # Forward and inference graphs take Dynamo's inputs in Dynamo's order: eager sharding
    # annotations apply position by position (AOTAutograd added none of its own here).
    annotations, names, tensors = dynamo_inputs if dynamo_inputs is not None else (None, None, None)
    if annotations is not None and len(annotations) != len(example_inputs):
        annotations = names = tensors = None
    if options["sharding"] == "auto" and kind != "backward" and annotations is not None and solution is None:
        return _compile_auto(gm, example_inputs, annotations, tensors, names, name, kind, options, made)
    if kind == "backward":
        annotations = _saved_annotations(gm, example_inputs)
        if options["sharding"] == "auto" and annotations is not None and solution is None:
            annotations, solution = _auto_backward(gm, example_inputs, annotations, options)
    offload = _offload_plan(gm, example_inputs, kind, options, device)
    if options["fallback"] == "eager" and unsupported_nodes(gm):
        if offload is not None:
            warnings.warn(f"fx2xla: graph {name} runs parts eagerly (ops without a lowering rule): its values are "
                          f"not offloaded (option offload)", stacklevel=2)
            offload = None
        _refuse_sharded_islands(gm, annotations, name)
        return partitioned_graph(
            gm,
            lambda sub, examples, sub_name, resident: CompiledGraph(
                sub, examples, device, f"{name}_{sub_name}", resident_inputs=resident,
                no_recompile=bool(options["no_recompile"]), check_indices=bool(options["check_indices"]),
                torch_kernels=options["torch_kernels"], channels_last=options["channels_last"],
                relaid_weights=kind == "inference" and options.get("_steady_weights", True),
                linear_weights_kn=options["transposed_linear_weights"],
                merge_linears=options["merge_linears"], training=kind != "inference",
                linear_weight_lhs=options["linear_weight_lhs"],
                widened_linear_weights=options["widened_linear_weights"],
            ),
            static_input_indices(len(example_inputs)),
        )
    buckets = options["batch_buckets"] if kind == "inference" else None  # never pad training
    saved = _saved_for_backward(gm) if kind == "forward" else None
    compiled = CompiledGraph(gm, example_inputs, device, name, no_recompile=bool(options["no_recompile"]),
                             batch_buckets=tuple(buckets) if buckets else None,
                             check_indices=bool(options["check_indices"]), annotations=annotations,
                             solution=solution,
                             # Training graphs' outputs feed autograd and the backward: kept whole.
                             sharded_outputs=kind == "inference" and options["outputs"] == "sharded",
                             offload=offload, input_names=names, torch_kernels=options["torch_kernels"],
                             saved_outputs=saved[0] if saved is not None else frozenset(),
                             channels_last=options["channels_last"],
                             relaid_weights=kind == "inference" and options.get("_steady_weights", True),
                             linear_weights_kn=options["transposed_linear_weights"],
                             merge_linears=options["merge_linears"], training=kind != "inference",
                             linear_weight_lhs=options["linear_weight_lhs"],
                             widened_linear_weights=options["widened_linear_weights"])
    if saved is not None:
        saved[1].extend(compiled.output_strides())
    if kind == "forward" and offload is not None:
        note_forward(gm, compiled.plan, _compile_key())
    if made is not None:
        made.append((compiled, _fw_metadata()))
    if kind == "forward" and compiled.mesh is not None:
        _forward_shardings[_compile_key()] = _result_annotations(compiled)
    if kind == "backward" and options["sharding"] == "auto" and options["memory_budget"] is not None:
        _warn_if_over_budget(compiled, options["memory_budget"])
    return compiled


def _offload_plan(gm, example_inputs, kind: str, options: dict, device):
    """Host offloading (option `offload`, offload.py): (input positions, output positions) of this
    graph whose values live in host memory, or None."""
    if not options["offload"]:
        return None
    return plan_offload(gm, example_inputs, kind, options["offload"], device, _compile_key(), _fw_metadata())


def _warn_if_over_budget(compiled, budget: float) -> None:
    """The backward's inputs are fixed by the forward's plan, and its compiled peak is not solved
    again: over the budget, it is said, once, when it compiles."""
    peak = _step_peak(compiled, training=False)
    if peak is not None and peak > budget:
        warnings.warn(f"fx2xla auto-sharding: backward graph {compiled.name} holds {peak:,.0f} bytes per device at "
                      f"its peak (XLA's memory analysis), over memory_budget={budget:,.0f}: its inputs are the activations "
                      f"the forward's plan saved, laid out as that plan left them", stacklevel=2)


# A sharded forward graph's result shardings, by compile id, until its backward is compiled:
# the backward's saved activations (its placeholders named as the forward's results) and
# tangents (the forward's outputs, in order) arrive laid out as the forward left them.
_forward_shardings: dict = {}


def _compile_key():
    return str(torch._guards.CompileContext.current_compile_id())


def _result_annotations(compiled) -> tuple[dict, list]:
    plan = compiled.plan
    by_name = {r.node.name: Annotation(plan.mesh_id, r.sharding, "forward") for r in plan.results}
    outputs = [(tuple(plan.results[o.index].node.meta["val"].shape), by_name[plan.results[o.index].node.name])
               if o.kind == "tensor" and not o.views and o.inv_perm is None else None for o in plan.outputs]
    return by_name, outputs


def _saved_annotations(gm, example_inputs):
    saved = _forward_shardings.pop(_compile_key(), None)
    if saved is None:
        return None
    by_name, outputs = saved
    annotations = []
    for node, ex in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
        ann = by_name.get(node.name)
        if node.name.startswith("tangents_"):
            k = int(node.name.rsplit("_", 1)[1]) - 1
            out = outputs[k] if k < len(outputs) else None
            ann = out[1] if out is not None and isinstance(ex, torch.Tensor) and tuple(ex.shape) == out[0] else None
        annotations.append(ann)
    return annotations if any(annotations) else None


def _auto_backward(gm, example_inputs, annotations, options):
    """sharding="auto" in training: the backward graph solved too, its inputs (the activations
    the forward saved, the tangents) fixed in the layouts the forward gave them, so that its own
    values are laid out by the same costs (and the budget) rather than left to XLA's
    propagation."""
    mesh = options["mesh"]
    fixed = _fixed_specs(annotations, mesh)
    try:
        solution = solve_cached(gm, mesh.shape, **_solver_services(), fixed=fixed,
                                memory_budget=options["memory_budget"])
    except InfeasibleBudget:  # its inputs are fixed: the cheapest plan, and a warning once compiled
        solution = solve_cached(gm, mesh.shape, **_solver_services(), fixed=fixed)
    return _solved_annotations(annotations, solution, example_inputs, mesh), solution


def _fixed_specs(annotations, mesh) -> list:
    """Per input, the spec an annotation on `mesh` fixes (a constraint of the program), or None."""
    return [a.spec if a is not None and a.mesh_id == mesh.id else None for a in annotations]


def _solved_annotations(annotations, solution, example_inputs, mesh) -> list:
    """The inputs' annotations: the given ones, and the solver's spec (marked "auto") for the
    other tensors."""
    return [a if a is not None or spec is None or not isinstance(ex, torch.Tensor) else Annotation(mesh.id, spec, "auto")
            for a, spec, ex in zip(annotations, solution.input_specs, example_inputs)]


def _compile_auto(gm, example_inputs, user_annotations, tensors, names, name, kind, options, made):
    """sharding="auto": solve, compile, and check the executable's peak memory per device (XLA's
    memory analysis) against the budget. The solver's estimate of a plan's peak is off by what
    XLA adds (temporaries of fusions and collectives, buffer packing) or does not hold, either
    way by a few percent: near the budget, XLA's measure decides.
    1. Where the executable is over, the plan is solved again under the budget less that miss,
       at most `_BUDGET_ROUNDS` times.
    2. Where the estimate says nothing fits (at first, or once tightened), or the rounds run
       out: the least-memory plan (the cheapest of those the estimate ranks least) is compiled.
       If it fits with room to spare where the estimate had refused the budget, one solve under
       the budget raised by the estimate's excess may find a cheaper plan that still fits.
    3. Still nothing: plans whose estimate is a little over the budget (by up to the smallest
       miss measured) are compiled, at most `_EXPLORE_ROUNDS`: the estimate ranks plans that
       close apart no better than XLA's figures.
    4. Any plan of this graph measured before in this process (under another budget) whose
       compiled peak fits is taken, the cheapest.
    Only then is the budget called infeasible; the error gives the least compiled peak of the
    plans measured, a budget at which step 4 takes that plan. A plan already measured is not
    compiled again to be refused."""
    budget = options["memory_budget"]
    training = kind == "forward"
    mesh = options["mesh"]
    if budget is None:
        solution = _auto_solution(gm, example_inputs, user_annotations, options, training, names, None)
        compiled, _ = _compile_solution(gm, example_inputs, user_annotations, tensors, names, kind, options,
                                        solution, training)
        return _take(compiled, solution, example_inputs, tensors, mesh, made)
    seen = measured_plans.setdefault(_measure_key(gm, user_annotations, mesh, training), {})
    tried: list = []  # (solution, compiled peak) of this search, in order

    def measure(solution):
        """(compiled graph or None, its compiled peak); None where it was measured before."""
        sig = _plan_signature(solution)
        if sig in seen and seen[sig][1] > budget:  # refused before: not compiled again to be refused
            tried.append((solution, seen[sig][1]))
            return None, seen[sig][1]
        compiled, peak = _compile_solution(gm, example_inputs, user_annotations, tensors, names, kind, options,
                                           solution, training)
        if peak is not None:
            seen[sig] = (solution_record(solution), peak, solution.objective, solution.memory_bytes)
        tried.append((solution, peak))
        if peak is None or peak <= budget:
            return compiled, peak
        live_graphs.discard(compiled)  # not the graph that runs: out of reports and metrics now
        return None, peak

    def solve(target, least=False):
        try:
            return _auto_solution(gm, example_inputs, user_annotations, options, training, names, target, least)
        except InfeasibleBudget as e:
            return e

    def fits(peak) -> bool:
        return peak is None or peak <= budget

    # 1. Under the budget, tightened by what XLA added.
    target, refused = budget, None
    for _ in range(_BUDGET_ROUNDS):
        solution = solve(target)
        if isinstance(solution, InfeasibleBudget):
            refused = solution
            break
        compiled, peak = measure(solution)
        if fits(peak):
            return _take(compiled, solution, example_inputs, tensors, mesh, made)
        target = min(target - (peak - budget), budget - (peak - solution.memory_bytes))
        if target <= 0:
            break
    # 2. The least-memory plan.
    least = solve(None, least=True)
    if isinstance(least, Solution):
        compiled, peak = measure(least)
        if fits(peak):
            if refused is not None and len(tried) == 1 and peak is not None and least.memory_bytes > peak:
                better = solve(budget + (least.memory_bytes - peak))
                if isinstance(better, Solution) and better.objective < least.objective and \
                        _plan_signature(better) != _plan_signature(least):
                    c2, p2 = measure(better)
                    if fits(p2):
                        if compiled is not None:
                            live_graphs.discard(compiled)
                        return _take(c2, better, example_inputs, tensors, mesh, made)
            return _take(compiled, least, example_inputs, tensors, mesh, made)
    # 3. Plans whose estimate is a little over the budget.
    misses = [abs(p - s.memory_bytes) for s, p in tried if p is not None]
    spread = max(min(misses) if misses else 0.0, 0.01 * budget)
    for f in _EXPLORE_STEPS[:_EXPLORE_ROUNDS]:
        solution = solve(budget + f * spread)
        if not isinstance(solution, Solution) or _plan_signature(solution) in seen:
            continue
        compiled, peak = measure(solution)
        if fits(peak):
            return _take(compiled, solution, example_inputs, tensors, mesh, made)
    # 4. A plan measured before (in this process, under another budget) that fits.
    fitting = sorted((rec[2], sig) for sig, rec in seen.items() if rec[1] <= budget)
    if fitting:
        record = seen[fitting[0][1]][0]
        solution = solution_from_record(record, {n.name: n for n in gm.graph.nodes}, "measured")
        compiled, peak = _compile_solution(gm, example_inputs, user_annotations, tensors, names, kind, options,
                                           solution, training)
        if fits(peak):
            return _take(compiled, solution, example_inputs, tensors, mesh, made)
        live_graphs.discard(compiled)
    measured = [(s, p) for s, p in tried if p is not None]
    lowest = min(seen.values(), key=lambda rec: rec[1]) if seen else None
    said = (f"the solver's estimate refused it (the least any plan holds by the estimate: about "
            f"{refused.least_estimate:,.0f} bytes); " if refused is not None and refused.least_estimate is not None
            else "")
    if measured:
        said += ("XLA's memory analysis gave " + ", ".join(f"{p:,.0f} (estimated {s.memory_bytes:,.0f})"
                                                           for s, p in measured) + " bytes for the plans tried; ")
    if lowest is not None:
        said += (f"the least compiled peak of the plans measured is {lowest[1]:,.0f} bytes per device (XLA's memory "
                 f"analysis; estimated {lowest[3]:,.0f}): a memory_budget of {lowest[1]:,.0f} fits that plan "
                 f"(kept in this process: a compile of this graph at that budget takes it)")
    else:
        said += "the solver found no plan to measure within its time limit"
    raise InfeasibleBudget(
        f"fx2xla auto-sharding: graph {name}: no plan found whose compiled peak fits memory_budget="
        f"{budget:,.0f} bytes per device on {mesh}: {said}",
        least_estimate=None if refused is None else refused.least_estimate,
        least_bound=None if refused is None else refused.least_bound,
        least_compiled=None if lowest is None else lowest[1])


def _compile_solution(gm, example_inputs, user_annotations, tensors, names, kind, options, solution, training):
    """The graph compiled with `solution`'s plan, and its compiled peak (`_step_peak`), which
    the solution keeps (`xla_peak_bytes`)."""
    annotations = _solved_annotations(user_annotations, solution, example_inputs, options["mesh"])
    compiled = _compile(gm, example_inputs, kind=kind, options=options, dynamo_inputs=(annotations, names, tensors),
                        solution=solution)
    peak = _step_peak(compiled, training)
    solution.xla_peak_bytes = peak
    return compiled, peak


def _take(compiled, solution, example_inputs, tensors, mesh, made):
    """The plan that runs: its parameters marked (the optimizer step shards them alike)."""
    _mark_parameters(example_inputs, tensors, solution, mesh.id)
    if made is not None:
        made.append((compiled, _fw_metadata()))
    return compiled


# Solves of one graph that the executable's measured peak may ask for (see _compile_auto).
_BUDGET_ROUNDS = 4
# Step 3 of _compile_auto: targets over the budget, in units of the smallest miss measured.
_EXPLORE_STEPS = (0.25, 0.5, 1.0)
_EXPLORE_ROUNDS = 3
# Plans measured per graph, in this process: (graph, inputs' fixed specs, mesh, training) ->
# {plan signature: (solution record, compiled peak, objective, estimate)}. Public: a test (or a
# long-lived process) may start it afresh.
measured_plans: dict = {}


def _measure_key(gm, user_annotations, mesh, training: bool):
    return graph_key(gm), repr(_fixed_specs(user_annotations, mesh)), repr(sorted(mesh.shape.items())), training


def _plan_signature(solution) -> str:
    """What an executable compiled from `solution` depends on: every layout it pins."""
    return repr((solution.input_specs, sorted((n.name, s) for n, s in solution.specs.items()),
                 sorted((v.name, sorted((u.name, s) for u, s in reads.items()))
                        for v, reads in solution.operand_constraints.items())))


def _step_peak(compiled, training: bool) -> float | None:
    """Peak bytes per device of a compiled graph by XLA's memory analysis (arguments, outputs
    not written in place of an argument, temporaries), plus in a training step the gradients
    and two AdamW moments of its parameters, laid out as the parameters; None for a graph
    compiled per shape (dynamic) or a runtime without the analysis."""
    spec = compiled.static
    try:
        stats = spec.exe.get_compiled_memory_stats() if spec is not None else None
    except Exception:  # noqa: BLE001  (a PJRT plugin without memory analysis)
        stats = None
    if stats is None:
        return None
    peak = executor.peak_bytes(stats)
    if training and compiled.mesh is not None:
        params = static_input_indices(len(compiled.example_inputs))
        for i, (p, ex) in enumerate(zip(compiled.plan.inputs, compiled.example_inputs)):
            if i in params and isinstance(ex, torch.Tensor):
                peak += 3 * per_device_bytes(tuple(ex.shape), p.sharding, compiled.mesh) * ex.element_size()
    return float(peak)


def _solver_services() -> dict:
    """What the solver's cache borrows from the rest of fx2xla: the disk cache's folder for
    solutions, and how process 0's solution reaches the other processes."""
    disk = executor.disk_cache()
    store = None if disk is None else DiskCache(os.path.join(disk.folder, "auto-sharding"))
    return {"store": store, "share": process_share()}


def _auto_solution(gm, example_inputs, annotations, options, training: bool, names, budget, least=False):
    """Sharding=auto: the solver's plan, the user's annotations as constraints. `least`: the
    cheapest of the plans that hold the least memory by the estimate (the budget aside), or None
    if the solver found none in its time limit."""
    mesh = options["mesh"]
    kwargs = dict(fixed=_fixed_specs(annotations, mesh), parameters=static_input_indices(len(example_inputs)),
                  training=training, ties=repeated_layers(gm, names), **_solver_services())
    if least:
        return solve_least(gm, mesh.shape, **kwargs)
    return solve_cached(gm, mesh.shape, memory_budget=budget, **kwargs)


def _mark_parameters(example_inputs, tensors, solution, mesh_id: int) -> None:
    """Parameters are marked with the solution's specs, so later graphs (the optimizer step)
    shard them alike. A mark an earlier solve left ("auto") is replaced: a later sharding="auto"
    compile of the same module (another budget, a new input shape, after torch._dynamo.reset())
    solves afresh rather than with that plan pinned."""
    if tensors is None:
        return
    for i in static_input_indices(len(example_inputs)):
        spec = solution.input_specs[i] if i < len(solution.input_specs) else None
        t = tensors[i]() if i < len(tensors) else None
        ann = annotation_of(t) if t is not None else None
        if spec is not None and t is not None and (ann is None or ann.source == "auto"):
            t._fx2xla_sharding = Annotation(mesh_id, spec, "auto")


def _refuse_sharded_islands(gm, annotations, name: str) -> None:
    if graph_mesh(gm, annotations or []) is not None:
        ops = sorted({str(node_op(n)) for n in unsupported_nodes(gm)})
        raise ShardingError(f"fx2xla: graph {name} is sharded over a mesh but has ops without a lowering rule "
                            f"({', '.join(ops)}); sharded graphs cannot run parts eagerly yet")


# Dynamo frame id (one per Python function) -> the input signatures compiled for it, so a
# forbidden recompile can say which input changed how.
_compiled_signatures: dict = {}


def _input_name(node: torch.fx.Node) -> str:
    """The user's name of a Dynamo graph input (`L['x']`, `L['self'].fc.weight`), else the node's."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    try:
        name = name() if callable(name) else name
    except Exception:  # noqa: BLE001  (a source that cannot name itself)
        name = None
    return name if isinstance(name, str) else node.name


def _check_recompile(gm, example_inputs, opts, name: str) -> None:
    """Raise RecompileError (naming what changed) if this compile is forbidden; else note it."""
    cid = torch._guards.CompileContext.current_compile_id()
    frame = getattr(cid, "frame_id", None)
    if getattr(cid, "frame_compile_id", None) == 0:
        # A frame's first compile: whatever this table holds under its id is another
        # function's (frame ids start again from 0 after torch._dynamo.reset()).
        _compiled_signatures.pop(frame, None)
    seen = _compiled_signatures.setdefault(frame, [])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    signature = tuple(InputSignature.of(_input_name(n), v) for n, v in zip(placeholders, example_inputs))
    if not compile_allowed(bool(opts["no_recompile"])):
        check_compile_allowed(f"graph {name}", bool(opts["no_recompile"]), signature_change(seen, signature))
    seen.append(signature)


def _observe_pass(graph_name: str, record, gm) -> None:
    """Each graph pass's time in metrics(), and the graph it changed in the dump folder."""
    counters.pass_seconds[record.name] = counters.pass_seconds.get(record.name, 0.0) + record.seconds
    if record.changed:
        dump.write_pass(graph_name, record.name, gm, record.notes)


def fx2xla_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, mode=None):
    """Compile a Dynamo graph for XLA. Registered as the `fx2xla` torch.compile backend."""
    opts = _check_options(options)
    # Parameters created under torch.inference_mode are inference tensors, which have no version
    # to tell a change by: imported on every call, so a weight laid out anew (channels-last,
    # [in, out]) would be copied on every call. Such graphs read their weights as torch holds them.
    opts["_steady_weights"] = not any(
        isinstance(v, torch.Tensor) and v.is_inference()
        and (isinstance(v, torch.nn.Parameter) or getattr(v, "_dynamo_static_input_type", None) is not None)
        for v in example_inputs)
    name = _graph_name("dynamo")
    if name != "dynamo":  # which torch.compile result these graphs are of: explain_sharding(compiled)
        note_compile_origin(name[: -len("dynamo")])
    _check_recompile(gm, example_inputs, opts, name)
    # Read before any pass: the real tensors behind the inputs, and the user's names of them.
    annotations = input_annotations(gm)
    if opts["sharding"] == "auto":  # an earlier solve's marks are not the user's: solved afresh
        annotations = [None if a is not None and a.source == "auto" else a for a in annotations]
    dynamo_inputs = None
    if any(annotations) or opts["sharding"] == "auto":
        refs = [weakref.ref(t) if isinstance(t, torch.Tensor) else _no_tensor for t in input_tensors(gm)]
        dynamo_inputs = (annotations, _input_names(gm), refs)
    sharded = any(annotations) or opts["sharding"] == "auto" or any(is_mark(n) for n in gm.graph.nodes)
    passed, records = run_passes(gm, example_inputs, dict(opts, _sharded_graph=sharded), name,
                                 observe=functools.partial(_observe_pass, name))
    if passed is not gm:
        try:
            compiled = _aot_compile(passed, example_inputs, opts, dynamo_inputs)
        except Exception as e:  # noqa: BLE001  a pass produced a graph we cannot compile
            if isinstance(e, (RecompileError, InvalidInputError)):  # the inputs', not the pass's
                raise
            changed = ", ".join(r.name for r in records if r.changed)
            warnings.warn(f"fx2xla: graph {name} after pass(es) {changed} failed to compile "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); compiling it "
                          f"without them. options={{{changed!r}: False}} skips them.", stacklevel=2)
        else:
            counters.scan_folds += sum(n.startswith("folded") for r in records for n in r.notes)
            return compiled
    return _aot_compile(gm, example_inputs, opts, dynamo_inputs)


def _no_tensor():
    return None


def _input_names(gm) -> list[str]:
    """The user's names of the inputs of AOTAutograd's graphs of `gm` (as input_annotations)."""
    return [n for n, _ in gm.named_parameters(remove_duplicate=False)] + \
        [n for n, _ in gm.named_buffers(remove_duplicate=False)] + \
        [_readable(_input_name(n)) for n in gm.graph.nodes if n.op == "placeholder"]


def _readable(source: str) -> str:
    """`L['self']._modules['fc']._parameters['weight']` as `fc.weight`; `L['x']` as `x`."""
    name = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", source)
    name = re.sub(r"^L\['(?:self|fn|mod|model)'\]\.", "", name)
    return re.sub(r"^L\['([^']+)'\]", r"\1", name)


def _aot_compile(gm, example_inputs, opts, dynamo_inputs=None):
    check = precompile.in_precompile
    precompiling = check()
    inference_graphs: list = []
    with precompile.without_autograd_cache() if precompiling else contextlib.nullcontext():
        compiled = _aot_autograd(gm, example_inputs, opts, inference_graphs, dynamo_inputs)
    if len(inference_graphs) == 1:
        graph, meta = inference_graphs[0]
        needs_wrappers = aot_wrappers_needed(meta, len(graph.example_inputs), len(example_inputs))
        if precompiling and not needs_wrappers:  # torch's aot_compile: a result it can save and load
            return precompile.precompiled(graph, opts)
        if not needs_wrappers:
            return graph.call_unboxed
    if precompiling and getattr(check, "certain", False):
        raise precompile.refused()
    return compiled


def _aot_autograd(gm, example_inputs, opts, inference_graphs: list, dynamo_inputs=None):
    from torch._dynamo.backends.common import aot_autograd

    sharded = dynamo_inputs is not None or any(is_mark(n) for n in gm.graph.nodes)
    # AOTAutograd's own test for an inference graph: no gradient can flow (decompositions.py
    # says why those keep attention as one op; training graphs keep the decomposition, whose
    # backward reuses the saved attention weights instead of recomputing them).
    keep_attention = opts["attention_op"] and not (
        torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs))
    return aot_autograd(
        fw_compiler=functools.partial(_compile, kind="forward", options=opts, dynamo_inputs=dynamo_inputs),
        bw_compiler=functools.partial(_compile, kind="backward", options=opts),
        inference_compiler=functools.partial(_compile, kind="inference", options=opts, made=inference_graphs,
                                             dynamo_inputs=dynamo_inputs),
        decompositions=attention_op_table() if sharded or keep_attention else decomposition_table(),
        # Inference graphs (optimizer steps, buffer updates) write their inputs themselves:
        # CompiledGraph swaps the new values' storage in where it can instead of copying.
        keep_inference_input_mutations=True,
        **partitioner_kwargs(opts["partitioner"]),
    )(gm, example_inputs)


def partitioner_kwargs(partitioner: str) -> dict:
    """aot_autograd's `partition_fn` for the forward/backward split. The min-cut partitioner
    lives in a private torch module; without it AOTAutograd's own default split is used."""
    if partitioner == "min_cut":
        try:
            from torch._functorch.partitioners import min_cut_rematerialization_partition
        except ImportError:
            return {}
        return {"partition_fn": min_cut_rematerialization_partition}
    return {}
