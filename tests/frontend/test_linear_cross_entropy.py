"""torch's chunked linear cross-entropy (`F.linear_cross_entropy(..., options=
torch.nn.LinearCrossEntropyOptions(...))`, fx2xla/lowering/losses.py) against eager: the loss and
the gradients for the input, the linear weight and the bias, compiled with fallback="error" so
that the op running eagerly fails the test.

Tolerances: float32 rtol 1e-4 / atol 1e-5 (losses and gradients); bfloat16 rtol 1.6e-2 / atol
1e-2 for losses and gradients relative to the largest element (eager rounds chunk sums in bf16
where XLA keeps float32).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fx2xla

Options = getattr(torch.nn, "LinearCrossEntropyOptions", None)
pytestmark = pytest.mark.skipif(Options is None, reason="torch has no chunked linear_cross_entropy (2.13+)")

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _inputs(dtype, bias, class_weights, rows=12, features=8, classes=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=g).to(dtype)
    w = torch.randn(classes, features, generator=g).to(dtype)
    b = torch.randn(classes, generator=g).to(dtype) if bias else None
    t = torch.randint(0, classes, (rows,), generator=g)
    if rows > 3:
        t[3] = -100  # ignored
    cw = torch.rand(classes, generator=g).to(dtype) if class_weights else None
    return x, w, b, t, cw


def _loss_and_grads(fn, x, w, b):
    leaves = [v.detach().clone().requires_grad_() for v in (x, w, b) if v is not None]
    out = fn(*leaves) if b is not None else fn(*leaves, None)
    loss = out.float().sum() if out.dim() else out
    grads = torch.autograd.grad(loss, leaves)
    return out.detach(), grads


def _close(actual, expected, dtype):
    if dtype == torch.bfloat16:  # relative to the largest element
        scale = expected.float().abs().max().item()
        torch.testing.assert_close(actual.float(), expected.float(), rtol=0, atol=1.6e-2 * scale + 1e-2,
                                   equal_nan=True)
    else:
        torch.testing.assert_close(actual, expected, equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias,class_weights,chunk", [(True, True, 5), (False, False, None), (True, False, 12)])
def test_chunked_linear_cross_entropy_matches_eager(dtype, reduction, bias, class_weights, chunk):
    """Loss (per row for "none", ignored rows 0) and the three gradients, as eager's."""
    x, w, b, t, cw = _inputs(dtype, bias, class_weights)
    options = Options(batch_chunk_size=chunk, allow_retain_graph=True)

    def fn(x, w, b):
        return F.linear_cross_entropy(x, w, t, linear_bias=b, weight=cw, reduction=reduction, ignore_index=-100,
                                      options=options)

    compiled = torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})
    out, grads = _loss_and_grads(compiled, x, w, b)
    ref, ref_grads = _loss_and_grads(fn, x, w, b)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    _close(out, ref, dtype)
    for a, e in zip(grads, ref_grads, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        _close(a, e, dtype)


@pytest.mark.parametrize("rows", [12, 0])
def test_every_row_ignored(rows):
    """Every target ignored, or no rows at all: mean is NaN (0 / 0), sum 0 and "none" one 0 per
    row, as eager's; the default ignore_index (None) ignores -100 too."""
    x, w, b, _, _ = _inputs(torch.float32, True, False, rows=rows)
    t = torch.full((rows,), -100)
    for reduction in ("mean", "sum", "none"):
        def fn(x, w, b):
            return F.linear_cross_entropy(x, w, t, linear_bias=b, reduction=reduction,
                                          options=Options(batch_chunk_size=5, allow_retain_graph=True))

        torch._dynamo.reset()
        out = torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})(x, w, b)
        expected = fn(x, w, b)
        assert out.shape == expected.shape
        torch.testing.assert_close(out, expected, equal_nan=True)
        if reduction != "none":
            assert out.isnan().item() == (reduction == "mean")


def test_target_out_of_range_raises():
    """A target that names no class raises fx2xla.IndexOutOfRangeError (eager: RuntimeError)."""
    x, w, b, t, _ = _inputs(torch.float32, True, False)
    t[0] = w.shape[0]

    def fn(x, w):
        return F.linear_cross_entropy(x, w, t, ignore_index=-100, options=Options(allow_retain_graph=True))

    with pytest.raises(RuntimeError, match="out of bounds"):
        fn(x, w)
    with pytest.raises(fx2xla.IndexOutOfRangeError, match="target"):
        torch.compile(fn, backend="fx2xla")(x, w)


class _Head(torch.nn.Module):
    """A language-model head whose loss is the chunked linear cross-entropy."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16), torch.nn.GELU())
        self.lm_head = torch.nn.Linear(16, 50)

    def forward(self, ids, labels):
        h = self.body(ids).reshape(-1, 16)
        return F.linear_cross_entropy(h, self.lm_head.weight, labels.reshape(-1), linear_bias=self.lm_head.bias,
                                      ignore_index=-100, options=Options(batch_chunk_size=8, allow_retain_graph=True))


def test_training_steps_match_eager():
    """Three AdamW steps of a small language model whose loss is the chunked op: losses and
    parameters after each step within float32 rtol 1e-3 / atol 1e-4 of eager's."""
    torch.manual_seed(0)
    model = _Head()
    twin = copy.deepcopy(model)
    ids, labels = torch.randint(0, 50, (4, 6)), torch.randint(0, 50, (4, 6))
    labels[0, :2] = -100
    step = torch.compile(model, backend="fx2xla", options={"fallback": "error"})
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin)]
    for i in range(3):
        losses = []
        for fn, opt in ((step, opts[0]), (twin, opts[1])):
            opt.zero_grad()
            loss = fn(ids, labels)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=1e-4, msg=f"loss at step {i}")
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4, msg=f"{name} after step {i}")
