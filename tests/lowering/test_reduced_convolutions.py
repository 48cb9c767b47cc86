"""bf16 and float16 convolutions on the CPU go to torch's kernels only where the CPU has
instructions for those dtypes (fx2xla/torch_kernels.py: convolution_dtypes); elsewhere XLA
computes them (in float32, rounded once), several times faster than oneDNN's slow path.

What these tests hold it to:
- the CPU check's two paths (torch's private predicates, and Linux's /proc/cpuinfo flags where
  those are missing) agree, and the public one runs when the private ones are gone;
- by default, a bf16 or float16 convolution model's inference graph and training graphs hold
  torch's convolution calls exactly where the CPU has those instructions, and float32's always;
- `reduced_convolutions(False)` / `(True)` send them to XLA's / torch's either way, and float32
  convolutions stay torch's;
- each way matches eager: outputs within rtol/atol 8e-3 relative to the largest output (bf16
  and float16: one rounding of a float32 sum on either side), a training step's loss and
  gradients within conftest's tolerance for the dtype, loosened 4x;
- weights are pinned for packing only where the convolution is torch's;
- `status()` says which kernels each dtype's convolutions run in."""
from __future__ import annotations

import copy
import gc
import os

import pytest
import torch

from fx2xla import torch_kernels
from fx2xla.metrics import live_graphs

from tests.conftest import tolerance

pytestmark = pytest.mark.skipif(not torch_kernels.available(), reason=torch_kernels.status())

TARGET = "@fx2xla_torch_convolution("
BACKWARD = "@fx2xla_torch_convolution_backward("
REDUCED = [torch.bfloat16, torch.float16]
OUT_TOL = dict(rtol=8e-3, atol=8e-3)


@pytest.fixture(autouse=True)
def _collected():
    # (conftest resets Dynamo around each test.) Executors left in reference cycles by earlier
    # tests are collected now, so that none unpins a weight while a test counts pins.
    gc.collect()


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 4, 3, stride=2, groups=2), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 5 * 5, 5)).to(dtype)


def _new_texts(before) -> list[str]:
    return [g.static.lowered.module_text for g in sorted(live_graphs, key=lambda g: g.name) if id(g) not in before]


def _inference(dtype):
    """The model compiled for inference: (its output, eager's, the new graphs' StableHLO, the
    new graphs)."""
    model = _model(dtype).eval()
    x = torch.randn(4, 3, 12, 12, dtype=dtype)
    before = {id(g) for g in live_graphs}
    with torch.no_grad():
        out = torch.compile(model, backend="fx2xla")(x)
        ref = model(x)
    graphs = [g for g in live_graphs if id(g) not in before]
    return out, ref, _new_texts(before), graphs


def _close_to_largest(out, ref):
    scale = ref.abs().max().float().item()
    torch.testing.assert_close(out.float() / scale, ref.float() / scale, **OUT_TOL)


def _training(dtype):
    """One training step compiled (forward and backward): the new graphs' StableHLO, after
    checking the loss and every gradient against eager's."""
    model = _model(dtype)
    twin = copy.deepcopy(model)
    x = torch.randn(4, 3, 12, 12, dtype=dtype, requires_grad=True)

    def step(m, x):
        return m(x).float().square().mean()

    before = {id(g) for g in live_graphs}
    loss = torch.compile(step, backend="fx2xla")(model, x)
    loss.backward()
    texts = _new_texts(before)
    x_ref = x.detach().clone().requires_grad_()
    ref = step(twin, x_ref)
    ref.backward()
    tol = tolerance(dtype, 4)
    torch.testing.assert_close(loss, ref, **tolerance(torch.float32, 4))
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)
    return texts


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_cpu_check_paths_agree(dtype, monkeypatch, tmp_path):
    """torch's predicates and /proc/cpuinfo's flags say the same of this CPU; with the private
    predicates gone, the check reads the flags: a CPU that lists the dtype's flag has it, one
    that does not, or a missing file, does not."""
    if os.path.exists("/proc/cpuinfo"):
        assert torch_kernels.cpu_has_instructions(dtype) == torch_kernels.cpu_has_instructions(dtype, ask_torch=False)
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    monkeypatch.setattr(torch.ops, "mkldnn", object())
    flag = {torch.bfloat16: "avx512_bf16", torch.float16: "avx512_fp16"}[dtype]
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: fpu avx2 fma {flag} avx512f\n\nprocessor\t: 1\n")
    assert torch_kernels.cpu_has_instructions(dtype, cpuinfo=info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f\n")
    assert not torch_kernels.cpu_has_instructions(dtype, cpuinfo=info)
    info.unlink()
    assert not torch_kernels.cpu_has_instructions(dtype, cpuinfo=info)


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_default_follows_the_cpu(dtype):
    """By default the model's convolutions, forward and backward, are torch's exactly where this
    CPU has instructions for `dtype`, and every result matches eager's."""
    native = torch_kernels.cpu_has_instructions(dtype)
    assert (dtype in torch_kernels.convolution_dtypes()) == native
    out, ref, texts, _ = _inference(dtype)
    _close_to_largest(out, ref)
    assert len(texts) == 1 and texts[0].count(TARGET) == (2 if native else 0), texts
    texts = _training(dtype)
    assert sum(t.count(TARGET) for t in texts) == (2 if native else 0)
    assert sum(t.count(BACKWARD) for t in texts) == (2 if native else 0)


@pytest.mark.parametrize("on", [False, True], ids=["xla", "torch"])
@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_override(dtype, on):
    """reduced_convolutions(on) sends bf16/float16 convolutions to torch's kernels (True) or
    XLA's (False) whatever the CPU, forward and backward, with eager's results either way; the
    setting comes back after the block."""
    previous = torch_kernels.set_reduced_convolutions(None)
    try:
        with torch_kernels.reduced_convolutions(on):
            assert (dtype in torch_kernels.convolution_dtypes()) == on
            out, ref, texts, _ = _inference(dtype)
            _close_to_largest(out, ref)
            assert texts[0].count(TARGET) == (2 if on else 0), texts
            texts = _training(dtype)
            assert sum(t.count(TARGET) for t in texts) == (2 if on else 0)
            assert sum(t.count(BACKWARD) for t in texts) == (2 if on else 0)
        assert torch_kernels.set_reduced_convolutions(None) is None
    finally:
        torch_kernels.set_reduced_convolutions(previous)


def test_float32_stays_torchs():
    """With reduced-precision convolutions sent to XLA, float32 ones are still torch's."""
    with torch_kernels.reduced_convolutions(False):
        out, ref, texts, _ = _inference(torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert texts[0].count(TARGET) == 2


@pytest.mark.parametrize("on", [False, True], ids=["xla", "torch"])
def test_pins_only_for_torchs_convolutions(on):
    """A bf16 inference graph pins its convolution weights for packing only where the
    convolution is torch's; the output matches eager's either way."""
    before = torch_kernels.packing_counts()["pinned"]
    with torch_kernels.reduced_convolutions(on):
        out, ref, _, graphs = _inference(torch.bfloat16)
        _close_to_largest(out, ref)
        assert len(graphs) == 1
        pinned = [p for p in graphs[0].plan.inputs if p.pinned]
        assert len(pinned) == (2 if on else 0)
        assert torch_kernels.packing_counts()["pinned"] - before == (2 if on else 0)


def test_status_names_each_dtypes_kernels():
    """status() says which kernels bf16 and float16 convolutions run in."""
    with torch_kernels.reduced_convolutions(False):
        assert "bfloat16 XLA's, float16 XLA's" in torch_kernels.status()
    with torch_kernels.reduced_convolutions(True):
        assert "bfloat16 torch's, float16 torch's" in torch_kernels.status()
