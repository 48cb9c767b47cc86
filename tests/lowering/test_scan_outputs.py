"""Loop outputs written into unfilled buffers (lowering/control_flow.py `_scan_into_buffers`,
kernel library `fx2xla_uninitialized`, torch_kernels kind "scan_outputs").

On the CPU a scan's stacked per-iteration outputs go into buffers the library allocates and
leaves unfilled, each iteration writing its slice, instead of jax's scan zero-filling them
first. What these tests hold it to:
- per-step outputs of float32, int64, bool and bf16, forwards and in reverse, are bit for bit
  those of jax's scan (the kind left out of the option), and eager's (float32 at conftest's
  tolerance, rtol 1e-4 / atol 1e-5; int64 and bool exactly; bf16 at its tolerance, rtol 1.6e-2 /
  atol 1e-2); the module holds one unfilled buffer per stacked output, and none without the
  kind;
- a loop with no per-step output allocates none;
- a folded training step (forward and backward loops, whose saved activations and gradient
  stacks are such outputs) gives eager's loss and gradients at the float32 tolerance, with
  unfilled buffers in both graphs."""
from __future__ import annotations

import copy

import pytest
import torch

import fx2xla
from fx2xla import torch_kernels
from fx2xla.metrics import live_graphs

from tests.conftest import assert_loss_and_grads_close, tolerance

pytestmark = pytest.mark.skipif(not torch_kernels.available("matmul"), reason=torch_kernels.status())

TARGET = 'custom_call_target="fx2xla_uninitialized"'
WITHOUT = [k for k in torch_kernels.KINDS if k != "scan_outputs"]


def _texts(before: set) -> list[str]:
    return ["\n".join(m.to_string() for m in g.static.exe.hlo_modules())
            for g in live_graphs if id(g) not in before and g.static is not None]


def step(h, x):
    h = torch.tanh(h * 0.9 + x)
    return h, (h * 2, (h > 0).sum(-1), h.to(torch.bfloat16), h.argmax(-1))


def run(h, xs, reverse):
    return fx2xla.scan(step, h, xs, reverse=reverse)


@pytest.mark.parametrize("reverse", [False, True])
def test_outputs_fill_unfilled_buffers_bit_for_bit(reverse):
    torch.manual_seed(0)
    h, xs = torch.randn(4, 16), torch.randn(6, 4, 16)
    results, texts = {}, {}
    for name, options in (("unfilled", {}), ("zeroed", {"torch_kernels": WITHOUT})):
        torch._dynamo.reset()
        before = set(map(id, live_graphs))
        results[name] = torch.compile(run, backend="fx2xla", fullgraph=True, options=options)(h, xs, reverse)
        texts[name] = "\n".join(_texts(before))
    want = run(h, xs, reverse)  # eager: fx2xla.scan's Python loop
    got_final, got_ys = results["unfilled"]
    zero_final, zero_ys = results["zeroed"]
    assert torch.equal(got_final, zero_final)
    for g, z in zip(got_ys, zero_ys):
        assert g.dtype == z.dtype and torch.equal(g, z)
    torch.testing.assert_close(got_final, want[0], **tolerance(torch.float32))
    for g, w in zip(got_ys, want[1]):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, **tolerance(w.dtype))
    assert texts["unfilled"].count(TARGET) == 4
    assert TARGET not in texts["zeroed"]


def test_loop_without_per_step_outputs_allocates_none():
    def only_carry(h, xs):
        return fx2xla.scan(lambda c, x: (c + x.sum(0), None), h, xs)[0]

    h, xs = torch.randn(3), torch.randn(5, 2, 3)
    torch._dynamo.reset()
    before = set(map(id, live_graphs))
    got = torch.compile(only_carry, backend="fx2xla", fullgraph=True)(h, xs)
    torch.testing.assert_close(got, only_carry(h, xs), **tolerance(torch.float32))
    assert TARGET not in "\n".join(_texts(before))


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(x))


class Stack(torch.nn.Module):
    def __init__(self, layers: int = 8, width: int = 64):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_folded_training_step_with_unfilled_buffers_matches_eager():
    torch.manual_seed(0)
    model = Stack()
    twin = copy.deepcopy(model)
    x = torch.randn(16, 64)
    torch._dynamo.reset()
    before = set(map(id, live_graphs))
    loss = torch.compile(model, backend="fx2xla", fullgraph=True)(x).square().mean()
    loss.backward()
    ref = twin(x).square().mean()
    ref.backward()
    assert_loss_and_grads_close(loss, ref, model, twin)
    texts = _texts(before)
    assert len(texts) == 2 and all(TARGET in t for t in texts)  # forward and backward
