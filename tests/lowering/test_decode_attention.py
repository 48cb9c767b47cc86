"""Decode attention on the CPU (fx2xla/torch_kernels.py, `fx2xla_decode_attention`;
lowering/nn.py: DECODE_ATTENTION_ROWS, _decode_attention).

A CPU inference graph's float32 attention with at most 8 query rows per kv head (query heads per
kv head x positions: a decode step) runs in the kernel library's decode attention, straight from
the (un-repeated) K and V. What these tests hold it to:
- results equal eager's `scaled_dot_product_attention` at float32 rtol 1e-5 / atol 1e-5 (the
  kernel sums in another order), for batch 1 and 3, 1 to 8 rows per kv head (plain heads,
  grouped-query heads through transformers' repeat_kv, and enable_gqa), 1 to 300 keys, head
  sizes with and without a remainder of 8 floats, with no
  mask, a bool mask, an additive float mask of any broadcast shape, rows whose every key is
  masked (0, as eager), is_causal over two positions, and a custom scale;
- the optimized HLO calls the kernel and the handler runs once per attention per call; the
  logsumexp, where the graph returns it (the flash op called directly), equals eager's kernel's
  within the same tolerance;
- left to XLA: 9 rows per kv head, bf16, 32 query rows or more (torch's kernel), and the option
  torch_kernels without "decode_attention", which agrees with the kernel within that tolerance;
- a work large enough to be cut across XLA's threads gives, from four threads calling at once,
  the bits one call gives, on every call;
- a transformers LLaMA decode token (grouped-query, static-shaped cache) at batch 1 and 8 runs
  its four layers' attention in the kernel, and its logits match eager's at rtol/atol 1e-4;
- called directly, the handler refuses a mask that does not broadcast, and bf16 operands, with
  messages that say why."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fx2xla import torch_kernels
from fx2xla.metrics import live_graphs
from fx2xla.runtime.executor import optimized_hlo_text
from fx2xla.testing import llama

from tests.conftest import calls_in_threads, llama_decode_step

TARGET = "fx2xla_decode_attention"
TOL = dict(rtol=1e-5, atol=1e-5)
WITHOUT = [k for k in torch_kernels.KINDS if k != "decode_attention"]
pytestmark = pytest.mark.skipif(not torch_kernels.available("decode_attention"), reason=torch_kernels.status())


def run(fn, *args, **options):
    """`fn` compiled with fx2xla (and `options`) and called on args under no_grad: (result, the
    kernel calls in the new graphs' optimized HLO, handler calls it made, compiled)."""
    before = {id(g) for g in live_graphs}
    calls = torch_kernels.decode_attention_calls()
    compiled = torch.compile(fn, backend="fx2xla", fullgraph=True, options=options or None)
    with torch.no_grad():
        out = compiled(*args)
    hlo = "\n".join(optimized_hlo_text(g.static.exe) for g in live_graphs if id(g) not in before)
    return out, len(re.findall(rf'custom_call_target="{TARGET}"', hlo)), torch_kernels.decode_attention_calls() - calls, compiled


def repeat_kv(x, n):
    """transformers' repeat_kv: each kv head n times in a row."""
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


def attention(groups, mask=None, causal=False, scale=None):
    def fn(q, k, v, *m):
        return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                              attn_mask=m[0] if m else None, is_causal=causal, scale=scale)
    return fn


def qkv(b, kv, groups, length, s, e, ev=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, kv * groups, length, e, generator=g), torch.randn(b, kv, s, e, generator=g),
            torch.randn(b, kv, s, ev or e, generator=g))


# (batch, kv heads, query heads per kv head, positions, keys, head size, value size)
SHAPES = [(1, 4, 1, 1, 1, 64, 64), (3, 2, 2, 1, 47, 64, 64), (1, 2, 4, 2, 5, 13, 13), (3, 1, 8, 1, 300, 64, 64),
          (2, 3, 1, 1, 33, 16, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_matches_eager(shape):
    """No mask: eager's result within TOL; the kernel once in the HLO and once per call."""
    b, kv, groups, length, s, e, ev = shape
    q, k, v = qkv(b, kv, groups, length, s, e, ev)
    fn = attention(groups)
    out, in_hlo, calls, _ = run(fn, q, k, v)
    torch.testing.assert_close(out, fn(q, k, v), **TOL)
    assert in_hlo == 1 and calls == 1


MASKS = ["bool", "bool_row_all_masked", "float_full", "float_keys", "float_2d", "float_neg_inf"]


@pytest.mark.parametrize("kind", MASKS)
def test_masks(kind):
    """Bool and additive float masks of every broadcast shape, a row whose every key is masked
    (output 0, as eager's), and -inf entries: eager's result within TOL, in the kernel."""
    b, kv, groups, length, s = 3, 2, 2, 2, 20
    q, k, v = qkv(b, kv, groups, length, s, 32, seed=1)
    g = torch.Generator().manual_seed(2)
    if kind.startswith("bool"):
        mask = torch.rand(b, 1, length, s, generator=g) > 0.3
        mask[..., 0] = True
        if kind == "bool_row_all_masked":
            mask[1, 0, 1] = False
    elif kind == "float_full":
        mask = torch.randn(b, kv * groups, length, s, generator=g)
    elif kind == "float_keys":
        mask = torch.randn(1, 1, 1, s, generator=g)
    elif kind == "float_2d":
        mask = torch.randn(length, s, generator=g)
    else:
        mask = torch.where(torch.rand(b, 1, 1, s, generator=g) > 0.5, 0.0, float("-inf"))
        mask[..., 3] = 0.0
    fn = attention(groups)
    out, in_hlo, calls, _ = run(fn, q, k, v, mask)
    expected = fn(q, k, v, mask)
    if kind == "bool_row_all_masked":
        assert torch.equal(out[1, :2, 1], torch.zeros_like(out[1, :2, 1]))
        expected = torch.nan_to_num(expected)  # eager's math kernel: NaN there; its flash kernel: 0
    torch.testing.assert_close(out, expected, **TOL)
    assert in_hlo == 1 and calls == 1


def test_causal_and_scale():
    """is_causal over two positions (top-left aligned: the first sees one key) and a custom
    scale: eager's result within TOL, in the kernel."""
    q, k, v = qkv(2, 2, 3, 2, 9, 64, seed=3)
    for fn in (attention(3, causal=True), attention(3, scale=0.3)):
        torch._dynamo.reset()
        out, in_hlo, calls, _ = run(fn, q, k, v)
        torch.testing.assert_close(out, fn(q, k, v), **TOL)
        assert in_hlo == 1 and calls == 1


def _flash(q, k, v):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)


def _gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("fn", [_gqa, _flash], ids=["enable_gqa", "logsumexp"])
def test_gqa_and_logsumexp(fn):
    """SDPA's own grouped-query form (enable_gqa=True), and the flash op with its logsumexp
    returned: every result within TOL of eager's (the logsumexp of eager's kernel), in the
    kernel."""
    q, k, v = qkv(2, 2, 4, 1, 30, 64, seed=4)
    out, in_hlo, calls, _ = run(fn, q, k, v)
    expected = fn(q, k, v)
    for a, b in zip(*(torch.utils._pytree.tree_leaves(t) for t in (out, expected))):
        torch.testing.assert_close(a, b, **TOL)
    assert in_hlo == 1 and calls == 1


@pytest.mark.parametrize("case", ["nine_rows", "bf16", "prompt", "option_off"])
def test_left_to_xla(case):
    """9 rows per kv head, bf16, a 32-position prompt (torch's kernel) and the option without
    "decode_attention" make no call of the kernel; results match eager (float32 within TOL, bf16
    within conftest's bf16 tolerance) and, with the option off, the kernel's within TOL."""
    groups, length, dtype = {"nine_rows": (9, 1, torch.float32), "bf16": (2, 1, torch.bfloat16),
                             "prompt": (2, 32, torch.float32)}.get(case, (2, 1, torch.float32))
    q, k, v = (t.to(dtype) for t in qkv(2, 2, groups, length, 40, 64, seed=6))
    fn = attention(groups)
    out, in_hlo, calls, _ = run(fn, q, k, v, **({"torch_kernels": WITHOUT} if case == "option_off" else {}))
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else TOL
    torch.testing.assert_close(out, fn(q, k, v), **tol)
    assert in_hlo == 0 and calls == 0
    if case == "option_off":
        torch._dynamo.reset()
        kernel, in_hlo, _, _ = run(fn, q, k, v)
        assert in_hlo == 1
        torch.testing.assert_close(kernel, out, **TOL)


def test_threads():
    """Work cut across XLA's threads (8 x 32 heads x 600 keys): four threads calling one compiled
    attention get, on every call, the bits one call gives, and eager's result within TOL."""
    fn = attention(4)
    inputs = [qkv(8, 8, 4, 1, 600, 64, seed=10 + i) for i in range(4)]
    compiled = torch.compile(fn, backend="fx2xla", fullgraph=True)
    with torch.no_grad():
        refs = [compiled(*x) for x in inputs]
        for x, ref in zip(inputs, refs):
            torch.testing.assert_close(ref, fn(*x), **TOL)
    calls = torch_kernels.decode_attention_calls()
    results = calls_in_threads(lambda x: compiled(*x), inputs, 20)
    assert torch_kernels.decode_attention_calls() - calls == 4 * 20
    for i in range(4):
        for out in results[i]:
            assert torch.equal(out, refs[i])


@pytest.mark.parametrize("batch", [1, 8])
def test_llama_decode_token(batch):
    """A transformers LLaMA (4 heads on 2 kv heads), one token after a cached prompt: its four
    layers' attention runs in the kernel, and the logits match eager's."""
    torch.manual_seed(0)
    model = llama(layers=4).eval()
    step, token, mask, expected = llama_decode_step(model, batch)
    out, in_hlo, calls, _ = run(step, token, mask)
    assert in_hlo == 4 and calls == 4
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def _direct(q, k, v, mask):
    out = (jax.ShapeDtypeStruct(q.shape[:3] + v.shape[3:], q.dtype), jax.ShapeDtypeStruct((0,), jnp.float32))
    call = jax.ffi.ffi_call(TARGET, out)
    return jax.jit(lambda *a: call(*a, has_mask=np.int64(1), is_causal=np.int64(0), scale=np.float64(0.5)))(
        q, k, v, mask)


def test_handler_refuses():
    """A mask that does not broadcast to the scores, and bf16 operands, fail with messages that
    say why."""
    q, k, v = (np.ones(s, np.float32) for s in ((1, 2, 1, 8), (1, 1, 5, 8), (1, 1, 5, 8)))
    with pytest.raises(Exception, match="does not broadcast"):
        _direct(q, k, v, np.zeros((1, 1, 1, 4), np.float32))
    with pytest.raises(Exception, match="must be float32"):
        _direct(*(jnp.asarray(a, jnp.bfloat16) for a in (q, k, v)), np.zeros((1, 1, 1, 5), np.float32))
