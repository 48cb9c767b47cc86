"""bf16 and float16 convolutions on the CPU go to torch's kernels everywhere. Where the CPU has
instructions for the dtype they compute in it; elsewhere they are widened: torch's float32
kernel computes them, their inputs converted exactly and the result rounded once
(fx2xla/torch_kernels.py: convolution_dtype), several times faster than oneDNN's slow path.

What these tests hold it to:
- the CPU check's two paths (torch's private predicates, and Linux's /proc/cpuinfo flags where
  those are missing) agree, and the public one runs when the private ones are gone;
- by default, a bf16 or float16 convolution model's inference graph and training graphs call
  torch's convolution forward and backward in the dtype where the CPU has those instructions,
  and in float32 elsewhere; float32's are float32 always;
- `reduced_convolutions(True)` / `(False)` compute them in their dtype / widened either way,
  and float32 convolutions are unaffected;
- each way matches eager: outputs within rtol/atol 8e-3 relative to the largest output (bf16
  and float16: one rounding of a float32 sum on either side), a training step's loss and
  gradients within conftest's tolerance for the dtype, loosened 4x;
- widened results equal XLA's own convolution's (`torch_kernels=False`: also a float32 sum
  rounded once) within one rounding: rtol 2**-7 (bf16) / 2**-10 (float16) of the largest output;
- weights are pinned either way; widened, they are packed (from the bf16 weights, for the
  float32 calls) and packed calls run, and a weight changed in place is packed again; the result
  follows eager's throughout;
- four threads calling a widened convolution whose weight is an argument (not pinned: each call
  converts it once, its slices sharing the copy) get the same bits as one thread;
- `status()` says which dtype each convolution computes in."""
from __future__ import annotations

import copy
import gc
import os

import pytest
import torch

from fx2xla import torch_kernels
from fx2xla.metrics import live_graphs

from tests.conftest import calls_in_threads, tolerance

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


def _call_dtypes(text: str, target: str) -> list[str]:
    """The element type of each `target` call's (last) result in `text`."""
    calls = [line for line in text.splitlines() if target in line]
    return [line.rsplit("-> ", 1)[1].split("x")[-1].rstrip(">)").split(">")[0] for line in calls]


def _jax_name(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_default_follows_the_cpu(dtype):
    """By default the model's convolutions, forward and backward, are torch's, computed in
    `dtype` exactly where this CPU has instructions for it and in float32 elsewhere, and every
    result matches eager's."""
    native = torch_kernels.cpu_has_instructions(dtype)
    assert (dtype in torch_kernels.convolution_dtypes()) == native
    compute = dtype if native else torch.float32
    assert torch_kernels.convolution_dtype(dtype) is compute
    out, ref, texts, _ = _inference(dtype)
    _close_to_largest(out, ref)
    assert len(texts) == 1 and _call_dtypes(texts[0], TARGET) == [_jax_name(compute)] * 2, texts
    texts = _training(dtype)
    assert sum((_call_dtypes(t, TARGET) for t in texts), []) == [_jax_name(compute)] * 2
    assert sum((_call_dtypes(t, BACKWARD) for t in texts), []) == [_jax_name(compute)] * 2


@pytest.mark.parametrize("on", [False, True], ids=["widened", "native"])
@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_override(dtype, on):
    """reduced_convolutions(on) computes bf16/float16 convolutions in their dtype (True) or in
    float32 (False) whatever the CPU, forward and backward, with eager's results either way; the
    setting comes back after the block."""
    previous = torch_kernels.set_reduced_convolutions(None)
    compute = _jax_name(dtype if on else torch.float32)
    try:
        with torch_kernels.reduced_convolutions(on):
            assert (dtype in torch_kernels.convolution_dtypes()) == on
            out, ref, texts, _ = _inference(dtype)
            _close_to_largest(out, ref)
            assert _call_dtypes(texts[0], TARGET) == [compute] * 2, texts
            texts = _training(dtype)
            assert sum((_call_dtypes(t, TARGET) for t in texts), []) == [compute] * 2
            assert sum((_call_dtypes(t, BACKWARD) for t in texts), []) == [compute] * 2
        assert torch_kernels.set_reduced_convolutions(None) is None
    finally:
        torch_kernels.set_reduced_convolutions(previous)


def test_float32_unaffected():
    """With reduced-precision convolutions widened, float32 ones are torch's float32 ones, as
    ever."""
    with torch_kernels.reduced_convolutions(False):
        assert torch_kernels.convolution_dtype(torch.float32) is torch.float32
        assert torch_kernels.convolution_dtype(torch.int64) is None
        out, ref, texts, _ = _inference(torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert _call_dtypes(texts[0], TARGET) == ["f32"] * 2


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_widened_equals_xlas_within_one_rounding(dtype):
    """A widened convolution model and the same model on XLA's own convolutions (both sum in
    float32 and round once) agree within one rounding of the largest output."""
    torch.manual_seed(0)
    model = _model(dtype).eval()
    x = torch.randn(4, 3, 12, 12, dtype=dtype)
    with torch.no_grad(), torch_kernels.reduced_convolutions(False):
        widened = torch.compile(model, backend="fx2xla")(x)
        xla = torch.compile(copy.deepcopy(model), backend="fx2xla", options={"torch_kernels": False})(x)
    scale = xla.abs().max().float().item()
    tol = 2.0 ** (-7 if dtype is torch.bfloat16 else -10)
    torch.testing.assert_close(widened.float() / scale, xla.float() / scale, rtol=tol, atol=tol)


@pytest.mark.parametrize("on", [False, True], ids=["widened", "native"])
def test_pins_and_packs_either_way(on):
    """A bf16 inference graph pins its convolution weights for packing whether the convolution
    is widened or not; widened, packs are made (from the bf16 weights, for the float32 calls)
    and packed calls run, and a weight changed in place is packed again; the output matches
    eager's throughout."""
    before = torch_kernels.packing_counts()
    with torch_kernels.reduced_convolutions(on):
        torch.manual_seed(0)
        model = _model(torch.bfloat16).eval()
        x = torch.randn(8, 3, 12, 12, dtype=torch.bfloat16)
        graphs_before = {id(g) for g in live_graphs}
        compiled = torch.compile(model, backend="fx2xla")
        with torch.no_grad():
            _close_to_largest(compiled(x), model(x))
            graphs = [g for g in live_graphs if id(g) not in graphs_before]
            assert len(graphs) == 1
            assert sum(p.pinned for p in graphs[0].plan.inputs) == 2
            after = torch_kernels.packing_counts()
            assert after["pinned"] - before["pinned"] == 2
            if not on:  # float32 packs: oneDNN's packed path takes every float32 shape here
                assert after["packs"] > before["packs"]
                assert after["packed_calls"] > before["packed_calls"]
            model[0].weight.mul_(-2.0)
            _close_to_largest(compiled(x), model(x))
            if not on:
                assert torch_kernels.packing_counts()["packs"] > after["packs"]


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_widened_from_many_threads(dtype):
    """Four threads, 10 calls each, of a widened convolution whose weight is an argument (never
    pinned, so each call converts it once and its batch slices share the copy) get the bits one
    thread gets, and eager's results within the module's tolerance."""
    def conv(x, w, b):
        return torch.nn.functional.conv2d(x, w, b, padding=1).relu()

    torch.manual_seed(0)
    w, b = torch.randn(16, 8, 3, 3, dtype=dtype) / 5, torch.randn(16, dtype=dtype)
    inputs = [torch.randn(8, 8, 10, 10, dtype=dtype) for _ in range(4)]
    with torch_kernels.reduced_convolutions(False):
        compiled = torch.compile(conv, backend="fx2xla")
        with torch.no_grad():
            alone = [compiled(x, w, b) for x in inputs]
        results = calls_in_threads(lambda x: compiled(x, w, b), inputs, calls=10)
    for i, outs in results.items():
        _close_to_largest(alone[i], conv(inputs[i], w, b))
        for out in outs:
            torch.testing.assert_close(out, alone[i], rtol=0, atol=0)


def test_status_names_each_dtypes_kernels():
    """status() says which dtype bf16 and float16 convolutions compute in."""
    with torch_kernels.reduced_convolutions(False):
        assert "bfloat16 in float32, float16 in float32" in torch_kernels.status()
    with torch_kernels.reduced_convolutions(True):
        assert "bfloat16 in bfloat16, float16 in float16" in torch_kernels.status()
