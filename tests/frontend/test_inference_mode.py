"""Compiled graphs called under `torch.inference_mode()`, as servers often call models.

Inference tensors have no version counter, so fx2xla cannot see torch's writes to them: it
keeps no result twin for them (runtime/twins.py), imports an inference-tensor parameter again
on every call instead of keeping its device buffer, and installs a written inference tensor's
new contents by swapping its storage rather than writing in place (runtime/inplace.py).

Tolerances: float32 against eager PyTorch rtol 1e-4, atol 1e-5 (a linear layer and GELU);
elementwise updates exactly (rtol=atol=0)."""
from __future__ import annotations

import torch

import fx2xla

TOL = dict(rtol=1e-4, atol=1e-5)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla")


def test_a_model_under_inference_mode_matches_eager():
    """A model created outside inference mode and called inside it: outputs match eager's and
    are inference tensors, as eager's are, over several calls."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    run = _compiled(model)
    with torch.inference_mode():
        for _ in range(3):
            x = torch.randn(5, 8)
            out, ref = run(x), model(x)
            torch.testing.assert_close(out, ref, **TOL)
            assert out.is_inference() and ref.is_inference()


def test_an_output_written_by_torch_in_inference_mode_is_read_as_written():
    """A result that torch then writes in place (no version counter moves in inference mode)
    and passes back: the next call reads the written values, never the result as XLA left it."""
    def f(x):
        return x * 2 + 1

    run = _compiled(f)
    with torch.inference_mode():
        x = torch.arange(6.0)
        y = run(x)
        y.add_(100)  # invisible to any version counter
        torch.testing.assert_close(run(y), f(f(torch.arange(6.0)) + 100), rtol=0, atol=0)


def test_written_inputs_in_inference_mode():
    """A cache written by each call, created and written under inference mode: 4 calls match
    eager's values exactly, outputs and cache alike."""
    def f(cache, x):
        cache.add_(x)
        return cache * 2

    run = _compiled(f)
    with torch.inference_mode():
        cache, ref = torch.zeros(4, 3), torch.zeros(4, 3)
        for k in range(4):
            x = torch.full((4, 3), float(k + 1))
            torch.testing.assert_close(run(cache, x), f(ref, x), rtol=0, atol=0)
            torch.testing.assert_close(cache, ref, rtol=0, atol=0)


def test_parameters_created_in_inference_mode_are_read_each_call():
    """A model built inside inference mode (its parameters are inference tensors): a parameter
    written in place between calls (no version moves) is read with its new values."""
    torch.manual_seed(0)
    with torch.inference_mode():
        model = torch.nn.Linear(8, 4).eval()
        run = _compiled(model)
        x = torch.randn(3, 8)
        torch.testing.assert_close(run(x), model(x), **TOL)
        model.weight.mul_(-2)
        model.bias.add_(1)
        torch.testing.assert_close(run(x), model(x), **TOL)


def test_scan_layers_runs_eagerly_in_inference_mode():
    """`fx2xla.scan_layers` called eagerly inside inference mode (its stacked buffers, batch
    norm's running statistics, are inference tensors) matches the Python loop over the layers."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 8)).eval() for _ in range(3)]
    for layer in layers:  # buffers with values of their own
        layer[0].running_mean.uniform_(-1, 1)
        layer[0].running_var.uniform_(0.5, 2)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        expected = x
        for layer in layers:
            expected = layer(expected)
        torch.testing.assert_close(fx2xla.scan_layers(layers, x), expected, **TOL)
