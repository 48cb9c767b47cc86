"""Packed convolution weights in CPU inference graphs (fx2xla/torch_kernels.py, WeightPins;
csrc/torch_kernels.cc, "Packed weights").

An inference graph's executor pins the buffer of each weight it imports relaid; torch's
convolution then reorders that weight into oneDNN's layout once per shape instead of on every
call. What these tests hold it to:
- results are bit for bit those of the same executable with packing off
  (`weight_packing(False)`: the public path, torch's plain convolution), in float32 and bfloat16
  (computed in bf16, and widened to float32 with float32 packs made from the bf16 weights),
  with the batch cut into slices and whole, for strided, dilated, grouped (depthwise) and
  bias-free convolutions; and equal eager within float32 rtol/atol 1e-5 (bf16: 2e-2);
- the packed path did run (its counters move), once per weight and shape, and torch wrote
  every packed call's result straight into XLA's buffer (no copy); with those writes off
  (`in_place_writes(False)`: a result of torch's, copied) the result is the same bit for bit;
- a weight changed in place, or replaced, is packed again and the result follows eager, for
  NCHW weights (relaid copies) and for a model made channels-last (its weights pinned as torch
  holds them);
- pins go when the executor is freed; training graphs and options={"torch_kernels": False} pin
  nothing;
- batch sizes 2, 5 (uneven slices: two packs per weight) and 8 pack per shape and equal eager;
  under dynamic=True nothing is pinned;
- four threads making the first calls at once get eager's results."""
from __future__ import annotations

import copy
import gc
import os

import pytest
import torch

from fx2xla import torch_kernels
from fx2xla.metrics import live_graphs
from fx2xla.plan import InputKind
from fx2xla.testing import ImageLogits, SmallCNN, resnet

from tests.conftest import calls_in_threads

pytestmark = pytest.mark.skipif(not torch_kernels.available(), reason=torch_kernels.status())

TOLS = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(autouse=True)
def _fresh():
    # Collected now, not mid-test: an earlier test's executors left in reference cycles would
    # otherwise unpin their weights whenever a collection runs, moving the pinned count a test
    # reads before and after its own calls.
    torch._dynamo.reset()
    gc.collect()
    yield
    torch._dynamo.reset()
    gc.collect()


@pytest.fixture(autouse=True)
def _reduced_in_torch():
    # These tests hold torch's handlers to eager: bf16 and float16 convolutions go to them here on
    # any CPU, not only where it has instructions for those dtypes (tests/lowering/
    # test_reduced_convolutions.py holds that default).
    with torch_kernels.reduced_convolutions(True):
        yield


@pytest.fixture(autouse=True)
def _handlers_own_paths():
    # Serving (opt-in: tests/lowering/test_served_torch_kernels.py) would run the main thread's handler work
    # whole on torch's team. These tests hold the handlers' own paths to eager (slices, packs per
    # slice shape): serving is off here, whatever FX2XLA_SERVE_TORCH_KERNELS says.
    with torch_kernels.serving(False):
        yield


class Mixed(torch.nn.Module):
    """Strided, dilated depthwise, pointwise without bias, and a plain 3x3 convolution."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.depthwise = torch.nn.Conv2d(16, 16, 3, padding=2, dilation=2, groups=16)
        self.pointwise = torch.nn.Conv2d(16, 32, 1, bias=False)
        self.conv = torch.nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(self.pointwise(self.depthwise(x)))
        return self.conv(x).mean((2, 3))


def counts() -> dict:
    return torch_kernels.packing_counts()


def expected_packs(model, x, compute: torch.dtype | None = None) -> int:
    """How many (weight, slice shape) pairs torch's own convolution runs on oneDNN: one pack
    each. The handler cuts a batch of n into one slice per core where each gets two samples or
    more (csrc/torch_kernels.cc, `slices`), and runs each slice single-threaded, which torch's
    choice of kernel depends on (1x1 filters). `compute`: the dtype the convolutions compute in
    (float32 for widened bf16 ones), x's by default."""
    compute = compute or x.dtype
    shapes = []
    hooks = [m.register_forward_pre_hook(lambda m, a: shapes.append((m, a[0].shape)))
             for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    cores = len(os.sched_getaffinity(0))
    total = 0
    for m, shape in shapes:
        n = shape[0]
        parts = cores if cores > 1 and n >= 2 * cores else 1
        for rows in {(i + 1) * n // parts - i * n // parts for i in range(parts)}:
            xs = torch.empty((rows, *shape[1:]), dtype=compute).contiguous(memory_format=torch.channels_last)
            w = m.weight.to(compute).contiguous(memory_format=torch.channels_last)
            bias = None if m.bias is None else m.bias.to(compute)
            threads = torch.get_num_threads()
            torch.set_num_threads(1 if parts > 1 else threads)
            try:
                backend = torch._C._select_conv_backend(xs, w, bias, list(m.stride), list(m.padding),
                                                        list(m.dilation), False, [0, 0], m.groups)
            finally:
                torch.set_num_threads(threads)
            total += backend == torch._C._ConvBackend.Mkldnn
    return total


def relaid_inputs(before: set) -> int:
    return sum(p.kind is InputKind.RELAID and p.perm == (0, 2, 3, 1)
               for g in live_graphs if id(g) not in before for p in g.plan.inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "widened"], ids=str)
@pytest.mark.parametrize("batch", [8, 3, 1])
@pytest.mark.parametrize("build", [Mixed, lambda: ImageLogits(resnet(hidden=(8, 16, 16, 32), depths=(1, 1, 1, 1)))],
                         ids=["mixed", "resnet"])
def test_packed_equals_unpacked_and_eager(build, batch, dtype):
    """Bit for bit the unpacked path's result, within TOLS of eager, and the packed path ran:
    one pin per relaid weight, each packed once for the call's shape, every packed call written
    into XLA's result buffer in place; with in-place writes off, the same result bit for bit.
    "widened": bf16 convolutions computed in float32, packed from the bf16 weights."""
    if dtype == "widened":
        with torch_kernels.reduced_convolutions(False):
            return _packed_equals_unpacked_and_eager(build, batch, torch.bfloat16, torch.float32)
    return _packed_equals_unpacked_and_eager(build, batch, dtype, dtype)


def _packed_equals_unpacked_and_eager(build, batch, dtype, compute):
    torch.manual_seed(0)
    model = build().eval().to(dtype)
    x = torch.randn(batch, 3, 32, 32, dtype=dtype)
    before_graphs = {id(g) for g in live_graphs}
    start = counts()
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        expected = model(x)
        packed = compiled(x)
        relaid = relaid_inputs(before_graphs)
        first = counts()
        again = compiled(x)
        after = counts()
        with torch_kernels.weight_packing(False):
            plain = compiled(x)
        assert counts()["packed_calls"] == after["packed_calls"], "packing off still ran packed"
        with torch_kernels.in_place_writes(False):
            copied = compiled(x)
        assert counts()["written_in_place"] == after["written_in_place"], "in-place writes off still wrote in place"
    assert relaid > 0
    assert first["pinned"] - start["pinned"] == relaid
    packs = expected_packs(model, x, compute)
    assert first["packs"] - start["packs"] == packs
    assert after["packs"] == first["packs"], "the second call packed again"
    assert (after["packed_calls"] > first["packed_calls"]) == (packs > 0)
    assert (after["written_in_place"] - start["written_in_place"]
            == after["packed_calls"] - start["packed_calls"]), "a packed call copied its result"
    torch.testing.assert_close(packed, plain, rtol=0, atol=0)
    torch.testing.assert_close(again, plain, rtol=0, atol=0)
    torch.testing.assert_close(copied, plain, rtol=0, atol=0)
    torch.testing.assert_close(packed.float(), expected.float(), **TOLS[dtype])


@pytest.mark.parametrize("channels_last_weights", [False, True], ids=["nchw", "channels_last"])
def test_changed_weights_are_packed_again(channels_last_weights):
    """A weight changed in place, then one replaced by a new Parameter: each next call packs the
    new values and equals eager; the number of pins stays one per convolution weight. Weights
    torch holds NCHW are pinned as the executor's own channels-last copies; a model made
    channels-last passes its weights as they are, and their buffers (torch's memory) are pinned."""
    torch.manual_seed(0)
    model = SmallCNN().eval()
    if channels_last_weights:
        model = model.to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 32, 32)
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOLS[torch.float32])
        pinned = counts()["pinned"]
        (graph,) = [g for g in live_graphs if id(g) not in before]
        assert sum(p.pinned for p in graph.plan.inputs) == 3
        assert sum(p.kind is InputKind.RELAID and p.perm == (0, 2, 3, 1) for p in graph.plan.inputs) == (
            0 if channels_last_weights else 3)
        assert pinned >= 3
        packs = counts()["packs"]
        model.features[0].weight.mul_(-2.0)
        torch.testing.assert_close(compiled(x), model(x), **TOLS[torch.float32])
        assert counts()["packs"] == packs + 1
        model.features[4].weight = torch.nn.Parameter(torch.randn_like(model.features[4].weight))
        torch.testing.assert_close(compiled(x), model(x), **TOLS[torch.float32])
        assert counts()["packs"] == packs + 2
        assert counts()["pinned"] == pinned


def test_pins_go_with_the_executor():
    """Freeing the compiled model (Dynamo reset, no references left) unpins its weights."""
    torch.manual_seed(0)
    start = counts()["pinned"]
    model = SmallCNN().eval()
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        compiled(torch.randn(4, 3, 32, 32))
    assert counts()["pinned"] == start + 3
    del compiled
    torch._dynamo.reset()
    gc.collect()
    assert counts()["pinned"] == start


@pytest.mark.parametrize("how", ["training", "torch_kernels_off"])
def test_nothing_pinned(how):
    """A training step (weights change every step, none relaid) and a graph lowered without
    torch's kernels pin nothing, and match eager."""
    torch.manual_seed(0)
    model = SmallCNN()
    x = torch.randn(4, 3, 32, 32)
    start = counts()
    if how == "training":
        ref = copy.deepcopy(model)
        compiled = torch.compile(model, backend="fx2xla")
        compiled(x).sum().backward()
        ref(x).sum().backward()
        torch.testing.assert_close(model.features[0].weight.grad, ref.features[0].weight.grad, rtol=1e-4, atol=1e-4)
    else:
        model.eval()
        compiled = torch.compile(model, backend="fx2xla", options={"torch_kernels": False})
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), **TOLS[torch.float32])
    assert counts()["pinned"] == start["pinned"]
    assert counts()["packs"] == start["packs"]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_batch_sizes(dynamic):
    """Batch sizes 2, 5 (slices of 2 and 3 samples: two packs per weight) and 8, each compiled
    for its shape: every result equals eager, and the unpacked path bit for bit; each shape packs
    as torch's choice of kernel says. Under dynamic=True convolutions run on NCHW values and
    nothing is pinned: still equal to eager."""
    torch.manual_seed(0)
    model = Mixed().eval()
    compiled = torch.compile(model, backend="fx2xla", dynamic=dynamic)
    with torch.no_grad():
        for batch in (2, 5, 8):
            x = torch.randn(batch, 3, 32, 32)
            start = counts()
            out = compiled(x)
            assert counts()["packs"] - start["packs"] == (0 if dynamic else expected_packs(model, x))
            torch.testing.assert_close(out, model(x), **TOLS[torch.float32])
            with torch_kernels.weight_packing(False):
                torch.testing.assert_close(out, compiled(x), rtol=0, atol=0)
            if dynamic:
                assert counts()["pinned"] == start["pinned"]


def test_first_calls_from_many_threads():
    """Four threads making a compiled ResNet's first calls at once (each packs or waits for the
    pack), 5 calls each on inputs of their own, get eager's results."""
    torch.manual_seed(0)
    model = ImageLogits(resnet(hidden=(8, 16, 16, 32), depths=(1, 1, 1, 1))).eval()
    compiled = torch.compile(model, backend="fx2xla")
    inputs = [torch.randn(4, 3, 32, 32) for _ in range(4)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    start = counts()["packs"]
    results = calls_in_threads(compiled, inputs, calls=5)
    for i, outs in results.items():
        for out in outs:
            torch.testing.assert_close(out, expected[i], **TOLS[torch.float32])
    assert counts()["packs"] > start
