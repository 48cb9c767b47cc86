"""Channels-last values between convolutions on the CPU (fx2xla/lowering/channels_last.py).

Every model here runs with the layout on (the default), with FX2XLA_CHANNELS_LAST=0 and with
options={"channels_last": False}, and matches eager each way, at tests/conftest.py's rtol per
dtype (float32 1e-4, bfloat16 1.6e-2): outputs within that rtol and an atol of rtol x their
largest magnitude; input and parameter gradients within 10x that rtol and an atol of 10x rtol
x the largest gradient magnitude (the input's, or the model's over all parameters: each element
is a sum of many large terms, in another order than eager's, and the bias of a convolution
batch norm follows has a gradient of zero up to rounding); batch norm's running statistics at
conftest's tolerance (float32 atol 1e-5, bfloat16 1e-2). bfloat16 gradients are compared with
a float64 copy's instead (the bf16 test says how).

The ops covered on NHWC values: pointwise ops with operands of 0 to 4 dims (a per-channel
[C, 1, 1], a trailing [W], a 0-d tensor, a Python scalar, a bool mask, a dtype cast), batch
norm in training and eval, max pooling (windows that tile the input; stride, padding and
dilation; ceil_mode) with its backward, and reductions over dim lists (kept dims; dropped dims
whose order NHWC keeps; dropped dims whose order it does not, which read NCHW), and
concatenation along channels with the slices of its backward, and average pooling with its
backward (the Shapes model).

Under Dynamo a training step's forward leaves its activations channels-last and the backward's
executable takes them NHWC (AOTAutograd hands it the strides fx2xla reported); with
FX2XLA_PUBLIC_STRIDES=1, or the backend called without Dynamo (no tracing context to report
strides to), they leave in torch's layout. An inference graph imports its convolution weights
channels-last once while they are unchanged, and again after they change. Turned off, nothing
is planned channels-last; a user's channels-last input is read as it is. Four threads calling
one compiled CNN get eager's results."""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.nn.functional as F

import fx2xla
from fx2xla.metrics import live_graphs
from fx2xla.testing import SmallCNN

from tests.conftest import calls_in_threads, tolerance


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["on", "env-off", "option-off"])
def layout(request, monkeypatch):
    """The backend's options for each way: on, off by FX2XLA_CHANNELS_LAST=0, off by option."""
    if request.param == "env-off":
        monkeypatch.setenv("FX2XLA_CHANNELS_LAST", "0")
    return {"channels_last": False} if request.param == "option-off" else None


class Mixed(torch.nn.Module):
    """Convolutions with every kind of op the layout covers between them."""

    def __init__(self, pool: dict, c: int = 8, w: int = 16):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(c)
        self.pool = torch.nn.MaxPool2d(**pool)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)  # batch norm follows
        self.bn2 = torch.nn.BatchNorm2d(c)
        self.scale = torch.nn.Parameter(torch.randn(c, 1, 1))
        self.conv3 = torch.nn.Conv2d(c, c, 1)
        self.w = w

    def forward(self, x):
        y = self.pool(F.relu(self.bn1(self.conv1(x))))
        z = self.bn2(self.conv2(y))
        shift = torch.linspace(-1, 1, z.shape[-1], dtype=z.dtype)  # broadcast along W
        z = z * self.scale + shift + torch.tensor(0.5, dtype=z.dtype)
        z = torch.where(z > 0, z, 0.1 * z)
        z = torch.sigmoid(z).to(torch.float32).to(z.dtype) + y  # a cast, a residual
        z = self.conv3(z.clamp(-2, 2))
        stats = z.sum(dim=(0, 2, 3)) + z.amax(dim=1).mean() + z.sum(dim=2).mean()
        pooled = z.mean(dim=(2, 3), keepdim=True).flatten(1)
        return pooled * stats


class Tupled(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return (self.inner(x),)


POOLS = {
    "tiled": dict(kernel_size=2, stride=2),
    "strided": dict(kernel_size=3, stride=2, padding=1),
    "dilated": dict(kernel_size=2, stride=1, dilation=2, ceil_mode=True),
}


def _train_step(model, x):
    out = model(x)
    out.square().sum().backward()
    return out


def _compare(model, ref, x, dtype, train: bool, options=None):
    x_ref = x.detach().clone().requires_grad_(train)
    x_fx = x.detach().clone().requires_grad_(train)
    compiled = torch.compile(model, backend="fx2xla", options=options)
    if train:
        out, expected = _train_step(compiled, x_fx), _train_step(ref, x_ref)
    else:
        with torch.no_grad():
            out, expected = compiled(x_fx), ref(x_ref)
    _close(out, expected, dtype, "output", loosen=1)
    if train:
        _close(x_fx.grad, x_ref.grad, dtype, "input")
        _close_parameter_grads(model, ref, dtype)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, **tolerance(dtype), msg=lambda m, name=name: f"{name}: {m}")


def _close(value, expected, dtype, name: str, scale: float | None = None, loosen: float = 10) -> None:
    """`value` within rtol x `loosen` of eager's, and within rtol x `loosen` x `scale` (its
    largest magnitude unless given) elementwise: its elements are sums of many large terms, in
    another order than eager's."""
    rtol = tolerance(dtype)["rtol"]
    scale = float(expected.detach().abs().max()) if scale is None else scale
    torch.testing.assert_close(value, expected, rtol=loosen * rtol, atol=loosen * rtol * scale,
                               msg=lambda m: f"{name}: {m}")


def _close_parameter_grads(model, ref, dtype) -> None:
    """Every parameter's gradient against eager's, at the scale of the model's largest: the bias
    of a convolution that batch norm follows has a gradient of zero up to rounding."""
    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.grad, q.grad, dtype, name, scale)


def _on(options) -> bool:
    return options is None and os.environ.get("FX2XLA_CHANNELS_LAST") != "0"


def _graphs_since(before: set) -> list:
    return sorted((g for g in live_graphs if id(g) not in before), key=lambda g: g.name)


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_mixed_model_matches_eager(pool, train, layout):
    """Every op kind between convolutions, forward and backward, equals eager with the layout
    on and off; with it on, the graphs plan channels-last values."""
    torch.manual_seed(0)
    model = Mixed(POOLS[pool]).train(train)
    ref = copy.deepcopy(model)
    before = {id(g) for g in live_graphs}
    _compare(model, ref, torch.randn(4, 3, 16, 16), torch.float32, train, layout)
    laid = [len(g.plan.channels_last.nodes) for g in _graphs_since(before)]
    assert laid and (all(laid) if _on(layout) else not any(laid)), laid


class Shapes(torch.nn.Module):
    """Convolution forms and the ops around them (concatenation, upsampling, which reads NCHW
    values, average pooling with and without padding counted, a flatten): grouped and
    depthwise, strided, transposed."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(8)
        self.depthwise = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.grouped = torch.nn.Conv2d(8, 16, 1, groups=2)
        self.up = torch.nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.head = torch.nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x):
        y = F.relu6(self.bn(self.stem(x)))
        z = F.hardswish(self.grouped(self.depthwise(y) + y))
        u = self.up(z)  # back to the stem's input size
        cat = torch.cat([u, F.interpolate(y, scale_factor=2.0, mode="nearest")], dim=1)
        h = self.head(cat)
        h = F.avg_pool2d(h, 2) + F.avg_pool2d(h, 3, stride=2, padding=1, count_include_pad=False)
        return h.flatten(1)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_convolution_forms_match_eager(train, layout):
    """Grouped, depthwise, strided and transposed convolutions, with ops that read NCHW values
    between them, equal eager forward and backward; the concatenation along channels and the
    average pooling (and, in training, their backward's slices and pooling) run on NHWC values
    when the layout is on."""
    torch.manual_seed(0)
    model = Shapes().train(train)
    before = {id(g) for g in live_graphs}
    _compare(model, copy.deepcopy(model), torch.randn(2, 3, 16, 16), torch.float32, train, layout)
    laid = {n.target for g in _graphs_since(before) for n in g.plan.channels_last.nodes}
    covered = {torch.ops.aten.cat.default, torch.ops.aten.avg_pool2d.default}
    if train:
        covered |= {torch.ops.aten.slice.Tensor, torch.ops.aten.avg_pool2d_backward.default}
    assert covered <= laid if _on(layout) else not laid, laid


def test_resnet_training_step_matches_eager(layout):
    """A transformers ResNet (basic blocks: residual adds, strided downsampling convolutions,
    batch norm, max pooling, adaptive average pooling), one training step against eager."""
    from fx2xla.testing import ImageLogits, resnet

    torch.manual_seed(0)
    model = ImageLogits(resnet(hidden=(8, 16, 16, 32), depths=(1, 1, 1, 1)))
    _compare(model, copy.deepcopy(model), torch.randn(2, 3, 32, 32), torch.float32, True, layout)


def test_inference_weights_are_imported_channels_last_and_follow_changes(layout):
    """An inference graph takes each convolution weight (a parameter read by convolutions only)
    channels-last, converted once when imported: the results equal eager's, before and after
    the weights change in place (the next call imports the new values), and after a weight is
    replaced. A weight read elsewhere too stays as it is, and training graphs convert none."""
    from fx2xla.plan import InputKind

    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(2, 3, 32, 32)
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla", options=layout)
    with torch.no_grad():
        _close(compiled(x), model(x), torch.float32, "output", loosen=1)
        (graph,) = _graphs_since(before)
        relaid = sum(p.kind is InputKind.RELAID and p.perm == (0, 2, 3, 1) for p in graph.plan.inputs)
        assert relaid == (3 if _on(layout) else 0), graph.plan.inputs
        model.features[0].weight.mul_(-2.0)  # in place: the version moves
        _close(compiled(x), model(x), torch.float32, "output after an in-place change", loosen=1)
        model.features[4].weight = torch.nn.Parameter(torch.randn_like(model.features[4].weight))
        _close(compiled(x), model(x), torch.float32, "output after a new weight", loosen=1)


def test_threads_share_one_compiled_cnn():
    """Four threads calling one compiled ResNet (channels-last values and weights) at once, 5
    calls each on inputs of their own, get eager's results."""
    from fx2xla.testing import ImageLogits, resnet

    torch.manual_seed(0)
    model = ImageLogits(resnet(hidden=(8, 16, 16, 32), depths=(1, 1, 1, 1))).eval()
    compiled = torch.compile(model, backend="fx2xla")
    inputs = [torch.randn(2, 3, 32, 32) for _ in range(4)]
    with torch.no_grad():
        compiled(inputs[0])  # compiled once, before the threads
        expected = [model(x) for x in inputs]
    results = calls_in_threads(compiled, inputs, calls=5)
    for i, outs in results.items():
        for out in outs:
            _close(out, expected[i], torch.float32, f"thread {i}", loosen=1)


class SharedWeight(torch.nn.Module):
    """A weight a convolution reads, and a sum reads too."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x) + self.conv.weight.sum()


def test_weight_read_elsewhere_is_not_relaid():
    from fx2xla.plan import InputKind

    torch.manual_seed(0)
    model = SharedWeight().eval()
    x = torch.randn(2, 3, 8, 8)
    before = {id(g) for g in live_graphs}
    with torch.no_grad():
        _close(torch.compile(model, backend="fx2xla")(x), model(x), torch.float32, "output", loosen=1)
    (graph,) = _graphs_since(before)
    assert not any(p.kind is InputKind.RELAID for p in graph.plan.inputs)


def test_training_graphs_do_not_relay_weights():
    from fx2xla.plan import InputKind

    torch.manual_seed(0)
    model = SmallCNN()
    before = {id(g) for g in live_graphs}
    _compare(model, copy.deepcopy(model), torch.randn(2, 3, 32, 32), torch.float32, True)
    assert not any(p.kind is InputKind.RELAID for g in _graphs_since(before) for p in g.plan.inputs)


def test_bf16_model_matches_eager(layout):
    """A bfloat16 SmallCNN: outputs and running statistics of a training step match eager's at
    bfloat16's tolerance, and so do its eval outputs. Its gradients are compared with a float64
    copy's instead: through batch norm, bfloat16 gradients are off by 10-45% of their largest
    magnitude in eager too; fx2xla's error must stay within 2x eager's + 2e-2 (both relative to
    the model's largest gradient)."""
    torch.manual_seed(0)
    model = SmallCNN().to(torch.bfloat16)
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(4, 3, 32, 32, dtype=torch.bfloat16)
    compiled = torch.compile(model, backend="fx2xla", options=layout)
    out, expected, exact = (_train_step(m, v) for m, v in ((compiled, x), (ref, x), (ref64, x.double())))
    _close(out, expected, torch.bfloat16, "output", loosen=1)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, **tolerance(torch.bfloat16), msg=lambda m, name=name: f"{name}: {m}")
    scale = max(float(p.grad.abs().max()) for p in ref64.parameters())
    for (name, p), q, r in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
        ours, eager = (float((g.grad.double() - r.grad).abs().max()) / scale for g in (p, q))
        assert ours <= 2 * eager + 2e-2, (name, ours, eager)
    torch._dynamo.reset()
    with torch.no_grad():
        _close(torch.compile(model.eval(), backend="fx2xla", options=layout)(x), ref.eval()(x), torch.bfloat16,
               "eval output", loosen=1)


def test_channels_last_input(layout):
    """A channels-last input (as a user may pass one) reads as it is, in inference and training."""
    torch.manual_seed(0)
    model = Mixed(POOLS["strided"])
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    ref = copy.deepcopy(model)
    _compare(model, ref, x, torch.float32, True, layout)
    torch._dynamo.reset()
    _compare(model.eval(), ref.eval(), x, torch.float32, False, layout)


def _nhwc_arguments(text: str, n: int, c: int, h: int, w: int) -> int:
    """How many of a module's main arguments are [n, h, w, c] float32 (NHWC activations)."""
    main = re.search(r"func\.func public @main\((.*?)\)\s*->", text, re.S).group(1)
    return len(re.findall(rf"tensor<{n}x{h}x{w}x{c}xf32>", main))


def test_training_activations_cross_to_the_backward_channels_last(layout):
    """Under Dynamo, the activations a training step's forward saves for its backward leave the
    executable NHWC (their torch strides channels-last) and the backward's executable takes
    them so; turned off, they leave NCHW. Gradients equal eager's either way."""
    torch.manual_seed(0)
    model = SmallCNN()
    ref = copy.deepcopy(model)
    before = {id(g) for g in live_graphs}
    _compare(model, ref, torch.randn(4, 3, 32, 32), torch.float32, True, layout)
    graphs = _graphs_since(before)
    forward = next(g for g in graphs if g.name.endswith("forward"))
    backward = next(g for g in graphs if g.name.endswith("backward"))
    # conv1's output and its ReLU: [4, 16, 32, 32] as NHWC.
    taken = _nhwc_arguments(backward.static.lowered.module_text, 4, 16, 32, 32)
    if _on(layout):
        assert taken >= 2, backward.static.lowered.module_text[:2000]
        assert any(o.inv_perm == (0, 3, 1, 2) for o in forward.plan.outputs)
    else:
        assert taken == 0
        assert not any(o.inv_perm == (0, 3, 1, 2) for o in forward.plan.outputs)


def test_public_fallback_keeps_torch_strides(monkeypatch):
    """FX2XLA_PUBLIC_STRIDES=1 (the public path beside AOTAutograd's private stride report):
    the forward's activations leave in torch's layout, the backward takes them NCHW, values are
    still channels-last inside each graph, and the step equals eager."""
    monkeypatch.setenv("FX2XLA_PUBLIC_STRIDES", "1")
    torch.manual_seed(0)
    model = SmallCNN()
    before = {id(g) for g in live_graphs}
    _compare(model, copy.deepcopy(model), torch.randn(4, 3, 32, 32), torch.float32, True)
    graphs = _graphs_since(before)
    forward = next(g for g in graphs if g.name.endswith("forward"))
    backward = next(g for g in graphs if g.name.endswith("backward"))
    assert forward.plan.channels_last.nodes and backward.plan.channels_last.nodes
    assert not any(o.inv_perm == (0, 3, 1, 2) for o in forward.plan.outputs)
    assert _nhwc_arguments(backward.static.lowered.module_text, 4, 16, 32, 32) == 0


def test_backend_without_dynamo_keeps_torch_strides():
    """fx2xla_backend called on a traced graph outside Dynamo has no tracing context to report
    strides to: the saved activations leave in torch's layout, values still channels-last inside
    each graph, and the step equals eager."""
    from fx2xla.backend import fx2xla_backend

    torch.manual_seed(0)
    model = SmallCNN()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 3, 32, 32)
    gm = torch.fx.symbolic_trace(Tupled(model))  # AOTAutograd takes graphs that return tuples
    before = {id(g) for g in live_graphs}
    compiled = fx2xla_backend(gm, [x])
    out = compiled(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.square().sum().backward()
    expected = ref(x)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    _close_parameter_grads(model, ref, torch.float32)
    graphs = _graphs_since(before)
    forward = next(g for g in graphs if g.name.endswith("forward"))
    assert forward.plan.channels_last.nodes
    assert not any(o.inv_perm == (0, 3, 1, 2) for o in forward.plan.outputs)
