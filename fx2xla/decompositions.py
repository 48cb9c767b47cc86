"""The decomposition table AOTAutograd applies before lowering: PyTorch's core-ATen table,
plus every functional `aten._foreach_*` overload (foreach optimizers, clip_grad_norm_) as
one core op per tensor.

Ops that survive it (core ATen plus a few prims such as `prims.fma`) each need a rule in
`fx2xla/lowering/`.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
import torch
from torch._decomp import core_aten_decompositions
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes, get_computation_dtype

from .errors import InvalidInputError

aten = torch.ops.aten


@functools.cache
def decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(foreach_decompositions())
    table[aten.linalg__powsum.default] = _powsum
    table[aten.index_add.default] = functools.partial(_checked_index_add, table[aten.index_add.default])
    table[aten.take.default] = _take
    table[aten._native_multi_head_attention.default] = _native_multi_head_attention
    table[aten._transformer_encoder_layer_fwd.default] = _transformer_encoder_layer
    table[aten._weight_norm_interface_backward.default] = _weight_norm_backward
    return table


@functools.cache
def attention_op_table() -> dict:
    """The table with CPU attention kept as one 4-d op (`_scaled_dot_product_flash_attention_for_cpu`,
    lowered by its rule in lowering/nn.py) instead of torch's math decomposition. Used for:
    - graphs over a mesh: the decomposition's bmm over batch x heads merged into one dim cannot
      keep heads sharded (each device's heads are not one block of the merged dim);
    - inference graphs: the decomposition scales K by sqrt(scale) and copies K and V once per
      query head for grouped-query attention, each a pass over the whole KV cache per decode
      step; the rule scales the scores and reads each KV head once for its group of queries."""
    table = dict(decomposition_table())
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    return table


def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as the nearest `dtype` number (a Python float, for a scalar kernels hold in
    the tensor's own type)."""
    kind = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: jnp.bfloat16}.get(dtype)
    return value if kind is None else float(np.asarray(value, kind))


def _native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight,
                                 proj_bias, mask=None, need_weights=True, average_attn_weights=True, mask_type=None):
    """nn.MultiheadAttention's inference fast path (eval, no grad, batch_first) as eager's CPU
    kernel computes it: q/k/v projections, q scaled by 1/sqrt(head dim) held in the input's
    type, softmax over the keys where the mask is False, output projection. The mask is read
    as a bool mask whatever its dtype (a float mask's nonzero entries mask, as in eager's
    kernel); mask_type 0 is [T, T], 1 a key-padding [B, T], 2 [B, H, T, T]. A row whose keys
    are all masked comes out NaN, as eager's."""
    b, t, d = query.shape
    if d != embed_dim or d % num_head or qkv_weight.shape != (3 * d, d):
        raise InvalidInputError(
            "aten._native_multi_head_attention",
            f"query {list(query.shape)}, embed_dim {embed_dim}, num_heads {num_head} and qkv_weight "
            f"{list(qkv_weight.shape)} do not agree (eager needs query [B, T, embed_dim], embed_dim divisible "
            "by num_heads, qkv_weight [3 * embed_dim, embed_dim])")
    if query.numel() == 0:
        return aten.new_empty(query, query.shape), aten.new_empty(query, [0])
    dh = d // num_head

    def heads(x):
        return aten.permute(aten.view(x, [b, t, num_head, dh]), [0, 2, 1, 3])

    if query is key and key is value:  # self-attention: one product, as eager's kernel
        q, k, v = (heads(p) for p in aten.split.Tensor(aten.linear(query, qkv_weight, qkv_bias), d, -1))
    else:
        q, k, v = (heads(aten.linear(x, w, bias)) for x, w, bias in
                   zip((query, key, value), aten.split.Tensor(qkv_weight, d), aten.split.Tensor(qkv_bias, d)))
    inv_sqrt = _rounded(1.0 / _rounded(math.sqrt(dh), query.dtype), query.dtype)
    if mask is None and not need_weights:
        out = aten.scaled_dot_product_attention(q, k, v, scale=inv_sqrt)
        out = aten.reshape(aten.permute(out, [0, 2, 1, 3]), [b, t, d])
        return aten.linear(out, proj_weight, proj_bias), aten.new_empty(query, [0])
    q = aten.mul(q, inv_sqrt)
    scores = aten.matmul(q, aten.transpose(k, -2, -1))
    if mask is not None:
        masked = mask if mask.dtype == torch.bool else aten.ne(mask, 0)
        if masked.dim() == 2 and mask_type == 1:
            masked = aten.view(masked, [b, 1, 1, t])
        scores = aten.masked_fill(scores, masked, float("-inf"))
    probs = aten._softmax(scores, -1, False)
    out = aten.reshape(aten.permute(aten.matmul(probs, v), [0, 2, 1, 3]), [b, t, d])
    out = aten.linear(out, proj_weight, proj_bias)
    if not need_weights:
        return out, aten.new_empty(query, [0])
    if average_attn_weights:
        probs = aten.div(aten.sum.dim_IntList(probs, [1]), num_head)
    return out, probs


def _transformer_encoder_layer(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                               norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                               ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None):
    """nn.TransformerEncoderLayer's inference fast path (`torch._transformer_encoder_layer_fwd`):
    self-attention as `_native_multi_head_attention`, residuals, layer norms before or after
    each block, and the feed-forward block with exact GELU or ReLU, in eager's order."""
    if src.numel() == 0:
        return aten.clone(src)

    def norm(x, w, bias):
        return aten.layer_norm(x, [embed_dim], w, bias, eps)

    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = _native_multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                     mask, False, True, mask_type)[0]
    x = aten.add(x, src)
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    residual = x
    if norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    h = aten.linear(x, ffn_weight_1, ffn_bias_1)
    h = aten.gelu(h) if use_gelu else aten.relu(h)
    x = aten.add(aten.linear(h, ffn_weight_2, ffn_bias_2), residual)
    if not norm_first:
        x = norm(x, norm_weight_2, norm_bias_2)
    return x


def _weight_norm_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    """The backward of weight normalization w = g * v / ||v|| (norms over every dim but `dim`,
    as the forward saved them), as eager's fused kernel computes it, in float32 for bf16:
    grad_g = sum(grad_w * v) / norm, grad_v = (g / norm) * (grad_w - v * grad_g / norm).
    Speech encoders' convolutional position embeddings (HuBERT, WavLM, SEW) train through it."""
    acc = get_computation_dtype(grad_w.dtype)
    gw, v, g, norms = (aten._to_copy(t, dtype=acc) for t in (grad_w, saved_v, saved_g, saved_norms))
    others = [d for d in range(v.dim()) if d != dim % max(v.dim(), 1)]
    grad_g = aten.div(aten.sum.dim_IntList(aten.mul(gw, v), others, True), norms)
    grad_v = aten.mul(aten.div(g, norms), aten.sub(gw, aten.mul(v, aten.div(grad_g, norms))))
    return (aten._to_copy(grad_v, dtype=saved_v.dtype),
            aten._to_copy(aten.reshape(grad_g, saved_g.shape), dtype=saved_g.dtype))


def _take(x, index):
    """x.flatten()[index]. torch's decomposition indexes with `index` as it is, which for a 0-d
    index means a Python-int index (a data-dependent `item()` no static shape survives); a 1-d
    view of it is advanced indexing at every rank, bounds-checked like eager's take."""
    return x.reshape(-1)[index.reshape(-1)].reshape(index.shape)


def _checked_index_add(decomposition, x, dim, index, source, *, alpha=1):
    """Eager's shape check of index_add, which the core decomposition (an index_put that
    broadcasts `source`) would skip: a wrongly shaped source is an error, not a broadcast."""
    if x.dim() > 0 and source.dim() > 0:
        d = dim % x.dim()
        same = source.dim() == x.dim() and all(x.shape[i] == source.shape[i] for i in range(x.dim()) if i != d)
        if not same or source.shape[d] != index.numel():
            raise InvalidInputError(
                "aten.index_add", "source tensor shape must match self tensor shape, excluding the specified "
                f"dimension, and have index.numel() = {index.numel()} there. Got self.shape = {list(x.shape)} "
                f"source.shape = {list(source.shape)} (dim {dim}); eager rejects it too")
    return decomposition(x, dim, index, source, alpha=alpha)


def _powsum(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    """sum(|x| ** ord) (`torch.linalg._powsum`, behind `_foreach_powsum`): literally, so
    0 ** 0 counts 1 and 0 ** -1 is inf; bf16/f16 computed in float32 as eager's kernel."""
    if dtype is not None:
        x = aten._to_copy(x, dtype=dtype)
    x = aten.abs(x)  # real for complex input
    compute = get_computation_dtype(x.dtype)
    out = aten.sum.dim_IntList(aten.pow(aten._to_copy(x, dtype=compute), ord), dim, keepdim)
    return aten._to_copy(out, dtype=x.dtype)


def _per_tensor(op, *args, **kwargs):
    """`op` once per list position; arguments that are not lists (a Scalar, the one Tensor
    of the .Tensor overloads) are shared by all positions."""
    n = len(next(a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))))

    def at(a, i):
        return a[i] if isinstance(a, (list, tuple)) else a

    return [op(*(at(a, i) for a in args), **{k: at(v, i) for k, v in kwargs.items()}) for i in range(n)]


def _addc(op, pointwise):
    """addcmul/addcdiv: a Scalar value (per list or per position) goes to aten.addcmul/addcdiv
    (whose core decomposition computes bf16 in float32 like eager's kernel); the .Tensor
    overload's 1-D `scalars` holds one value per position, which eager reads as a double
    scalar, so do the same math with it as a 0-d tensor: self + (value * t1) op t2 in the
    computation dtype, rounded once."""

    def one(self, t1, t2, value):
        if not isinstance(value, torch.Tensor):
            return op(self, t1, t2, value=value)
        compute, result = elementwise_dtypes(self, t1, t2, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
        self, t1, t2, value = (aten._to_copy(t, dtype=compute) for t in (self, t1, t2, value))
        return aten._to_copy(aten.add(self, pointwise(aten.mul(value, t1), t2)), dtype=result)

    def decomp(self, tensor1, tensor2, value=1):
        if isinstance(value, torch.Tensor):
            value = list(aten.unbind(value))
        return _per_tensor(one, self, tensor1, tensor2, value)

    return decomp


def _scalar_or_tensor(tensor_op, scalar_op):
    return lambda a, b: tensor_op(a, b) if isinstance(b, torch.Tensor) else scalar_op(a, b)


# Foreach ops whose per-tensor op is not aten.<stem> with the same arguments (eager's CPU
# kernels call exactly these per tensor).
_PER_TENSOR = {
    "norm": lambda t, ord=2, dtype=None: aten.linalg_vector_norm(t, ord, dtype=dtype),
    "powsum": lambda t, ord=2, dtype=None: aten.linalg__powsum(t, ord, dtype=dtype),
    "maximum": _scalar_or_tensor(aten.maximum, aten.clamp_min),
    "minimum": _scalar_or_tensor(aten.minimum, aten.clamp_max),
}


def foreach_overloads() -> list[tuple[str, torch._ops.OpOverload]]:
    """(stem, overload) for every functional `aten._foreach_<stem>` overload torch has. The
    in-place `_foreach_<stem>_` and `.out` overloads never reach the decomposition table:
    AOTAutograd's functionalization rewrites them to these (plus copy-back of the inputs)."""
    names = sorted({s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas()
                    if s.name.startswith("aten::_foreach_") and not s.name.endswith("_")})
    out = []
    for name in names:
        packet = getattr(aten, name)
        out += [(name[len("_foreach_"):], getattr(packet, o)) for o in packet.overloads() if not o.endswith("out")]
    return out


@functools.cache
def foreach_decompositions() -> dict:
    """Every functional `aten._foreach_*` overload as per-tensor core ops: PyTorch's core-ATen
    table leaves them to Inductor's own lowerings."""
    table = {}
    for stem, overload in foreach_overloads():
        if stem in ("addcmul", "addcdiv"):
            fn = _addc(getattr(aten, stem), aten.mul if stem == "addcmul" else aten.div)
        elif stem in _PER_TENSOR:
            fn = functools.partial(_per_tensor, _PER_TENSOR[stem])
        else:
            fn = functools.partial(_per_tensor, getattr(aten, stem))
        table[overload] = fn
    return table
