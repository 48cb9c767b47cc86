"""Lowering rules: linalg (mm, addmm, bmm).

Every matmul is one `lax.dot_general`. nn.Linear arrives as `addmm(b, x, permute(W, [1, 0]))`
(and its backward as mm's of permuted operands). An operand whose torch strides say it is a
transposed row-major buffer is contracted through: the rule transposes the value back (XLA
cancels the transpose pair) and contracts the buffer along its other dimension. XLA folds a
lone transpose into a float32 dot by itself, but for bf16 on CPU it instead upcasts a
transposed copy of the weight to float32 on every call; see
tests/frontend/test_linalg.py::test_linear_weight_transpose_is_folded.

bf16/f16 matmuls accumulate in float32 on every platform, as torch's do; the platform decides
only the dtype the dot hands back (`dot_result_dtype`):
- GPUs: the operand dtype. cuBLAS/cuBLASLt and XLA's Triton GEMMs accumulate in float32
  inside the kernel and round once as they write the half-precision result, as torch's CUDA
  GEMMs do. A float32 dot result would instead be written out in float32 and rounded by a
  separate convert kernel (256 µs a call on an H100 for a [4096, 32000] bf16 logits GEMM).
- CPU: float32, rounded to torch's dtype after the rule (lower_graph casts every result).
  XLA:CPU has no half-precision GEMM: it converts the operands to float32 and the product
  back whatever the dot asks for, so a half result would save nothing there, and a float32
  one lets addmm add its bias before the single rounding, as torch's CPU kernels do.
"""
from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from torch.ops import aten

from .dtypes import dtype_name
from .registry import RejectedInput, concrete_shape, current_platform, register_lowering

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def accumulation_dtype(dtype):
    """The dtype torch accumulates a matmul/conv of `dtype` in: float32 for bf16/f16."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) in _HALF else jnp.dtype(dtype)


def dot_result_dtype(dtype):
    """The dtype a matmul/conv of `dtype` operands returns on the platform being lowered for:
    the operand dtype on GPUs, whose GEMMs accumulate bf16/f16 in float32 and round once as
    they write; the accumulation dtype on the CPU (see the module doc)."""
    if jnp.dtype(dtype) in _HALF and current_platform() != "cpu":
        return jnp.dtype(dtype)
    return accumulation_dtype(dtype)


def matmul_precision(dtype):
    """The dot precision torch would use for `dtype` on the platform being lowered for. CPU:
    HIGHEST (XLA:CPU computes float32 dots in float32 whatever it says). GPUs: float32 follows
    `torch.get_float32_matmul_precision()` as Inductor and cuBLAS do ("highest": float32;
    "high"/"medium": TF32 or bf16 passes, XLA's DEFAULT); bf16/f16 dots use the tensor cores at
    DEFAULT (HIGHEST would make XLA upcast them to float32 GEMMs). Read when a graph is
    lowered: a later change of torch's setting applies to graphs compiled after it."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    if current_platform() == "cpu":
        return lax.Precision.HIGHEST
    if jnp.dtype(dtype) in _HALF:
        return lax.Precision.DEFAULT
    import torch

    return lax.Precision.HIGHEST if torch.get_float32_matmul_precision() == "highest" else lax.Precision.DEFAULT


def dot(a, b, contract, batch=((), ())):
    """dot_general accumulating like torch; the result is in `dot_result_dtype(a.dtype)`:
    float32 for half operands on the CPU, the operands' own dtype on GPUs. Callers that go on
    computing in opmath pass float32 operands (`_opmath`), which every platform keeps."""
    return lax.dot_general(a, b, (contract, batch), precision=matmul_precision(a.dtype),
                           preferred_element_type=dot_result_dtype(a.dtype))


def _scaled(x, s):
    """x * s, skipping the multiply for s == 1 (torch's alpha/beta are Python scalars)."""
    return x if s == 1 else x * jnp.asarray(s, x.dtype)


def is_transposed(ctx, i: int) -> bool:
    """Whether node arg `i` is, in torch's layout (which the lowering's transposes mirror), a
    row-major buffer with its last two dims swapped: a permuted weight, a saved `W.t()`, ..."""
    meta = ctx.arg_meta(i)
    shape, stride = concrete_shape(meta.shape, ctx.sizes), concrete_shape(meta.stride(), ctx.sizes)
    if len(shape) < 2 or shape[-1] == 1 or shape[-2] == 1:
        return False
    swap = list(range(len(shape) - 2)) + [len(shape) - 1, len(shape) - 2]
    expected = 1
    for d in reversed(swap):  # is the tensor dense row-major in the swapped order?
        if shape[d] != 1 and stride[d] != expected:
            return False
        expected *= shape[d]
    return True


def _same_dtypes(ctx, *positions) -> None:
    """Eager's CPU and CUDA matmul kernels refuse operands of different dtypes (an int64 input
    into a float32 Linear); torch's fake kernels for mm/addmm do not check, so the rule does."""
    dtypes = [ctx.arg_meta(i).dtype for i in positions]
    if len(set(dtypes)) > 1:
        raise RejectedInput("expected m1 and m2 to have the same dtype, but got: "
                            + " != ".join(dtype_name(d) for d in dtypes))


def _matmul(ctx, a, b, lhs: int, rhs: int):
    """a @ b over the last two dims (leading dims batched); args `lhs`/`rhs` of the node."""
    _same_dtypes(ctx, lhs, rhs)
    n = a.ndim
    if n == 2 and (out := _stacked_matmul(ctx, a, lhs, rhs)) is not None:
        return out
    ca, cb = n - 1, n - 2
    if is_transposed(ctx, lhs):  # a = X^T: contract X's row dim instead
        a, ca = jnp.swapaxes(a, -1, -2), n - 2
    if is_transposed(ctx, rhs):  # b = W^T: contract W's column dim instead
        b, cb = jnp.swapaxes(b, -1, -2), n - 1
        if ctx.few_rows and n == 2 and ca == 1 and (out := _few_rows(ctx, a, b)) is not None:
            return out
        if (ctx.weight_lhs or ctx.few_rows) and n == 2 and ca == 1:
            return _weight_on_the_left(a, b)
    if ctx.wide_weight is not None and n == 2:  # the weight's float32 copy: x widened, exactly
        wide = ctx.wide_weight
        if wide.shape != b.shape:  # b is the weight's transpose, not swapped back above (a dim of size 1)
            wide = wide.T
        return dot(a.astype(jnp.float32), wide, ((ca,), (cb,)))
    if n == 2 and (out := _torch_matmul(ctx, a, b, ca, cb)) is not None:
        return out
    batch = tuple(range(n - 2))
    return dot(a, b, ((ca,), (cb,)), (batch, batch))


# float32 and float64 matmuls of at least TORCH_MATMUL_MACS multiply-adds in CPU training graphs
# run torch's own gemm (MKL's on x86, the one eager and Inductor call) inside the executable,
# through the kernel library's `fx2xla_torch_matmul`, where it is built and the option
# torch_kernels allows "matmul". On an Ice Lake, XLA:CPU's dots of an MLP training step's shapes
# (32 x 1024 . 1024 x 4096, and the backward's transposed products) took 1.7-2.2x its time, and
# the whole step 0.82x the time with them (docs/benchmarks.md, "torch's matmuls in training
# graphs"). Inference graphs keep XLA's dots (torch_kernels.TRAINING_ONLY): at 512 rows
# BERT and LLaMA 4L took 1.19x and 1.13x the time with torch's, GPT-2 0.90x. Smaller products
# stay XLA's, which fuses them with their neighbours, and so do the forward's matmuls of 4-64 rows
# against a transposed weight, computed with the weight on the dot's left (WEIGHT_LHS_ROWS).
TORCH_MATMUL_MACS = 1 << 22


def _torch_matmul(ctx, a, b, ca: int, cb: int):
    """a . b contracting a's dim `ca` with b's dim `cb` (2-D) in the kernel library's torch
    matmul, or None where it does not apply (another platform, a mesh, another dtype, a small
    product, the library off or not built, a package's portable module)."""
    from .. import torch_kernels

    if (current_platform() != "cpu" or ctx.spmd or a.dtype != b.dtype
            or a.dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))):
        return None
    m, k = a.shape[1 - ca], a.shape[ca]
    n = b.shape[1 - cb]
    if m * n * k < TORCH_MATMUL_MACS or not torch_kernels.available("matmul"):
        return None
    out = jax.ShapeDtypeStruct((m, n), a.dtype)
    return jax.ffi.ffi_call("fx2xla_torch_matmul", out, vmap_method="sequential")(
        a, b, transpose_a=np.int64(ca == 0), transpose_b=np.int64(cb == 1))


# One layer's weight in a folded loop's body (lowering/control_flow.py: _scan) is a slice of the
# stacked weights, and XLA:CPU's dot reads no dynamic slice in place: each iteration copied its
# layer's weights out of the stacks, which left a folded GPT-2 1.1-1.3x slower than unrolled at
# batch 1 x 128 on the CPU (docs/benchmarks.md, "Folded layers' weights read in place"). A
# matmul of the body whose right operand is a stacked input (directly, or through one 2-D
# transpose: nn.Linear's) runs torch's gemm on that slice where it lies in the stack
# (`fx2xla_torch_matmul_indexed`, option torch_kernels kind "stacked_matmul"), from
# STACKED_MATMUL_MACS multiply-adds on. Smaller ones
# (a LLaMA's q/k/v/o projections at 128 rows: 4-8 M) still copy their slice for XLA's dot, which
# fused with its neighbours was faster there: with every product of 4 M or more in torch's gemm
# a folded 12-layer LLaMA took 1.12x the unrolled time, against 1.04 with this threshold (GPT-2:
# 0.93 either way; docs/benchmarks.md). _scan sets STACKED to {body placeholder: (stack,
# iteration index)} while it traces the body.
STACKED: contextvars.ContextVar = contextvars.ContextVar("fx2xla_stacked_weights", default=None)
STACKED_MATMUL_MACS = 1 << 24


def _swaps_2d_or_copy(node) -> bool:
    """swaps_2d, or its functional copy (permute_copy [1, 0], t_copy, transpose_copy), which a
    loop body traced by AOTAutograd holds instead of the view."""
    if node.op == "call_function" and node.target in _TRANSPOSE_COPIES:
        if node.target is aten.permute_copy.default:
            return list(node.args[1]) == [1, 0]
        if node.target is aten.transpose_copy.int:
            return {d % 2 for d in node.args[1:3]} == {0, 1}
        return True
    return swaps_2d(node)


def _reads_as_weight(reader, operand) -> bool:
    rhs, _ = _LINEAR_OPERANDS.get(reader.target, (None, None))
    return rhs is not None and reader.args[rhs] is operand and operand not in reader.args[:rhs]


def stacked_matmul_reads(placeholders) -> frozenset:
    """The placeholders (a scan body's per-iteration inputs) that some matmul (mm, addmm) reads
    as its 2-D float32/float64 right operand, directly or through one 2-D transpose: those
    matmuls may read the iteration's slice in place. Other readers read the slice as before."""
    import torch

    found = set()
    for p in placeholders:
        v = p.meta.get("val")
        if not (isinstance(v, torch.Tensor) and v.dim() == 2 and v.dtype in (torch.float32, torch.float64)
                and not any(isinstance(s, torch.SymInt) for s in v.shape)):
            continue
        for u in p.users:
            if _reads_as_weight(u, p) or (_swaps_2d_or_copy(u) and u.args[0] is p
                                          and any(_reads_as_weight(r, u) for r in u.users)):
                found.add(p)
                break
    return frozenset(found)


def _stacked_matmul(ctx, a, lhs: int, rhs: int):
    """a . op(stack[i]) in the kernel library's indexed torch matmul, where node arg `rhs` is (a
    2-D transpose of) a stacked input of the loop body being traced (STACKED); else None (another
    operand, a transposed `a`, a small product). _scan sets STACKED only where the route may run
    (the CPU, one device, the kind allowed and the library loaded)."""
    import torch

    stacked = STACKED.get()
    if not stacked:
        return None
    node = ctx.node.args[rhs]
    if not isinstance(node, torch.fx.Node):
        return None
    if node in stacked:
        source, transpose_b = node, False
    elif _swaps_2d_or_copy(node) and node.args[0] in stacked:
        source, transpose_b = node.args[0], True
    else:
        return None
    stack, index = stacked[source]
    if is_transposed(ctx, lhs) or a.dtype != stack.dtype:
        return None
    m, k = a.shape
    rows, cols = stack.shape[1:]
    n = rows if transpose_b else cols
    if (cols if transpose_b else rows) != k or m * n * k < STACKED_MATMUL_MACS:
        return None
    out = jax.ShapeDtypeStruct((m, n), a.dtype)
    return jax.ffi.ffi_call("fx2xla_torch_matmul_indexed", out, vmap_method="sequential")(
        a, stack, jnp.asarray(index, jnp.int32).reshape(()), transpose_b=np.int64(transpose_b))


# Rows of the float32 matmuls x[M, K] @ W.T (W [N, K], as nn.Linear holds it) that CPU graphs,
# inference and training, compute as (W . x^T)^T (the plan's `weight_lhs`, option
# linear_weight_lhs). With the weight as the dot's left operand, XLA:CPU's dot (YNNPACK) streams it
# as the wide operand of the product instead of packing it as the narrow one. On the AVX2 EPYC, a
# stack of Linear layers at 4 to 64 rows took 0.34-0.71 of the time of either other form with its
# 32 MiB of weights read from memory, 0.62-1.07 with 5.4 MiB in cache (docs/benchmarks.md,
# "Weights on the left of a few-row matmul"); 2 rows are faster with W laid out [in, out], 1 and
# 128 rows gain nothing. In training forwards it beat torch's gemm (kind "matmul") too: an MLP's
# AdamW steps back to back took 0.88x the time on an Emerald Rapids, 0.93-0.95x with 1.5 GiB of
# weights, gradients and moments read from memory ("The weight on the left in training forwards").
WEIGHT_LHS_ROWS = (4, 64)


def _weight_on_the_left(x, w):
    """x[M, K] . w[N, K]^T computed as (w . x^T)^T. XLA's simplifier would fold the transposes
    back into x . w^T; the optimization barriers keep x^T and the product as computed, and XLA
    fuses each small transpose into its neighbour (x's producer, the product's reader)."""
    xt = lax.optimization_barrier(jnp.swapaxes(x, 0, 1))
    return jnp.swapaxes(lax.optimization_barrier(dot(w, xt, ((1,), (0,)))), 0, 1)


_TRANSPOSE_COPIES = (aten.permute_copy.default, aten.t_copy.default, aten.transpose_copy.int)

# The operand positions (right, left) of the matmuls nn.Linear lowers to.
_LINEAR_OPERANDS = {aten.mm.default: (1, 0), aten.addmm.default: (2, 1)}


def weight_lhs_matmuls(gm, rows=WEIGHT_LHS_ROWS) -> frozenset:
    """mm/addmm nodes of `gm` (a CPU graph) that multiply a float32 activation of
    `rows` (a [min, max] range, static) rows by a transposed dense float32 2-D tensor
    (nn.Linear's weight, or merge_linears' concatenation of weights): the plan computes them as
    (W . x^T)^T, or with `few_row_matmuls`' rows in the kernel library's few-row matmul."""
    import torch

    found = set()
    for u in gm.graph.nodes:
        if u.op != "call_function":
            continue
        rhs, lhs = _LINEAR_OPERANDS.get(u.target, (None, None))
        if rhs is None:
            continue
        t, x = u.args[rhs], u.args[lhs]
        if not (isinstance(t, torch.fx.Node) and isinstance(x, torch.fx.Node) and swaps_2d(t)
                and isinstance(t.args[0], torch.fx.Node) and t not in u.args[:rhs]):
            continue
        w, xv = t.args[0].meta.get("val"), x.meta.get("val")
        if not (isinstance(w, torch.Tensor) and isinstance(xv, torch.Tensor) and w.dim() == 2 and xv.dim() == 2
                and w.dtype == xv.dtype == torch.float32 and w.is_contiguous() and xv.is_contiguous()
                and not any(isinstance(s, torch.SymInt) for s in w.shape) and w.numel() > 0):
            continue
        m = xv.shape[0]
        if not isinstance(m, torch.SymInt) and rows[0] <= m <= rows[1]:
            found.add(u)
    return frozenset(found)


# Rows of the float32 matmuls x[M, K] @ W.T (W [N, K], as nn.Linear holds it) that CPU inference
# graphs compute in the kernel library's `fx2xla_few_rows_matmul` (torch_kernels.py), where it
# is built and the option torch_kernels allows "few_rows_matmul": the 2-8 rows of a decode step at
# a small batch. It reads W once, in tiles of as many of its rows as the CPU's vector registers
# hold accumulators for (1-4), against every row of x. A LLaMA 4L decode
# at batch 8 ran 1.12x the tokens/s without it on an Ice Lake (its step 0.85x the time), a stack
# of Linear layers 0.74-1.04x the time of the weight-left dot. One row stays XLA's
# matrix-vector dot, which the kernel did not beat (1.01-1.36x the time); from 9 rows on, the
# weight stays on the dot's left (docs/benchmarks.md, "Few-row float32 matmuls", "Few-row
# matmuls in tiles").
FEW_ROWS = (2, 8)


def few_row_matmuls(gm) -> frozenset:
    """The matmuls of `gm` (a CPU inference graph) of FEW_ROWS rows that `weight_lhs_matmuls`
    would take: the plan sends them to the few-row kernel (GraphPlan.few_rows), with the weight
    as torch holds it."""
    return weight_lhs_matmuls(gm, FEW_ROWS)


def _few_rows(ctx, x, w):
    """x[M, K] . w[N, K]^T in the kernel library's few-row matmul, or None where the module may
    not call it (a package's portable module, the library off or not built)."""
    from .. import torch_kernels

    if ctx.spmd or not torch_kernels.available("few_rows_matmul"):
        return None
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("fx2xla_few_rows_matmul", out, vmap_method="sequential")(x, w)


# Weight layout for XLA:CPU's float32 dot. nn.Linear stores W as [out, in] and multiplies
# x @ W.T; XLA:CPU's float32 dot of a few rows is faster with the weight laid out [in, out]
# (docs/benchmarks.md, "Linear weights laid out [in, out]": 8 x 256 @ 256 x 688 36 against 77 µs,
# 2-64 rows 0.53-0.96 of the time, from 128 rows on the same). Not for one row (XLA then keeps a
# transpose of the weight in the program), nor for bf16, whose dot is 1.9-5.9x slower that way.
_TRANSPOSES = (aten.t.default, aten.permute.default, aten.transpose.int)


def swaps_2d(node) -> bool:
    """`node` transposes a 2-D tensor: t(W), W.permute(1, 0), W.transpose(0, 1)."""
    if node.op != "call_function" or node.target not in _TRANSPOSES:
        return False
    if node.target is aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target is aten.transpose.int:
        return {d % 2 for d in node.args[1:3]} == {0, 1}
    return True


def check_linear_layout(value, where: str, name: str = "transposed_linear_weights") -> None:
    """Option `name` (`transposed_linear_weights`: torch.compile's option and fx2xla.export's
    argument; `widened_linear_weights`) is True, False or "always"; anything else is a
    ValueError naming `where` it was given."""
    if not isinstance(value, bool) and value != "always":
        raise ValueError(f"{where}{name}={value!r}; expected True, False or 'always'")


def kn_weights(gm, example_inputs, always: bool = False, weight_lhs: frozenset = frozenset()) -> frozenset:
    """Placeholders of `gm` that only float32 matmuls of 2 rows or more read, as their
    transposed right operand (nn.Linear's weight), and whose dots XLA:CPU runs faster with the
    weight laid out [in, out] on this machine (runtime.dot_layout.prefer_kn, at the most rows
    any of them has; `always`: every such weight): the CPU plan imports them laid out [in, out]
    (InputKind.RELAID, perm (1, 0)), once while unchanged. A weight that a matmul of
    `weight_lhs` (weight_lhs_matmuls) reads stays as torch holds it, which that matmul reads."""
    import torch

    from ..runtime import dot_layout

    found = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, ex in zip(placeholders, example_inputs):
        if not (isinstance(ex, torch.Tensor) and ex.dim() == 2 and ex.dtype == torch.float32
                and not any(isinstance(s, torch.SymInt) for s in ex.shape) and ex.numel() > 0 and node.users):
            continue
        ok, rows = True, 2
        for t in node.users:
            if not swaps_2d(t) or t.args[0] is not node or not t.users:
                ok = False
                break
            for u in t.users:
                if u in weight_lhs:
                    ok = False
                    break
                rhs, lhs = _LINEAR_OPERANDS.get(u.target, (None, None))
                x = u.args[lhs].meta.get("val") if rhs is not None else None
                if (rhs is None or u.args[rhs] is not t or t in u.args[:rhs] or x is None or x.dim() != 2
                        or (not isinstance(x.shape[0], torch.SymInt) and x.shape[0] < 2)):
                    ok = False
                    break
                rows = max(rows, _size_hint(x.shape[0]))
            if not ok:
                break
        if ok and (always or dot_layout.prefer_kn(rows, ex.shape[1], ex.shape[0])):
            found.add(node)
    return frozenset(found)


# Rows from which CPU inference graphs multiply a bf16/float16 weight through a float32 copy of it
# (InputKind.WIDENED, option widened_linear_weights). XLA:CPU has no half-precision GEMM: its bf16
# dot converts the weight to float32 in a pass of its own on every call, then runs the float32
# dot. The copy, made once while the weight is unchanged, skips that pass: on a 2-core Emerald
# Rapids (which has bf16 instructions), 32 x 1024 . 1024 x 4096 took 0.70x the time, 512 rows
# 0.55x, 16 rows 0.90x; at 2-12 rows XLA's dot converts as it goes, and the copy (twice the bytes
# to read) took 0.98-1.49x (docs/benchmarks.md, "bf16 weights widened once").
WIDEN_MIN_ROWS = 16
# The float32 copies one graph may make (bytes, in the graph's input order), unless the option says
# "always": each costs twice its weight's memory on top of the weight, which for a large model in
# bf16 would exceed what its user has room for.
WIDEN_MAX_BYTES = 1 << 30


def _widened_reads(node) -> list | None:
    """The mm/addmm nodes that read placeholder `node` as their right operand, directly (a
    weight stored [in, out], transformers' Conv1D) or through one 2-D transpose (nn.Linear's
    [out, in]), where those are all its reads; else None."""
    reads = []
    for t in node.users:
        if swaps_2d(t) and t.args[0] is node and t.users:
            users, operand = list(t.users), t
        else:
            users, operand = [t], node
        for u in users:
            rhs, lhs = _LINEAR_OPERANDS.get(u.target, (None, None))
            if rhs is None or u.args[rhs] is not operand or operand in u.args[:rhs]:
                return None
            reads.append(u)
    return reads or None


def widened_weights(gm, example_inputs, max_bytes: int | None = WIDEN_MAX_BYTES) -> frozenset:
    """Placeholders of `gm` (a CPU inference graph) holding a 2-D bf16/float16 weight that only
    matmuls of WIDEN_MIN_ROWS rows or more read, as their right operand (`_widened_reads`): the
    plan imports them as float32 copies (InputKind.WIDENED), once while unchanged, and those
    matmuls multiply the copy (`_matmul`, LoweringContext.wide_weight). A symbolic row count
    counts at the size it was traced at. In input order, a weight whose copy would take the
    copies past `max_bytes` is left as it is (None: no limit)."""
    import torch

    found, total = set(), 0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, ex in zip(placeholders, example_inputs):
        if not (isinstance(ex, torch.Tensor) and ex.dim() == 2 and ex.dtype in (torch.bfloat16, torch.float16)
                and ex.is_contiguous() and not any(isinstance(s, torch.SymInt) for s in ex.shape)
                and ex.numel() > 0):
            continue
        reads = _widened_reads(node)
        if reads is None:
            continue
        for u in reads:
            x = u.args[_LINEAR_OPERANDS[u.target][1]].meta.get("val")
            if not (isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype == ex.dtype
                    and _size_hint(x.shape[0]) >= WIDEN_MIN_ROWS):
                break
        else:
            size = 4 * ex.numel()
            if max_bytes is None or total + size <= max_bytes:
                found.add(node)
                total += size
    return frozenset(found)


def widened_matmuls(gm, widened) -> dict:
    """The matmul nodes that read each placeholder of `widened` (widened_weights), each mapped to
    that placeholder."""
    return {u: node for node in widened for u in _widened_reads(node) or ()}


def _size_hint(size) -> int:
    """A dimension's size, or for a symbolic one the size it was traced at (32 where unknown)."""
    import torch

    if not isinstance(size, torch.SymInt):
        return int(size)
    hint = getattr(size.node, "hint", None)
    return int(hint) if isinstance(hint, int) else 32


@register_lowering(aten.mm.default, aten.bmm.default)
def _mm(ctx, a, b):
    return _matmul(ctx, a, b, 0, 1)


def _one_row_bf16(ctx, a, b, rhs: int):
    """x[1, K] . W for bf16 on the CPU, or None where the matmul is not one. XLA:CPU's bf16 dot
    of one row takes a slow path (fx2xla/torch_kernels.py gives the figures). Where the kernel
    library may run, the row goes to its `fx2xla_skinny_matmul`, with W handed over as stored
    ([N, K] for a transposed operand such as nn.Linear's weight, else [K, N]). Elsewhere (a
    package's portable module, the library off or not built, a program over a mesh) x gets a
    zero second row, which XLA's dot of two rows computes 2-10x faster than one. The result is
    float32, as XLA's bf16 dot gives it on the CPU."""
    from .. import torch_kernels

    if (a.ndim != 2 or a.dtype != jnp.bfloat16 or b.dtype != a.dtype or 0 in b.shape
            or not torch_kernels.skinny(a.shape[0])):
        return None
    transposed = is_transposed(ctx, rhs)
    w, cb = (jnp.swapaxes(b, 0, 1), 1) if transposed else (b, 0)  # XLA cancels this transpose
    if ctx.spmd or not torch_kernels.available("skinny_matmul"):
        two = jnp.concatenate([a, jnp.zeros_like(a)])
        return dot(two, w, ((1,), (cb,)))[:1]
    out = jax.ShapeDtypeStruct((1, b.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("fx2xla_skinny_matmul", out, vmap_method="sequential")(a, w, w_nk=np.int64(transposed))


@register_lowering(aten.mm.default, platform="cpu")
def _mm_cpu(ctx, a, b):
    out = _one_row_bf16(ctx, a, b, 1)
    return _matmul(ctx, a, b, 0, 1) if out is None else out


@register_lowering(aten.addmm.default)
def _addmm(ctx, bias, a, b, *, beta=1, alpha=1):
    _same_dtypes(ctx, 0, 1, 2)
    return _addmm_of(ctx, bias, _matmul(ctx, a, b, 1, 2), beta, alpha)


@register_lowering(aten.addmm.default, platform="cpu")
def _addmm_cpu(ctx, bias, a, b, *, beta=1, alpha=1):
    _same_dtypes(ctx, 0, 1, 2)
    out = _one_row_bf16(ctx, a, b, 2)
    return _addmm_of(ctx, bias, _matmul(ctx, a, b, 1, 2) if out is None else out, beta, alpha)


def _addmm_of(ctx, bias, product, beta, alpha):
    """beta * bias + alpha * product, as torch's addmm, for a product in the dot's result dtype."""
    out = _scaled(product, alpha)
    if beta == 0:  # torch ignores `self` entirely (NaN/inf in it do not propagate)
        return out
    # The bias is added in the dot's result dtype. CPU: float32, rounded once afterwards, like
    # torch's CPU kernels. GPUs: the half dtype, which is the form XLA's GEMM rewriter folds into
    # the GEMM itself (dot + broadcast(bias) of one dtype: a cuBLASLt bias epilogue, or the bias
    # as the GEMM's C operand with beta = 1); either adds it to the float32 accumulator and
    # rounds once, as torch's cuBLASLt epilogue does. Adding in float32 on GPUs would rather
    # force a float32 GEMM output and a separate convert kernel over the whole result. Where XLA
    # does not fold it (a Triton GEMM fusion may take the add as its epilogue), the product is
    # rounded before the add: an extra error of at most half an ulp of the product, as when
    # torch adds a bias in a separate kernel.
    bias = _scaled(bias.astype(out.dtype), beta)
    return out + jnp.broadcast_to(bias, out.shape)
