"""Every fused SDPA kernel torch dispatches to on accelerators lowers, forward and backward:
flash, memory-efficient, cuDNN and the "overrideable" one of out-of-tree devices. On CPU they
run as one-node graphs (torch.compile on CPU never emits them) and are compared with torch's
math attention (`_scaled_dot_product_attention_math`) and its autograd gradients, and the
logsumexp with a float64 computation. Tolerances: float32 rtol 1e-4 / atol 1e-5 (conftest),
bfloat16 rtol 1.6e-2 / atol 1e-2 against a float32 reference of the same inputs.
Dropout is checked through linearity: with V the identity, the output IS the dropped
attention matrix A, so every kept weight must equal softmax / (1 - p), about p of them must be
zero, and the backward's grad_V must be A^T @ grad (the forward's mask, rebuilt from the seed
it returned)."""
import math

import pytest
import torch
from tests.conftest import run_op, tolerance

aten = torch.ops.aten
B, H, LQ, LK, D = 2, 3, 5, 7, 8


def _qkv(dtype=torch.float32, lq=LQ, lk=LK, d=D):
    torch.manual_seed(0)
    return (torch.randn(B, H, lq, d, dtype=dtype), torch.randn(B, H, lk, d, dtype=dtype),
            torch.randn(B, H, lk, d, dtype=dtype))


def _bias(dtype=torch.float32, lq=LQ, lk=LK):
    torch.manual_seed(1)
    bias = torch.randn(B, H, lq, lk, dtype=dtype)
    bias[0, 0, 1, :3] = -math.inf  # some keys masked out
    return bias


def _reference(q, k, v, bias, causal, scale):
    """Math attention and its gradients (float32; the bias's too), and the float64 logsumexp."""
    q32, k32, v32 = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    b32 = None if bias is None else bias.detach().float().clone().requires_grad_()
    mask = b32
    if causal:  # the math op refuses a mask with is_causal: the same top-left triangle as a bias
        tri = torch.zeros(q.shape[2], k.shape[2]).masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(),
                                                              -math.inf)
        mask = tri if mask is None else mask + tri
    out = aten._scaled_dot_product_attention_math(q32, k32, v32, mask, 0.0, False, scale=scale)[0]
    grad = torch.ones_like(out) * torch.linspace(-1, 1, out.shape[-1])
    grads = torch.autograd.grad(out, [q32, k32, v32] + ([b32] if b32 is not None else []), grad)
    s = (q.double() @ k.double().transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if bias is not None:
        s = s + bias.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, -1)
    # A row with every key masked: output 0 and logsumexp 0, the convention of ATen's CPU flash
    # kernel, which the rules follow for every variant.
    return out.detach(), grad, [g.detach() for g in grads], torch.where(lse.isneginf(), 0, lse)


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance(dtype, 10 if dtype != torch.float32 else 1))


CONFIGS = [(False, None), (True, None), (False, 0.3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal,scale", CONFIGS)
def test_flash_forward_and_backward(dtype, causal, scale):
    q, k, v = _qkv(dtype)
    out, grad, grads, lse = _reference(q, k, v, None, causal, scale)
    res = run_op(aten._scaled_dot_product_flash_attention.default, q, k, v, 0.0, causal, scale=scale)
    _close(res[0], out, dtype)
    _close(res[1], lse, torch.float32)
    assert res[4] == LQ and res[5] == LK and res[6].dtype == torch.uint64
    g = run_op(aten._scaled_dot_product_flash_attention_backward.default, grad.to(dtype), q, k, v, res[0], res[1],
               None, None, LQ, LK, 0.0, causal, res[6], res[7], scale=scale)
    for actual, expected in zip(g, grads):
        _close(actual, expected, dtype)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("causal,scale", CONFIGS)
def test_efficient_forward_and_backward(with_bias, causal, scale):
    q, k, v = _qkv()
    bias = _bias() if with_bias else None
    out, grad, grads, lse = _reference(q, k, v, bias, causal, scale)
    res = run_op(aten._scaled_dot_product_efficient_attention.default, q, k, v, bias, True, 0.0, causal, scale=scale)
    _close(res[0], out, torch.float32)
    assert res[1].shape == (B, H, 32)  # logsumexp padded to blocks of 32 query rows, like the kernel
    _close(res[1][..., :LQ], lse, torch.float32)
    mask = [True, True, True, with_bias]
    g = run_op(aten._scaled_dot_product_efficient_attention_backward.default, grad, q, k, v,
               bias if with_bias else torch.empty(0), res[0], res[1], res[2], res[3], 0.0, mask, causal, scale=scale)
    for actual, expected in zip(g, grads):
        _close(actual, expected, torch.float32)
    if not with_bias:
        assert len(g) == 3 or g[3] is None


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("causal,scale", CONFIGS)
def test_cudnn_forward_and_backward(with_bias, causal, scale):
    q, k, v = _qkv()
    bias = _bias() if with_bias else None
    out, grad, grads, lse = _reference(q, k, v, bias, causal, scale)  # cuDNN gives no bias gradient
    res = run_op(aten._scaled_dot_product_cudnn_attention.default, q, k, v, bias, True, 0.0, causal, scale=scale)
    _close(res[0], out, torch.float32)
    _close(res[1][..., 0], lse, torch.float32)
    g = run_op(aten._scaled_dot_product_cudnn_attention_backward.default, grad, q, k, v, res[0], res[1], res[6],
               res[7], bias, None, None, LQ, LK, 0.0, causal, scale=scale)
    for actual, expected in zip(g, grads[:3]):
        _close(actual, expected, torch.float32)


def test_overrideable_forward_and_backward():
    q, k, v = _qkv()
    bias = _bias()
    out, grad, grads, lse = _reference(q, k, v, bias, True, None)
    res = run_op(aten._scaled_dot_product_fused_attention_overrideable.default, q, k, v, bias, 0.0, True)
    _close(res[0], out, torch.float32)
    _close(res[1], lse, torch.float32)
    g = run_op(aten._scaled_dot_product_fused_attention_overrideable_backward.default, grad, q, k, v, bias,
               [True, True, True, True], res[0], res[1], None, None, LQ, LK, 0.0, True, res[6], res[7])
    for actual, expected in zip(g, grads):
        _close(actual, expected, torch.float32)




VARIANTS = {
    "flash": (lambda q, k, v, p: run_op(aten._scaled_dot_product_flash_attention.default, q, k, v, p, False),
              lambda g, q, k, v, r, p: run_op(aten._scaled_dot_product_flash_attention_backward.default, g, q, k, v,
                                              r[0], r[1], None, None, q.shape[2], k.shape[2], p, False, r[6], r[7])),
    "efficient": (lambda q, k, v, p: run_op(aten._scaled_dot_product_efficient_attention.default, q, k, v, None, True, p),
                  lambda g, q, k, v, r, p: run_op(aten._scaled_dot_product_efficient_attention_backward.default, g, q,
                                                  k, v, torch.empty(0), r[0], r[1], r[2], r[3], p,
                                                  [True, True, True, False])),
    "cudnn": (lambda q, k, v, p: run_op(aten._scaled_dot_product_cudnn_attention.default, q, k, v, None, True, p),
              lambda g, q, k, v, r, p: run_op(aten._scaled_dot_product_cudnn_attention_backward.default, g, q, k, v,
                                              r[0], r[1], r[6], r[7], None, None, None, q.shape[2], k.shape[2], p,
                                              False)),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dropout_mask_is_consistent_between_forward_and_backward(variant):
    forward, backward = VARIANTS[variant]
    p, lk = 0.3, 16
    q, k, _ = _qkv(lq=12, lk=lk, d=lk)
    v = torch.eye(lk).expand(B, H, lk, lk).contiguous()  # then the output is the weights A
    grad = torch.randn(B, H, 12, lk)
    torch.manual_seed(123)
    res = forward(q, k, v, p)
    grads = backward(grad, q, k, v, res, p)
    a = res[0]
    weights = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), -1)
    kept = a != 0
    torch.testing.assert_close(a[kept], (weights / (1 - p))[kept], rtol=1e-4, atol=1e-6)
    dropped = 1 - kept.float().mean().item()
    assert 0.2 < dropped < 0.4, dropped  # ~p of B*H*12*16 = 1152 weights
    torch.testing.assert_close(grads[2], a.transpose(-1, -2) @ grad, rtol=1e-4, atol=1e-5)
    # A fresh mask per call; torch.manual_seed makes it repeatable.
    torch.manual_seed(123)
    again = forward(q, k, v, p)[0]
    other = forward(q, k, v, p)[0]
    assert torch.equal(again, a) and not torch.equal(other, a)


@pytest.mark.parametrize("causal, mask, gqa", [(False, None, False), (True, None, False), (False, "bool", False),
                                               (False, "float", True)])
def test_composite_sdpa_op_matches_eager(causal, mask, gqa):
    """aten.scaled_dot_product_attention itself (torch.export keeps it; AOTAutograd decomposes
    it first): float32 rtol 1e-4 / atol 1e-5 against eager."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16)
    k = torch.randn(2, 2 if gqa else 4, 8, 16)
    v = torch.randn_like(k)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(2, 1, 8, 8) > 0.3
    elif mask == "float":
        attn_mask = torch.randn(8, 8)
    op = torch.ops.aten.scaled_dot_product_attention.default
    expected = op(q, k, v, attn_mask, 0.0, causal, enable_gqa=gqa)
    actual = run_op(op, q, k, v, attn_mask, 0.0, causal, enable_gqa=gqa)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
