"""Elementwise regions (fx2xla/lowering/regions.py; the kernel library's `fx2xla_elementwise`).

Float32 elementwise ops of one static shape of at least MIN_ELEMENTS elements that write several
results, all of which leave the graph (returned, or written back into a graph input), run as one
loop compiled for this CPU. What these tests hold them to:
- AdamW's single-tensor update of a large parameter is one region (four inputs: parameter,
  gradient, two moments; three results), a bias below MIN_ELEMENTS none; the loop's source reads
  each input once per element and writes each result once;
- a compiled AdamW step (single-tensor and foreach), an Adam step with weight decay (added to
  the gradient with alpha) and an SGD step with momentum and weight decay call the handler once
  per large parameter; after five steps the parameters and moments match eager's within 1e-5
  (rtol and atol, seeded gradients) and the same step with XLA's loops (torch_kernels without
  "elementwise") within 1e-6; a donated parameter is updated in its own buffer from the second
  step on (the StableHLO aliases the handler's result to it);
- a function returning two results of +, -, *, /, neg, sqrt, abs, reciprocal, sub with alpha, a
  0-d float64 and int64 tensor, a number and where on a 0-d condition gives eager's bits exactly
  (each op rounds once in both; sqrt correctly rounded, where eager's SLEEF sqrt is within an ulp
  of it, and alpha's product and sum in one fma, as eager's kernel), NaN, infinities and -0.0
  included; XLA's loops, which contract products and sums into fmas, are within 1e-5;
- no region where it would not pay or not be exact: one result, a result read by another op, a
  broadcast operand, bf16, a small shape, a dynamic shape, the option without the kind;
- four threads calling one compiled region at once get one call's bits on every call;
- where the loop does not compile, a warning says so and the region runs as XLA's loops, with the
  same results; a compiler that fails is reported with its command and the loop's source, and a
  loop is compiled once per source."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from fx2xla import torch_kernels
from fx2xla.lowering import regions
from fx2xla.metrics import live_graphs

from tests.conftest import calls_in_threads

TARGET = "@fx2xla_elementwise("
WITHOUT = [k for k in torch_kernels.KINDS if k != "elementwise"]
BIG = (512, 256)  # 131072 elements: at least MIN_ELEMENTS
pytestmark = pytest.mark.skipif(not torch_kernels.available("elementwise"), reason=torch_kernels.status())


def _texts(before) -> list[str]:
    return [g.static.lowered.module_text for g in live_graphs if id(g) not in before and g.static is not None]


def _captured_adamw_graph():
    """The forward graph AOTAutograd hands a backend for a single-tensor AdamW step of a BIG
    weight and a small bias (fx2xla's decompositions applied)."""
    from torch._dynamo.backends.common import aot_autograd

    from fx2xla.decompositions import decomposition_table

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*BIG)), torch.nn.Parameter(torch.randn(32))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    torch._dynamo.reset()
    torch.compile(opt.step, backend=aot_autograd(fw_compiler=capture, decompositions=decomposition_table()))()
    return graphs[0]


def test_adamw_update_is_one_region_per_large_parameter():
    """One region for the weight (4 inputs, 3 results, 4 scalars: the step's bias corrections and
    lerp's weight and condition); none for the 32-element bias; with a floor of 1 element, the
    bias's update is a region too."""
    gm = _captured_adamw_graph()
    found = regions.find_regions(gm)
    assert len(found) == 1, found
    r = found[0]
    assert r.shape == BIG and len(r.vectors) == 4 and len(r.outputs) == 3
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert all(v in placeholders for v in r.vectors)
    # Each input read once per element, each result written once.
    for i in range(4):
        assert r.source.count(f"x{i}p[i]") == 1
    for j in range(3):
        assert r.source.count(f"o{j}p[i] =") == 1
    assert len(regions.find_regions(gm, min_elements=1)) == 2


def _train(make_opt, options, steps=5):
    """`steps` optimizer steps (compiled with fx2xla and `options`, or eager for None) of a copy
    of one seeded MLP with seeded gradients: (parameters, optimizer state tensors, handler calls,
    the new graphs' StableHLO)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = make_opt(model.parameters())
    step = opt.step if options is None else torch.compile(opt.step, backend="fx2xla", options=options)
    g = torch.Generator().manual_seed(1)
    calls = torch_kernels.elementwise_calls()
    before = {id(x) for x in live_graphs}
    first_weight = model[0].weight
    pointers = []
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        step()
        pointers.append(first_weight.data_ptr())
    # The first step leaves the weight in a buffer of XLA's (runtime/inplace.py); later ones
    # write that buffer in place.
    moved = len(set(pointers[1:])) > 1
    state = [t.clone() for p in model.parameters() for t in opt.state[p].values() if t.dim() > 0]
    return ([p.detach().clone() for p in model.parameters()], state, torch_kernels.elementwise_calls() - calls,
            _texts(before), moved)


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam_weight_decay": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_step_matches_eager_and_xlas_loops(name):
    """Two large weights: two handler calls a step, two in each graph that has them. Parameters and state within 1e-5 of eager's
    and 1e-6 of XLA's loops after five steps; from the second step on, the weight keeps its
    buffer."""
    make = OPTIMIZERS[name]
    params, state, calls, texts, moved = _train(make, {"torch_kernels": True})
    eager_params, eager_state, _, _, _ = _train(make, None)
    xla_params, xla_state, xla_calls, xla_texts, _ = _train(make, {"torch_kernels": WITHOUT})
    assert calls == 2 * 5 and xla_calls == 0
    # (SGD's first step, which creates the momentum buffers, is a graph of its own.)
    counts = [t.count(TARGET) for t in texts if TARGET in t]
    assert counts and all(c == 2 for c in counts) and not any(TARGET in t for t in xla_texts)
    assert any("output_operand_aliases" in t for t in texts if TARGET in t)
    assert not moved
    assert len(state) == len(eager_state) > 0
    for got, ref in zip(params + state, eager_params + eager_state):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    for got, ref in zip(params + state, xla_params + xla_state):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def _exact_sqrt(t):
    """sqrt correctly rounded to float32 (eager's CPU kernel, SLEEF's, is within 1 ulp of it)."""
    return torch.sqrt(t.double()).float()


def _two_results(x, y, s64, i64, flag, sqrt=torch.sqrt):
    a = (x * 2.5 - y) / (y.abs() + 1.0)
    b = sqrt(x.abs()) * s64 - torch.reciprocal(y) + i64
    c = torch.where(flag, a, -b)
    return a + c, torch.sub(b * 0.5, y, alpha=0.3)


def _inputs(seed=0, special=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*BIG, generator=g)
    y = torch.randn(*BIG, generator=g)
    if special:
        x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40])
        y[1, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    return x, y, torch.tensor(1.3, dtype=torch.float64), torch.tensor(3, dtype=torch.int64), torch.tensor(True)


@pytest.mark.parametrize("flag", [True, False])
def test_arithmetic_is_eagers_bits(flag):
    """Two results of +, -, *, /, neg, sqrt, abs, reciprocal, sub with alpha, 0-d float64/int64
    tensors, numbers and where on a 0-d condition, in one handler call: eager's bits (NaN where
    eager's is NaN, the same signs), with sqrt correctly rounded in both."""
    x, y, s64, i64, _ = _inputs()
    cond = torch.tensor(flag)
    calls = torch_kernels.elementwise_calls()
    torch._dynamo.reset()
    got = torch.compile(_two_results, backend="fx2xla")(x, y, s64, i64, cond)
    assert torch_kernels.elementwise_calls() - calls == 1
    ref = _two_results(x, y, s64, i64, cond, sqrt=_exact_sqrt)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0, equal_nan=True)
        numbers = ~torch.isnan(r)  # (a NaN's sign bit means nothing)
        assert torch.equal(torch.signbit(g[numbers]), torch.signbit(r[numbers]))


def _not_regions():
    """Functions whose elementwise ops must stay XLA's, each with its inputs."""
    x, y = _inputs(special=False)[:2]
    small = (x[:4], y[:4])
    return {
        "one_result": (lambda a, b: a * 2 + b, (x, y)),
        "read_by_a_reduction": (lambda a, b: ((a * 2 + b).sum(), a - b), (x, y)),
        "broadcast_operand": (lambda a, b: (a * b[0], a + b[0]), (x, y)),
        "bf16": (lambda a, b: (a * 2 + b, a - b), (x.bfloat16(), y.bfloat16())),
        "small": (lambda a, b: (a * 2 + b, a - b), small),
    }


@pytest.mark.parametrize("case", list(_not_regions()))
def test_no_region_where_it_does_not_apply(case):
    """No handler call; the results are eager's within float32 (bf16) rounding."""
    fn, args = _not_regions()[case]
    calls = torch_kernels.elementwise_calls()
    torch._dynamo.reset()
    got = torch.compile(fn, backend="fx2xla")(*args)
    assert torch_kernels.elementwise_calls() == calls
    ref = fn(*args)
    tol = dict(rtol=1.6e-2, atol=1e-2) if args[0].dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, **tol)


def test_dynamic_shapes_and_the_option_keep_xlas_loops():
    """A dynamic shape, and the option without "elementwise": no call; eager's results within
    float32 rounding (XLA's loops contract products and sums into fmas)."""
    x, y, s64, i64, flag = _inputs(special=False)
    calls = torch_kernels.elementwise_calls()
    for kwargs in ({"dynamic": True}, {"options": {"torch_kernels": WITHOUT}}):
        torch._dynamo.reset()
        got = torch.compile(_two_results, backend="fx2xla", **kwargs)(x, y, s64, i64, flag)
        for g, r in zip(got, _two_results(x, y, s64, i64, flag)):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    assert torch_kernels.elementwise_calls() == calls


def test_threads_get_one_calls_bits():
    """Four threads x 10 calls of one compiled region: every result is the single call's bits."""
    torch._dynamo.reset()
    fn = torch.compile(_two_results, backend="fx2xla")
    inputs = [_inputs(seed=i, special=False) for i in range(4)]
    expected = [fn(*args) for args in inputs]
    results = calls_in_threads(lambda args: fn(*args), inputs, calls=10)
    for i, outs in results.items():
        for out in outs:
            for g, r in zip(out, expected[i]):
                assert torch.equal(g, r)


def test_a_loop_that_does_not_compile_falls_back_to_xlas_loops(monkeypatch):
    """region_loop raising: a RuntimeWarning naming the cause, no handler call, eager's results
    within float32 rounding."""
    def broken(source):
        raise RuntimeError("compiler said no")

    monkeypatch.setattr(torch_kernels, "region_loop", broken)
    x, y, s64, i64, flag = _inputs(special=False)
    calls = torch_kernels.elementwise_calls()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(_two_results, backend="fx2xla")(x, y, s64, i64, flag)
    assert any("compiler said no" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert torch_kernels.elementwise_calls() == calls
    for g, r in zip(got, _two_results(x, y, s64, i64, flag)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def test_region_loop_reports_a_failing_compiler(monkeypatch, tmp_path):
    """CXX=false: RuntimeError with the command and the loop's source; nothing left behind."""
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(torch_kernels, "candidate_paths", lambda: [tmp_path / "lib.so"])
    source = 'extern "C" void fx2xla_region() {}  // a source no earlier test compiled\n'
    with pytest.raises(RuntimeError, match="compiling a region loop failed") as e:
        torch_kernels.region_loop(source)
    assert "false" in str(e.value) and "a source no earlier test compiled" in str(e.value)
    assert list((tmp_path / "regions").iterdir()) == []


def test_region_loop_compiles_once(tmp_path, monkeypatch):
    """A new source is compiled into the regions folder once; the same source again, in this
    process, is the same path without compiling."""
    monkeypatch.setattr(torch_kernels, "candidate_paths", lambda: [tmp_path / "lib.so"])
    source = ('#include <cstdint>\nextern "C" void fx2xla_region(const float* const* in, const float* s, '
              'float* const* out, int64_t lo, int64_t hi) { /* test_region_loop_compiles_once */ }\n')
    path = torch_kernels.region_loop(source)
    assert path.parent == tmp_path / "regions" and path.is_file()
    monkeypatch.setenv("CXX", "false")  # a compile now would fail
    assert torch_kernels.region_loop(source) == path
