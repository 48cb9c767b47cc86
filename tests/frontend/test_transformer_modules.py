"""torch.nn's own transformer modules (TransformerEncoder/Decoder, Transformer,
MultiheadAttention) compiled with fx2xla against eager, in inference and in a training step.

In eval mode under no_grad, nn.TransformerEncoderLayer takes torch's fused fast path
(`aten._transformer_encoder_layer_fwd`, which calls `aten._native_multi_head_attention`);
fx2xla decomposes both (fx2xla/decompositions.py), so the graphs lower whole: every case runs
with `fallback="error"`. Tolerances are tests/conftest.py's per dtype (float32 rtol 1e-4 /
atol 1e-5, float64 1e-7, bfloat16 rtol 1.6e-2 / atol 1e-2, scaled where a case says), NaN
where eager has NaN (a batch row whose keys are all masked)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_loss_and_grads_close, tolerance

aten = torch.ops.aten
D, HEADS, FF = 32, 4, 64


def encoder(dtype=torch.float32, layers=2, **kw):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True, **kw)
    return torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).to(dtype).eval()


def compiled_no_grad(model, dynamic=False):
    c = torch.compile(model, backend="fx2xla", fullgraph=True, dynamic=dynamic, options={"fallback": "error"})

    def run(*args, **kwargs):
        with torch.no_grad():
            return c(*args, **kwargs)
    return run


def eager_no_grad(model, *args, **kwargs):
    with torch.no_grad():
        return model(*args, **kwargs)


def masks(batch, seq, dtype):
    """Every mask kind the fast path distinguishes, by name: a key-padding mask with one batch
    row fully masked (eager gives NaN there), a causal float mask, a bool attention mask, a bool
    attention mask and the padding at once (merged into [B, H, T, T]), and a float mask with
    finite nonzero entries (which eager's fast path reads as masked, not as additive)."""
    pad = torch.zeros(batch, seq, dtype=torch.bool)
    pad[0, seq - 2:] = True
    pad[-1, :] = True
    causal = torch.nn.Transformer.generate_square_subsequent_mask(seq, dtype=dtype)
    finite = torch.zeros(seq, seq, dtype=dtype)
    finite[0, 1], finite[2, 0] = -1.0, 0.5
    return {
        "none": {},
        "padding": dict(src_key_padding_mask=pad),
        "causal": dict(mask=causal, is_causal=True),
        "bool": dict(mask=torch.ones(seq, seq, dtype=torch.bool).triu(1)),
        "bool+padding": dict(mask=torch.ones(seq, seq, dtype=torch.bool).triu(1), src_key_padding_mask=pad),
        "finite": dict(mask=finite),
    }


@pytest.mark.parametrize("mask", ["none", "padding", "causal", "bool", "bool+padding", "finite"])
@pytest.mark.parametrize("variant", [dict(), dict(norm_first=True, activation="gelu")],
                         ids=["post-norm-relu", "pre-norm-gelu"])
def test_encoder_fast_path_matches_eager(mask, variant):
    """A 2-layer encoder in eval under no_grad (torch's fused layer) matches eager at float32,
    NaN rows included, for every mask kind, post-norm ReLU and pre-norm GELU."""
    model = encoder(**variant)
    x = torch.randn(3, 6, D)
    kwargs = masks(3, 6, torch.float32)[mask]
    expected = eager_no_grad(model, x, **kwargs)
    actual = compiled_no_grad(model)(x, **kwargs)
    torch.testing.assert_close(actual, expected, equal_nan=True, **tolerance(torch.float32))
    assert torch.isnan(actual).any() == ("padding" in mask)


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padding"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_encoder_fast_path_other_dtypes(dtype, padded):
    """The fused layer at float64 and bfloat16 (bf16 at 4x conftest's tolerance: two layers of
    bf16 matmuls, softmax and layer norms whose roundings XLA places differently from eager's
    fused kernel), without a mask (attention as one scaled_dot_product_attention) and with a
    padding mask."""
    model = encoder(dtype)
    x = torch.randn(2, 5, D, dtype=dtype)
    kwargs = dict(src_key_padding_mask=torch.tensor([[False] * 4 + [True], [False] * 5])) if padded else {}
    expected = eager_no_grad(model, x, **kwargs)
    actual = compiled_no_grad(model)(x, **kwargs)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, expected, **tolerance(dtype, 4.0 if dtype == torch.bfloat16 else 1.0))


def test_encoder_fast_path_dynamic_lengths_and_empty():
    """One dynamic graph serves sequence lengths 5, 7 and 9 (eager's values each), and an
    empty batch returns an empty result as eager's layer does."""
    model = encoder()
    run = compiled_no_grad(model, dynamic=True)
    for seq in (5, 7, 9):
        x = torch.randn(2, seq, D)
        torch.testing.assert_close(run(x), eager_no_grad(model, x), **tolerance(torch.float32))
    empty = torch.randn(0, 4, D)
    out = compiled_no_grad(encoder())(empty)
    assert out.shape == empty.shape == eager_no_grad(model, empty).shape


def test_native_multi_head_attention_op():
    """`aten._native_multi_head_attention` (nn.MultiheadAttention's fused inference op) called
    directly: with and without the weights, averaged or per head, and mask types 0 ([T, T]),
    1 (key padding [B, T]) and 2 ([B, H, T, T]), bool and float, at float32."""
    torch.manual_seed(0)
    b, t = 2, 5
    x = torch.randn(b, t, D)
    w, bias = torch.randn(3 * D, D) / D ** 0.5, torch.randn(3 * D)
    pw, pb = torch.randn(D, D) / D ** 0.5, torch.randn(D)
    pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    attn = torch.rand(t, t) > 0.7
    attn.fill_diagonal_(False)
    full = torch.rand(b, HEADS, t, t) > 0.6
    full[..., 0] = False
    cases = [(None, None), (attn, 0), (pad, 1), (full, 2), (attn.float() * -2.0, 0)]
    for mask, mask_type in cases:
        for need, average in [(False, True), (True, True), (True, False)]:
            def fn(x, mask):
                return aten._native_multi_head_attention(x, x, x, D, HEADS, w, bias, pw, pb, mask, need, average,
                                                         mask_type)
            torch._dynamo.reset()
            expected = fn(x, mask)
            actual = torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})(x, mask)
            torch.testing.assert_close(actual[0], expected[0], **tolerance(torch.float32))
            if need:
                torch.testing.assert_close(actual[1], expected[1], **tolerance(torch.float32))
            else:
                assert actual[1].numel() == 0


def test_transformer_inference_and_multihead_attention():
    """nn.Transformer (2 + 2 layers, causal target mask, padded source and memory) in eval under no_grad,
    and nn.MultiheadAttention returning per-head weights, match eager at float32."""
    torch.manual_seed(0)
    model = torch.nn.Transformer(D, HEADS, 2, 2, FF, dropout=0.0, batch_first=True).eval()
    src, tgt = torch.randn(2, 7, D), torch.randn(2, 5, D)
    # The memory's padding masks the decoder's reads of it too: eager's encoder (nested tensors)
    # returns zeros at padded positions where Dynamo's trace (no nested tensors) computes them.
    pad = torch.tensor([[False] * 6 + [True], [False] * 7])
    kwargs = dict(tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(5), tgt_is_causal=True,
                  src_key_padding_mask=pad, memory_key_padding_mask=pad)
    torch.testing.assert_close(compiled_no_grad(model)(src, tgt, **kwargs), eager_no_grad(model, src, tgt, **kwargs),
                               **tolerance(torch.float32))
    mha = torch.nn.MultiheadAttention(D, HEADS, batch_first=True).eval()
    q, kv = torch.randn(2, 3, D), torch.randn(2, 6, D)
    expected = eager_no_grad(mha, q, kv, kv, average_attn_weights=False)
    actual = compiled_no_grad(mha)(q, kv, kv, average_attn_weights=False)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, **tolerance(torch.float32))


def test_encoder_training_step():
    """A training step through nn.TransformerEncoder (dropout off, causal mask and padding):
    loss and every parameter's gradient match eager's at float32."""
    model, twin = encoder(), encoder()
    model.train(), twin.train()
    x = torch.randn(3, 6, D)
    kwargs = masks(3, 6, torch.float32)["causal"]
    pad = torch.zeros(3, 6)
    pad[0, 4:] = float("-inf")  # float, as the causal mask (mixed mask types are deprecated)
    step = torch.compile(lambda x: model(x, src_key_padding_mask=pad, **kwargs).square().mean(), backend="fx2xla",
                         options={"fallback": "error"})
    loss = step(x)
    loss.backward()
    ref = twin(x, src_key_padding_mask=pad, **kwargs).square().mean()
    ref.backward()
    assert_loss_and_grads_close(loss, ref, model, twin)
