"""The lowering registry: one rule per ATen overload, emitting StableHLO through jax.lax/jnp.

Every rule has one signature, `rule(ctx, *args, **kwargs) -> jax value(s)`, where tensor
arguments arrive as traced jax values and everything else (ints, lists, dtypes) as in the FX
node. Type promotion and broadcasting are decided here, by the decorator, never inside rules.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..errors import describe_node_inputs, op_name, user_source_line
from .checks import INDEX, CheckRecord, out_of_range
from .dtypes import to_jax_dtype

# Python-level callables that appear in graphs on sizes (SymInt arithmetic) or tuples; they
# run directly on the concrete values the trace sees.
PYTHON_OPS = {
    operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
    operator.truediv, operator.mod, operator.pow, operator.neg, operator.eq, operator.ne,
    operator.lt, operator.le, operator.gt, operator.ge, operator.and_, operator.or_,
    operator.not_, math.ceil, math.floor, math.sqrt, math.trunc, abs, max, min, int, float,
    torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_sqrt,
}

# How a rule's tensor/scalar arguments are cast before the rule runs.
#  None          : untouched
#  "out"         : to the node's output dtype (torch's DEFAULT / INT_TO_FLOAT promotion)
#  "common"      : to torch.result_type of the arguments (comparisons: output is bool)
PROMOTIONS = (None, "out", "common")


class RejectedInput(Exception):
    """Raised by a rule for inputs eager PyTorch rejects (its message says why, in eager's
    words); the lowering turns it into fx2xla.InvalidInputError naming the op and source line."""


def complex_to_real(x, dtype):
    """Refuse to drop an imaginary part silently (jax would, with only a ComplexWarning): a
    rule that lets a complex value reach a real dtype has a bug, which must fail loudly."""
    if jnp.iscomplexobj(x) and not jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(f"complex value {x.dtype} would be cast to real {np.dtype(dtype)} "
                        "(a lowering rule bug: use lax.real/lax.abs explicitly)")


@dataclass(frozen=True)
class LoweringRule:
    fn: Callable
    promote: str | None
    broadcast: bool
    # Draws random bits: the graph then takes a per-call seed input. A callable decides per
    # node (attention draws only with dropout_p > 0).
    random: bool | Callable = False
    # For ops that carry subgraphs (scan bodies): fn(gm, node) -> the GraphModules the rule
    # lowers, so graph-wide questions (does it draw random bits?) can look inside.
    subgraphs: Callable | None = None
    # Reads the values of earlier nodes (ctx.values): peephole rules looking through their
    # arguments' producers.
    reads_values: bool = False
    # Which nodes of the op the rule lowers, where that depends on the node: a higher-order op
    # such as with_effects wraps many ops, of which the rule lowers some. The others fall back
    # (or raise UnsupportedOpError under fallback="error") as an op with no rule does.
    accepts: Callable | None = None

    def draws(self, node) -> bool:
        """Whether this rule draws random bits for `node`."""
        return bool(self.random(node)) if callable(self.random) else self.random

    def lowers(self, node) -> bool:
        """Whether this rule lowers `node` (every node of its ops, unless `accepts` says)."""
        return self.accepts is None or bool(self.accepts(node))


LOWERINGS: dict[torch._ops.OpOverload, LoweringRule] = {}
# Rules for one platform only ("cuda", "cpu", ...), tried before the generic ones, as JAX's
# `mlir.register_lowering(..., platform=)`: e.g. cuDNN's fused attention on CUDA.
PLATFORM_LOWERINGS: dict[tuple, LoweringRule] = {}
# Rules for ops that only exist once some torch module defines them (e.g. "prims.fma.default").
LOWERINGS_BY_NAME: dict[str, LoweringRule] = {}


def _overloads(op) -> list:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def register_lowering(*ops, promote: str | None = None, broadcast: bool = False, random: bool | Callable = False,
                     subgraphs: Callable | None = None, platform: str | None = None, reads_values: bool = False,
                     accepts: Callable | None = None):
    """Register `fn` as the lowering of `ops` (overloads, or packets = all their overloads).

    promote: see PROMOTIONS. broadcast: tensor and scalar arguments are broadcast to the
    output shape (after promotion), so rules may use lax ops directly. random: the rule calls
    `ctx.rng_key()`; graphs containing it take a fresh seed from torch's generator per call
    (a callable `random(node) -> bool`: only for the nodes it says draw). reads_values: the rule
    reads earlier nodes' values (`ctx.values`), as rules with subgraphs do. accepts: a callable
    `accepts(node) -> bool` naming the nodes of `ops` the rule lowers (default: all of them).
    """
    assert promote in PROMOTIONS, promote

    def deco(fn):
        rule = LoweringRule(fn, promote, broadcast, random, subgraphs, reads_values, accepts)
        for op in ops:
            if platform is not None:
                for ov in _overloads(op):
                    PLATFORM_LOWERINGS[(ov, platform)] = rule
                continue
            if isinstance(op, str):
                LOWERINGS_BY_NAME[op] = rule
                continue
            for ov in _overloads(op):
                LOWERINGS[ov] = rule
        return fn

    return deco


_platform: contextvars.ContextVar = contextvars.ContextVar("fx2xla_lowering_platform", default="cpu")
_spmd: contextvars.ContextVar = contextvars.ContextVar("fx2xla_lowering_spmd", default=False)


def current_platform() -> str:
    """The platform the module being traced is lowered for (set by lower_graph)."""
    return _platform.get()


def lowering_spmd() -> bool:
    """Whether the module being traced is partitioned over a mesh (set by lower_graph)."""
    return _spmd.get()


@contextlib.contextmanager
def lowering_platform(platform: str, spmd: bool = False):
    """Lower for `platform` inside this block (per thread: each trace has its own); `spmd`: for
    a program XLA partitions over a mesh."""
    token, spmd_token = _platform.set(platform), _spmd.set(spmd)
    try:
        yield
    finally:
        _platform.reset(token)
        _spmd.reset(spmd_token)


def lowering_for(op, platform: str | None = None) -> LoweringRule | None:
    """The rule for `op`: `platform`'s own if it has one, else the generic one."""
    if platform is not None and PLATFORM_LOWERINGS:
        rule = PLATFORM_LOWERINGS.get((op, platform))
        if rule is not None:
            return rule
    rule = LOWERINGS.get(op)
    if rule is None and LOWERINGS_BY_NAME:
        rule = LOWERINGS_BY_NAME.get(str(op))
    if rule is None:
        rule = _view_copy_rule(op)
    return rule


def data_dependent(node) -> bool:
    """Whether the node's result has a size or value known only once its inputs' data is (an
    unbacked symbol: `x[mask]`, `nonzero`, `x.item()` under Dynamo's
    capture_dynamic_output_shape_ops / capture_scalar_outputs). An executable's result shapes are
    fixed when it is compiled, so such a node runs eagerly (partition.py), and what it feeds
    specializes on the sizes it produced."""
    val = node.meta.get("val")
    return val is not None and bool(free_unbacked_symbols(val))


def lowering_for_node(node, platform: str | None = None) -> LoweringRule | None:
    """The rule that lowers `node`, or None where its op has no rule or its rule refuses it."""
    rule = lowering_for(node.target, platform)
    return rule if rule is not None and rule.lowers(node) else None


def _view_copy_rule(op) -> LoweringRule | None:
    """The `*_copy` twin of a view op (permute_copy, view_copy, ...; functionalized subgraph
    bodies use them) computes the view's values: it shares the view's rule."""
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.view_copy not in op.tags:
        return None
    name = op.__name__.split(".")[0]
    if op.namespace != "aten" or not name.endswith("_copy"):
        return None
    try:
        view = getattr(getattr(torch.ops.aten, name[: -len("_copy")]), op._overloadname)
    except (AttributeError, RuntimeError):
        return None
    return LOWERINGS.get(view)


@dataclass(frozen=True)
class LoweringContext:
    """What a rule may know about the node it lowers."""

    node: torch.fx.Node

    @property
    def out(self) -> Any:
        """The node's meta value (FakeTensor, tuple of them, or SymInt)."""
        return self.node.meta.get("val")

    @property
    def platform(self) -> str:
        """The platform the module is lowered for ("cpu", "cuda", ...)."""
        return current_platform()

    @property
    def spmd(self) -> bool:
        """Whether the module is partitioned over a mesh (XLA's partitioner then has to see
        every op it splits: no custom calls it cannot shard)."""
        return lowering_spmd()

    @property
    def out_dtype(self) -> np.dtype:
        """The jax dtype of the (first) output."""
        v = self.out
        if isinstance(v, (tuple, list)):
            v = v[0]
        return to_jax_dtype(v.dtype)

    @property
    def out_shape(self) -> tuple[int, ...]:
        v = self.out
        if isinstance(v, (tuple, list)):
            v = v[0]
        shape = concrete_shape(v.shape, self.sizes)
        return (shape[0], shape[2], shape[3], shape[1]) if self.channels_last and len(shape) == 4 else shape

    def arg_meta(self, i: int):
        """The meta value of positional argument `i` (FakeTensor), or the literal argument."""
        a = self.node.args[i]
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    # Set by lower_graph: maps a symbolic size expression to its concrete value.
    sizes: Any = None
    # Set by lower_graph for random rules: the call's seed (traced int64) and the node's index.
    seed: Any = None
    index: int = 0
    gm: Any = None  # the GraphModule holding the node (rules with subgraphs read them from it)
    values: Any = None  # node -> traced value of the nodes lowered so far (peephole rules)
    # The run-time checks of the computation being traced (checks.RuntimeChecks), or None
    # when checks are off (options={"check_indices": False}).
    checks: Any = None
    # The node is lowered on channels-last values (channels_last.py): its 4-D operands and
    # results are NHWC, and out_shape says so.
    channels_last: bool = False
    # A matmul the plan computes with its weight as the dot's left operand (GraphPlan.weight_lhs).
    weight_lhs: bool = False
    # A matmul the plan sends to the kernel library's few-row matmul (GraphPlan.few_rows); where
    # the module may not call the library, it is computed as a weight_lhs one.
    few_rows: bool = False
    # A bf16/float16 matmul whose weight the plan imports as a float32 copy (InputKind.WIDENED):
    # that copy, which the rule multiplies instead of the weight (None for other nodes).
    wide_weight: Any = None

    def check_index(self, index, size: int, *, negative: bool, dim: int | None = None,
                    what: str = "index") -> None:
        """Record a run-time check that every element of `index` lies in [0, size), or in
        [-size, size) when `negative` (torch wraps negative indices there). A failure raises
        fx2xla.IndexOutOfRangeError when the graph runs, as eager raises for that input."""
        if self.checks is None:
            return
        low = -int(size) if negative else 0
        failed = out_of_range(index, low, int(size))
        if failed is not None:
            where = f" for dimension {dim} of size {size}" if dim is not None else f" (size {size})"
            self.check(failed, f"{what} out of range: every {what} must lie in [{low}, {size}){where}")

    def check(self, failed, message: str, *, error: str = INDEX) -> None:
        """Record a run-time check: `failed` (a traced boolean scalar) True raises, with
        `message`, the op, its inputs and the source line, fx2xla.IndexOutOfRangeError (`error`
        "index"), fx2xla.LinAlgError ("linalg") or fx2xla.InvalidValueError ("value")."""
        if self.checks is None:
            return
        text = (f"fx2xla: {op_name(self.node)}: {message}\n  inputs: {describe_node_inputs(self.node)}\n"
                f"  at {user_source_line(self.node)}\n"
                "  (eager PyTorch rejects this input too; options={'check_indices': False} skips the check)")
        self.checks.add(CheckRecord(text, error), failed)

    def rng_key(self):
        """A PRNG key for this node: the per-call seed (drawn from torch's default generator,
        so `torch.manual_seed` makes runs repeatable) folded with the node's position, so
        each random op in the graph draws independent bits."""
        import jax

        if self.seed is None:
            raise RuntimeError(f"{self.node.target}: its rule must be registered with random=True")
        return jax.random.fold_in(base_key(self.seed), self.index)


def base_key(seed):
    """The PRNG key of a graph: `seed` is the per-call int64 seed, or already a key (loop bodies
    fold the iteration into their parent's key). jax's "rbg" generator: XLA's RngBitGenerator,
    which compiles several times faster than threefry's unrolled hash rounds; on the CPU with its
    ThreeFry algorithm (`cpu_bits_impl`)."""
    import jax

    if jax.dtypes.issubdtype(getattr(seed, "dtype", None), jax.dtypes.prng_key):
        return seed
    return jax.random.key(seed, impl=cpu_bits_impl() if current_platform() == "cpu" else "rbg")


@functools.cache
def cpu_bits_impl():
    """jax's "rbg" key handling (seeding, splitting, folding) with its bits drawn by XLA's
    RngBitGenerator as ThreeFry instead of the platform's default, which on XLA:CPU is Philox:
    a dropout mask of 4 x 4 x 128 x 128 took 0.94 ms against 3.94 ms (docs/benchmarks.md,
    "Random bits on the CPU")."""
    import jax.numpy as jnp
    from jax import lax
    from jax.extend import random as jax_random

    rbg = jax_random.rbg_prng_impl
    widths = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}

    def bits(key, bit_width, shape):
        return lax.rng_bit_generator(key, shape, dtype=widths[bit_width], algorithm=lax.RandomAlgorithm.RNG_THREE_FRY)[1]

    return jax_random.define_prng_impl(key_shape=rbg.key_shape, seed=rbg.seed, split=rbg.split, random_bits=bits,
                                       fold_in=rbg.fold_in, name="fx2xla_cpu_threefry_bits", tag="fx2xla")


def concrete_shape(shape, sizes=None) -> tuple[int, ...]:
    out = []
    for s in shape:
        if isinstance(s, torch.SymInt):
            s = sizes(s) if sizes is not None else int(s)
        out.append(int(s))
    return tuple(out)


def is_array(x) -> bool:
    return isinstance(x, (jnp.ndarray, np.ndarray)) or hasattr(x, "aval")


def _promotion_operand(v):
    """A stand-in for an argument that keeps its category in torch's promotion rules
    (dimensioned tensor > 0-d tensor > Python scalar)."""
    if isinstance(v, torch.Tensor):
        return torch.empty((1,) if v.dim() > 0 else (), dtype=v.dtype, device="meta")
    if isinstance(v, torch.SymBool):
        return True
    if isinstance(v, torch.SymInt):
        return 1
    if isinstance(v, torch.SymFloat):
        return 1.0
    return v


def _scalar_of(dtype: torch.dtype):
    if dtype == torch.bool:
        return True
    if dtype.is_complex:
        return 1j
    return 1.0 if dtype.is_floating_point else 1


def _common_dtype(ctx: LoweringContext) -> np.dtype:
    """torch.result_type over all tensor and scalar arguments of the node."""
    ops = []
    for a in list(ctx.node.args) + list(ctx.node.kwargs.values()):
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else a
        if isinstance(v, (torch.Tensor, bool, int, float, complex, torch.SymInt, torch.SymFloat, torch.SymBool)):
            ops.append(_promotion_operand(v))
    if not ops:
        return ctx.out_dtype
    acc = ops[0]
    for b in ops[1:]:
        dtype = torch.result_type(acc, b)
        tensors = [x for x in (acc, b) if isinstance(x, torch.Tensor)]
        if any(t.dim() > 0 for t in tensors):
            acc = torch.empty((1,), dtype=dtype, device="meta")
        elif tensors:
            acc = torch.empty((), dtype=dtype, device="meta")
        else:
            acc = _scalar_of(dtype)
    dtype = acc.dtype if isinstance(acc, torch.Tensor) else torch.tensor(acc).dtype
    return to_jax_dtype(dtype)


def _cast(x, dtype):
    if is_array(x):
        complex_to_real(x, dtype)
        return x if x.dtype == dtype else lax.convert_element_type(x, dtype)
    if isinstance(x, (bool, int)) and jnp.issubdtype(dtype, jnp.integer):
        # C-style wrap like torch (u8 > -1 compares with 255), not numpy's OverflowError
        return lax.convert_element_type(jnp.asarray(x, jnp.int64), dtype)
    if isinstance(x, (bool, int, float, complex)):
        return jnp.asarray(x, dtype=dtype)
    return x


def prepare_args(rule: LoweringRule, ctx: LoweringContext, args: list, kwargs: dict):
    """Apply the rule's promotion and broadcasting to the arguments."""
    if rule.promote is None and not rule.broadcast:
        return args, kwargs
    if rule.promote == "out":
        dtype = ctx.out_dtype
    elif rule.promote == "common":
        dtype = _common_dtype(ctx)
    else:
        dtype = None
    if dtype is not None:
        args = [_cast(a, dtype) for a in args]
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
    if rule.broadcast:
        shape = ctx.out_shape
        args = [jnp.broadcast_to(a, shape) if is_array(a) and a.shape != shape else a for a in args]
    return args, kwargs


def graph_uses_randomness(gm: torch.fx.GraphModule) -> bool:
    """Whether any node of `gm` (or of a subgraph a rule lowers, e.g. a scan body) is random."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target in PYTHON_OPS:
            continue
        rule = lowering_for(n.target)
        if rule is not None and (rule.draws(n) or (rule.subgraphs is not None and any(
                graph_uses_randomness(sub) for sub in rule.subgraphs(gm, n)))):
            return True
    return False
