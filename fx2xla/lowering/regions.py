"""Elementwise regions: float32 elementwise ops of one shape that write several results, run in
one pass by the kernel library's `fx2xla_elementwise` (CPU, one device).

An optimizer's update of one parameter reads the parameter, its gradient and its moments and
writes the parameter and the moments. XLA:CPU fuses elementwise ops into loops of one result
each: AdamW's update becomes three loops, which read the gradient and the moments again, 10
passes over the parameter's size where one loop needs 7 (docs/benchmarks.md, "Optimizer updates
in one pass").

A region is a connected set of such ops of at least MIN_ELEMENTS elements each (0-d tensors and
Python numbers enter as scalars), whose results only leave the graph: returned, or written back
into a graph input. It has two results or more (with one, XLA's loop is one pass already). The
plan holds the regions (GraphPlan.regions). Lowering writes each region as one C++ loop over its
elements, every value of an element in registers, each op rounding to float32 as XLA's own loop
does (`fma` as a product and a sum, as lowering/elementwise.py lowers it; no fast-math), and
compiles it for this CPU (torch_kernels.region_loop); the handler runs it on slices of the
elements across XLA's threads. Where the library may not run (a package's portable module, the
library off or not built) or no compiler does, the region's ops are lowered one by one instead,
at the place of its last op.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx

aten = torch.ops.aten

# Smallest region (elements per value) worth a custom call: below it, XLA's loops read their
# inputs from cache, and a call costs more than the passes it saves.
MIN_ELEMENTS = 1 << 16

# The ops a region runs, and each one's C++ over its operands' names. ADD_SCALED is add/sub with
# alpha: torch's kernel computes a + alpha * b with one rounding (an fma), alpha rounded to float32
# first (negated for sub).
COPY, ADD, SUB, MUL, DIV, NEG, SQRT, RECIPROCAL, ABS, FMA, WHERE, ADD_SCALED = range(12)
_CXX = {COPY: "{0}", ADD: "{0} + {1}", SUB: "{0} - {1}", MUL: "{0} * {1}", DIV: "{0} / {1}", NEG: "-{0}",
        SQRT: "__builtin_sqrtf({0})", RECIPROCAL: "1.0f / {0}", ABS: "__builtin_fabsf({0})",
        FMA: "{0} * {1} + {2}", WHERE: "{0} != 0.0f ? {1} : {2}", ADD_SCALED: "__builtin_fmaf({1}, {2}, {0})"}

_BINARY = {aten.add.Tensor: ADD, aten.add.Scalar: ADD, aten.sub.Tensor: SUB, aten.sub.Scalar: SUB,
           aten.mul.Tensor: MUL, aten.mul.Scalar: MUL, aten.div.Tensor: DIV, aten.div.Scalar: DIV}
_UNARY = {aten.neg.default: NEG, aten.sqrt.default: SQRT, aten.reciprocal.default: RECIPROCAL,
          aten.abs.default: ABS, aten.clone.default: COPY}
# 0-d tensors a region reads as scalars (converted to float32 in XLA, as torch's kernels convert
# a 0-d operand to the float32 they compute in); where's 0-d condition is bool.
_SCALAR_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32)


@dataclass(frozen=True, eq=False)
class Region:
    """One region: `nodes` in graph order; `vectors`, the nodes of its inputs of the region's
    shape, and `scalars`, those of its 0-d inputs, in argument order; `outputs`, the nodes whose
    values leave it; `source`, its loop in C++; `constants`, the float32 values of the numbers its
    ops take (arguments of the loop, so that one loop serves every learning rate); `aliases`:
    (input, output) pairs whose buffer is one (a donated input's update, set by the plan)."""

    nodes: tuple
    shape: tuple
    vectors: tuple
    scalars: tuple
    outputs: tuple
    source: str
    constants: tuple
    aliases: tuple = field(default=())

    @property
    def last(self):
        return self.nodes[-1]


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _static_f32(val) -> tuple | None:
    if not isinstance(val, torch.Tensor) or val.dtype != torch.float32:
        return None
    if any(isinstance(s, torch.SymInt) for s in val.shape):
        return None
    return tuple(int(s) for s in val.shape)


def _op(node) -> tuple[int, list] | None:
    """The op `node` computes and its operands, in the op's order ([cond, a, b] for where; alpha
    last for add/sub with alpha), or None where it is not an op a region runs (another op, or
    arguments the loop has no code for)."""
    t, args, kwargs = node.target, node.args, node.kwargs
    if t in _BINARY:
        alpha, code = kwargs.get("alpha", 1), _BINARY[t]
        if len(args) != 2 or set(kwargs) - {"alpha"} or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            return None
        if alpha == 1:
            return code, list(args)
        return (ADD_SCALED, [*args, -alpha if code == SUB else alpha]) if code in (ADD, SUB) else None
    if t in _UNARY:
        return (_UNARY[t], list(args)) if len(args) == 1 and not set(kwargs) - {"memory_format"} else None
    if t is aten.where.self:
        return (WHERE, list(args)) if len(args) == 3 and not kwargs else None
    if t is aten.copy.default:  # the second argument, in the first's shape and dtype
        return (COPY, [args[1]]) if len(args) == 2 and not kwargs.get("non_blocking", False) else None
    if t is aten.full_like.default:  # a number in the first argument's shape (foreach AdamW's lerp weight)
        return (COPY, [args[1]]) if len(args) == 2 and not isinstance(args[1], torch.fx.Node) else None
    if str(t) == "prims.fma.default":
        return (FMA, list(args)) if len(args) == 3 and not kwargs else None
    return None


def _member(node, min_elements: int) -> bool:
    """`node` may be in a region: an op the handler runs, a float32 result of a static shape of
    `min_elements` or more, every operand a float32 value of that shape, a 0-d tensor or a
    number (where's condition: a 0-d one)."""
    if node.op != "call_function":
        return False
    shape = _static_f32(_val(node))
    if shape is None or int(np.prod(shape)) < min_elements:
        return False
    op = _op(node)
    if op is None:
        return False
    operands = op[1]
    if node.target is aten.copy.default and _static_f32(_val(node.args[0])) != shape:
        return False
    for k, a in enumerate(operands):
        if isinstance(a, bool) or not isinstance(a, (int, float, torch.fx.Node)):
            return False
        if not isinstance(a, torch.fx.Node):
            continue
        if a.op == "get_attr":
            return False
        v = _val(a)
        if not isinstance(v, torch.Tensor):
            return False
        if node.target is aten.where.self and k == 0:
            if v.dim() != 0 or v.dtype != torch.bool:
                return False
        elif v.dim() == 0:
            if v.dtype not in _SCALAR_DTYPES:
                return False
        elif _static_f32(v) != shape:
            return False
    return True


def _leaves_graph(user, value) -> bool:
    """`user` of a region's `value` takes it out of the graph: the output, or a write-back of it
    into a graph input (AOTAutograd's copy_ of a mutated input)."""
    if user.op == "output":
        return True
    return (user.op == "call_function" and user.target is aten.copy_.default and len(user.args) == 2
            and isinstance(user.args[0], torch.fx.Node) and user.args[0].op == "placeholder"
            and user.args[1] is value and _static_f32(_val(user.args[0])) == _static_f32(_val(value)))


def find_regions(gm: torch.fx.GraphModule, exclude=frozenset(), min_elements: int = MIN_ELEMENTS) -> tuple:
    """The regions of `gm` (a CPU graph on one device): connected members (not in `exclude`)
    whose values leaving the region all leave the graph, two or more of them."""
    nodes = list(gm.graph.nodes)
    members = [n for n in nodes if n not in exclude and _member(n, min_elements)]
    inside = set(members)
    parent = {n: n for n in members}

    def root(n):
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in members:
        for a in n.all_input_nodes:
            if a in inside:
                parent[root(a)] = root(n)
    groups: dict = {}
    for n in members:
        groups.setdefault(root(n), []).append(n)
    regions = []
    for group in groups.values():
        members_set = set(group)
        outputs = [n for n in group if any(u not in members_set for u in n.users)]
        if len(outputs) < 2:
            continue
        if not all(_leaves_graph(u, n) for n in outputs for u in n.users if u not in members_set):
            continue
        regions.append(_compile(group, outputs))
    return tuple(regions)


def _compile(group: list, outputs: list) -> Region:
    """The region's loop: `fx2xla_region(in, s, out, lo, hi)` computes elements [lo, hi), reading
    the inputs `in`, the scalar inputs' values and then the constants `s`, writing `out`. Every
    value is a float32 local; a result is stored after all of the element's inputs are read (the
    handler may pass a result's buffer as an input's too)."""
    members = set(group)
    ops = {n: _op(n) for n in group}
    vectors, scalars, constants = [], [], []
    for n in group:
        for a in ops[n][1]:
            if isinstance(a, torch.fx.Node) and a not in members:
                (scalars if _val(a).dim() == 0 else vectors).append(a)
            elif not isinstance(a, torch.fx.Node):
                constants.append(_bits(a))
    vectors = list(dict.fromkeys(vectors))
    scalars = list(dict.fromkeys(scalars))
    constants = list(dict.fromkeys(constants))  # float32 bit patterns (NaN included)
    name = {a: f"x{i}" for i, a in enumerate(vectors)}
    name.update({a: f"s{i}" for i, a in enumerate(scalars)})
    lines = [f"  const float* x{i}p = in[{i}];" for i in range(len(vectors))]
    lines += [f"  float* o{j}p = out[{j}];" for j in range(len(outputs))]
    lines += [f"  const float s{i} = s[{i}];" for i in range(len(scalars))]
    lines += [f"  const float c{k} = s[{len(scalars) + k}];" for k in range(len(constants))]
    lines += ["#pragma omp simd", "  for (int64_t i = lo; i < hi; ++i) {"]
    lines += [f"    const float x{i} = x{i}p[i];" for i in range(len(vectors))]
    for k, n in enumerate(group):
        code, operands = ops[n]
        args = [name[a] if isinstance(a, torch.fx.Node) else f"c{constants.index(_bits(a))}" for a in operands]
        name[n] = f"t{k}"
        lines.append(f"    const float t{k} = {_CXX[code].format(*args)};")
    lines += [f"    o{j}p[i] = {name[n]};" for j, n in enumerate(outputs)]
    lines += ["  }", "}"]
    source = ("#include <cstdint>\n"
              'extern "C" void fx2xla_region(const float* const* in, const float* s, float* const* out,'
              " int64_t lo, int64_t hi) {\n" + "\n".join(lines) + "\n")
    values = tuple(float(np.frombuffer(b, np.float32)[0]) for b in constants)
    return Region(tuple(group), _static_f32(_val(group[0])), tuple(vectors), tuple(scalars), tuple(outputs),
                  source, values)


def _bits(number) -> bytes:
    """A Python number as the float32 the loop computes with (torch's kernels convert a number
    operand of a float32 op so)."""
    return np.float32(number).tobytes()


def with_aliases(region: Region, donated_writes: dict) -> Region:
    """`region` with its written inputs aliased to their updates: `donated_writes` maps a donated
    placeholder to the node its new contents come from."""
    pairs = tuple((i, region.outputs.index(donated_writes[v])) for i, v in enumerate(region.vectors)
                  if v in donated_writes and donated_writes[v] in region.outputs)
    return dataclasses.replace(region, aliases=pairs) if pairs else region


def lower(region: Region, env: dict) -> list | None:
    """The region's output values, computed by the kernel library's handler from the traced
    values in `env`; None where the module may not call it or the loop does not compile (lowering
    then runs the region's ops one by one)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from .. import torch_kernels
    from .registry import current_platform, lowering_spmd

    if current_platform() != "cpu" or lowering_spmd() or not torch_kernels.available("elementwise"):
        return None
    try:
        path = torch_kernels.region_loop(region.source)
    except RuntimeError as e:
        _warn(str(e))
        return None
    vectors = [jnp.asarray(env[v]) for v in region.vectors]
    scalars = [lax.convert_element_type(jnp.asarray(env[s]), jnp.float32) for s in region.scalars]
    results = [jax.ShapeDtypeStruct(region.shape, jnp.float32)] * len(region.outputs)
    return list(jax.ffi.ffi_call("fx2xla_elementwise", results, vmap_method="sequential",
                                 input_output_aliases=dict(region.aliases) or None)(
        *vectors, *scalars, kernel=str(path), constants=np.asarray(region.constants, np.float32),
        vectors=np.int64(len(vectors))))


def _warn(message: str) -> None:
    """Python's warning filters show it once per message by default (a region per parameter
    would repeat it)."""
    import warnings

    warnings.warn(f"fx2xla: an elementwise region runs as XLA's loops: {message}", RuntimeWarning, stacklevel=3)
