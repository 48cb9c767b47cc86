"""The GraphPlan: one explicit plan per graph, built before any tracing, with a device for every
value. CUDA graphs are planned and lowered here from FakeTensors on `cuda:0` (this machine has
no GPU; planning and lowering need none); the moves between devices run for real on the CPU
client with torch's side of the device boundary stood in for. Numerics: float32 rtol 1e-4 /
atol 1e-5 against eager; the moved-vs-unmoved comparisons are exact (same executable)."""
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fx2xla
from fx2xla import torch_kernels
from fx2xla.lowering.graph import lower_graph
from fx2xla.lowering.registry import lowering_for
from fx2xla.metrics import live_graphs
from fx2xla.plan import build_plan
from fx2xla.runtime import Device, compile_module, default_device
from fx2xla.runtime.executor import make_launcher
from fx2xla.runtime.handoff import import_tensor

aten = torch.ops.aten


def _cuda_graph(fn, *specs):
    """(gm, fake inputs) of `fn` traced on FakeTensors, functionalized as AOTAutograd does (an
    input write becomes `copy_(input, new)`); specs: (shape, dtype, device)."""
    with FakeTensorMode():
        fakes = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in specs]
    return make_fx(torch.func.functionalize(fn))(*fakes), fakes


@pytest.fixture
def torch_has_cuda(monkeypatch):
    """Plans ask torch whether it can hold tensors on the GPU; here it is told it can."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_plan_of_a_cuda_graph_puts_every_value_on_its_device(torch_has_cuda):
    def f(x, s, w):
        y = x @ w
        w.add_(1)  # a written input: its new contents are a result that goes back to w's device
        return y * s, x.t(), y.to("cpu").sum(), torch.bernoulli(torch.sigmoid(y))

    gm, fakes = _cuda_graph(f, ((4, 4), torch.float32, "cuda"), ((), torch.float32, "cpu"),
                            ((4, 4), torch.float32, "cuda"))
    plan = build_plan(gm, fakes, Device("cuda", 0), resident={2})
    cuda = torch.device("cuda", 0)
    x, s, w = plan.inputs
    assert (x.device, x.move, x.resident) == (cuda, "", False)
    assert (s.device, s.move) == (torch.device("cpu"), "torch")  # a CPU 0-d scalar is moved, never passed as is
    # Written in place on the GPU (runtime/inplace.py): donated, so never resident.
    assert (w.move, w.resident, w.donated) == ("", False, True)
    assert plan.seed and plan.seed_device == cuda  # drawn by torch's CUDA generator, on the GPU
    kinds = [o.kind for o in plan.outputs]
    assert kinds == ["tensor", "input", "tensor", "tensor"]  # x.t() is rebuilt in torch from x
    assert [o.device for o in plan.outputs] == [cuda, cuda, torch.device("cpu"), cuda]
    homes = {r.node.name: (r.device, r.move) for r in plan.results}
    assert homes["sum_1"] == (torch.device("cpu"), "torch")  # `.to("cpu")` comes back on the CPU
    assert plan.mutations == [(2, len(plan.results) - 1)] and plan.results[-1].device == cuda


@pytest.mark.parametrize("inplace,twins", [("1", "1"), ("0", "1"), ("1", "0")])
def test_cuda_written_inputs_are_donated_where_a_call_can_be_ordered(torch_has_cuda, monkeypatch, inplace, twins):
    """On one CUDA device a dense written input is donated (written in place) when the graph
    also passes an input it does not write, which the call imports to be ordered after torch's
    stream; a graph that writes every input it passes (and draws no seed) swaps them in instead.
    FX2XLA_INPLACE=0, or the twins off (a holder's array is released fenced through its twin
    record), plan no donation."""
    monkeypatch.setenv("FX2XLA_INPLACE", inplace)
    monkeypatch.setenv("FX2XLA_TWINS", twins)

    def step(p, m, g):
        m.mul_(0.9).add_(g)
        p.sub_(m * 0.1)

    def only_writes(p, m):
        m.mul_(0.9)
        p.sub_(m)

    spec = ((8, 4), torch.bfloat16, "cuda")
    gm, fakes = _cuda_graph(step, spec, spec, spec)
    plan = build_plan(gm, fakes, Device("cuda", 0), resident={0})
    on = inplace == "1" and twins == "1"
    assert [p.donated for p in plan.inputs] == [on, on, False]
    assert [p.resident for p in plan.inputs] == [not on, False, False]
    gm, fakes = _cuda_graph(only_writes, spec, spec)
    assert [p.donated for p in build_plan(gm, fakes, Device("cuda", 0)).inputs] == [False, False]
    # The CPU orders nothing: every dense written input is donated there.
    cpu = ((8, 4), torch.float32, "cpu")
    gm, fakes = _cuda_graph(only_writes, cpu, cpu)
    assert [p.donated for p in build_plan(gm, fakes, Device("cpu", 0)).inputs] == [inplace == "1"] * 2


def test_without_torch_cuda_values_cross_through_pjrt():
    """A CPU build of torch beside jax's CUDA plugin: torch has no tensors on the GPU, so CPU
    inputs are handed to the CPU client and copied by PJRT, and results come back the same way."""
    gm, fakes = _cuda_graph(lambda x: (x * 2, x.sum()), ((4,), torch.float32, "cpu"))
    plan = build_plan(gm, fakes, Device("cuda", 0))
    assert plan.torch_device is None and plan.inputs[0].move == "pjrt"
    assert {r.move for r in plan.results} == {"pjrt"}


def _precisions(text: str) -> set:
    return {p for p in ("HIGHEST", "DEFAULT", "HIGH") if f"precision {p}" in text or f"<{p}>" in text}


@torch.library.custom_op("fx2xla_test_plan::cholesky", mutates_args=())
def cholesky(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.cholesky(x)


@cholesky.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture
def cholesky_rule():
    """A rule whose jax code lowers to a platform's own solver library (a custom call)."""
    import jax.numpy as jnp

    from fx2xla.lowering.registry import LOWERINGS, register_lowering

    op = torch.ops.fx2xla_test_plan.cholesky.default
    register_lowering(op)(lambda ctx, x: jnp.linalg.cholesky(x))
    yield
    del LOWERINGS[op]


@pytest.mark.parametrize("setting", ["highest", "high"])
def test_cuda_lowering_is_for_cuda(torch_has_cuda, cholesky_rule, setting):
    """Modules are lowered for the plan's platform: a solver's custom call is cuSOLVER's on
    CUDA and LAPACK's on the CPU whatever jax's default backend is, and the dot precision
    follows torch's float32 matmul setting on the GPU (bf16 dots never HIGHEST there), while
    CPU modules keep HIGHEST."""
    def f(a, b):
        return torch.ops.fx2xla_test_plan.cholesky(a @ a.T), b @ b  # only lowered, never run

    def text_for(device_name, platform):
        gm, fakes = _cuda_graph(f, ((4, 4), torch.float32, device_name), ((4, 4), torch.bfloat16, device_name))
        plan = build_plan(gm, fakes, Device(platform, 0))
        return lower_graph(gm, plan, fakes).module_text

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        cuda, cpu = text_for("cuda", "cuda"), text_for("cpu", "cpu")
    finally:
        torch.set_float32_matmul_precision(before)
    assert "cusolver" in cuda and "lapack" not in cuda
    assert "lapack" in cpu and "cusolver" not in cpu
    dots = [line for line in cuda.splitlines() if "dot_general" in line]
    f32 = [d for d in dots if "bf16" not in d]
    bf16 = [d for d in dots if "bf16" in d]
    assert f32 and bf16
    assert all("HIGHEST" in d for d in f32) == (setting == "highest")
    assert not any("HIGHEST" in d for d in bf16)
    assert all("HIGHEST" in d for d in cpu.splitlines() if "dot_general" in d)


def test_cuda_attention_rules_are_cudas_own():
    ops = [aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_cudnn_attention.default,
           aten._scaled_dot_product_cudnn_attention_backward.default]
    for op in ops:
        assert lowering_for(op, "cuda") is not lowering_for(op, "cpu")
        assert lowering_for(op, "cpu") is lowering_for(op) and lowering_for(op).random == lowering_for(op, "cuda").random \
            or "backward" in str(op)


@pytest.mark.parametrize("causal", [False, True])
def test_cuda_attention_lowering_falls_back_to_math(torch_has_cuda, causal):
    """Lowered for CUDA without cuDNN (as here), fused attention is the math rule: the CUDA
    module, free of custom calls, compiles on the CPU client and matches eager's math SDPA."""
    q = torch.randn(2, 4, 16, 8, dtype=torch.bfloat16)

    def f(q, k, v):
        return aten._scaled_dot_product_efficient_attention(q, k, v, None, False, is_causal=causal)[0]

    gm, fakes = _cuda_graph(f, *[((2, 4, 16, 8), torch.bfloat16, "cuda")] * 3)
    plan = build_plan(gm, fakes, Device("cuda", 0))
    text = lower_graph(gm, plan, fakes).module_text
    assert "custom_call" not in text
    k, v = torch.randn_like(q), torch.randn_like(q)
    launch = make_launcher(compile_module(text, default_device()))  # the CUDA module, on the CPU client
    dev = default_device().jax_device
    assert not plan.seed  # no dropout: the graph takes no seed
    out = launch([import_tensor(t, dev) for t in (q, k, v)])[0]
    if plan.outputs[0].inv_perm is not None:  # torch's kernel returns a [B, L, H, D] layout
        out = out.permute(plan.outputs[0].inv_perm)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    torch.testing.assert_close(out.float(), expected, rtol=1.6e-2, atol=1e-2)


class _Step(torch.nn.Module):
    """Reads a buffer it updates, draws random bits, returns a non-contiguous output."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(8))

    def forward(self, x):
        self.count.add_(1)
        y = self.fc(x) + self.count
        return y.t() * 2, torch.nn.functional.dropout(y, 0.5, training=True), x.sum()


@pytest.mark.parametrize("move", ["torch", "pjrt"])
def test_moves_across_devices_give_the_same_results(monkeypatch, move):
    """Every input, the seed and every result crossing a device boundary (stood in for on the
    CPU client: torch is told its tensors live elsewhere) gives exactly what the plain path
    gives, buffer updates and random draws included."""
    def run():
        torch.manual_seed(0)
        model = _Step()
        x = torch.randn(4, 8)
        # Weights as torch holds them on both paths: a moved input is never relaid, and a dot
        # of a relaid [in, out] weight may round differently (it does on AVX2 CPUs).
        compiled = torch.compile(model, backend="fx2xla",
                                 options={"fallback": "error", "transposed_linear_weights": False})
        with torch.no_grad():
            outs = [compiled(x) for _ in range(2)]
        return outs, model.count.clone()

    torch._dynamo.reset()
    expected, count = run()
    monkeypatch.setattr(Device, "holds", lambda self, device: False)
    if move == "pjrt":
        monkeypatch.setattr(Device, "torch_device", property(lambda self: None))
    older = set(live_graphs)
    torch._dynamo.reset()
    actual, moved_count = run()
    graphs = [g for g in live_graphs if g not in older]
    assert graphs and all(p.move == move for g in graphs for p in g.plan.inputs if p.kind != "symint")
    assert all(r.move == move for g in graphs for r in g.plan.results)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    torch.testing.assert_close(moved_count, count, rtol=0, atol=0)
    assert torch.equal(count, torch.full((8,), 2.0))
    torch._dynamo.reset()


@torch.library.custom_op("fx2xla_test_plan::clip", mutates_args=())
def clip(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-1, 1)


@clip.register_fake
def _(x):
    return torch.empty_like(x)


class _Island(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(clip(self.fc1(x)))


def test_island_inputs_are_resident_only_for_parameters():
    """With an eager island between XLA subgraphs, a subgraph keeps device buffers for the
    model's parameters only: intermediates are new every call and are never held."""
    torch.manual_seed(0)
    model = _Island().eval()
    older = set(live_graphs)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            x = torch.randn(4, 16)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
    graphs = [g for g in live_graphs if g not in older]
    assert len(graphs) == 2 and fx2xla.metrics()["fallback_ops"] >= 1
    params = {tuple(p.shape) for p in model.parameters()}
    for g in graphs:
        for p, ex, slot in zip(g.plan.inputs, g.example_inputs, range(len(g.plan.inputs))):
            assert p.resident == (tuple(ex.shape) in params), (g.name, tuple(ex.shape))
        # Buffers held across calls are the parameters' alone.
        held = [r for r in g.resident_buffers() if r is not None]
        assert len(held) == sum(p.resident for p in g.plan.inputs) == 2


def _linear_and_conv(x, w, b, img, k, kb):
    """nn.Linear as AOTAutograd hands it over (addmm of the permuted weight), a plain matmul
    and a convolution with a bias."""
    return (torch.addmm(b, x, w.T), x @ w.T,
            aten.convolution.default(img, k, kb, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))


def _half_specs(device_name, dtype):
    return [((8, 64), dtype, device_name), ((32, 64), dtype, device_name), ((32,), dtype, device_name),
            ((2, 3, 6, 6), dtype, device_name), ((2, 3, 3, 3), dtype, device_name), ((2,), dtype, device_name)]


def _half_module(device_name, platform, dtype=torch.bfloat16, torch_kernels=True) -> str:
    gm, fakes = _cuda_graph(_linear_and_conv, *_half_specs(device_name, dtype))
    plan = build_plan(gm, fakes, Device(platform, 0))
    return lower_graph(gm, plan, fakes, torch_kernels=torch_kernels).module_text


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_matmuls_write_their_own_dtype(torch_has_cuda, dtype):
    """Lowered for CUDA, a bf16/f16 dot or conv asks XLA for a result in its own dtype (the
    GEMM accumulates in float32 and rounds once as it writes): no float32 value and no convert
    anywhere, the Linear's bias added in that dtype. Lowered for the CPU with XLA's kernels
    only, the same graph keeps float32 results, converted to the half dtype afterwards; with
    torch's kernels built and allowed that dtype's convolutions, the convolution is torch's
    (fx2xla/torch_kernels.py), in the half dtype with its bias, as eager computes it."""
    t = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    cuda = _half_module("cuda", "cuda", dtype)
    dots = [line for line in cuda.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 2 and all(d.endswith(f"-> tensor<8x32x{t}>") for d in dots), cuda
    assert f"-> tensor<2x2x6x6x{t}>" in cuda and "f32" not in cuda and "stablehlo.convert" not in cuda, cuda
    cpu = _half_module("cpu", "cpu", dtype, torch_kernels=False)
    dots = [line for line in cpu.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 2 and all(d.endswith("-> tensor<8x32xf32>") for d in dots), cpu
    assert "-> tensor<2x2x6x6xf32>" in cpu, cpu
    assert cpu.count(f": (tensor<8x32xf32>) -> tensor<8x32x{t}>") == 2, cpu  # rounded after the bias
    if torch_kernels.available():
        with torch_kernels.reduced_convolutions(True):
            cpu = _half_module("cpu", "cpu", dtype)
        conv = next(line for line in cpu.splitlines() if "@fx2xla_torch_convolution(" in line)
        assert conv.endswith(f"-> tensor<2x6x6x2x{t}>") and "has_bias = 1" in conv, conv


def test_cuda_half_matmuls_match_eager(torch_has_cuda):
    """The CUDA module (bf16 dots, conv and bias adds), compiled on the CPU client, matches eager
    bf16 within the suite's bf16 tolerance (rtol 1.6e-2, atol 1e-2). XLA:CPU computes each
    bf16 dot in float32 and rounds once; the bias is then added in bf16, as on a GPU where XLA
    does not fold it into the GEMM."""
    text = _half_module("cuda", "cuda")
    torch.manual_seed(0)
    x, w, b = torch.randn(8, 64), torch.randn(32, 64) / 8, torch.randn(32)
    img, k, kb = torch.randn(2, 3, 6, 6), torch.randn(2, 3, 3, 3) / 3, torch.randn(2)
    args = [t.to(torch.bfloat16) for t in (x, w, b, img, k, kb)]
    launch = make_launcher(compile_module(text, default_device()))
    dev = default_device().jax_device
    outs = launch([import_tensor(t, dev) for t in args])
    expected = _linear_and_conv(*args)
    assert len(outs) == len(expected)
    for out, exp in zip(outs, expected):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, exp, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("functional", [False, True])
def test_cuda_eval_batch_norm_saves_the_running_stats(torch_has_cuda, dtype, functional):
    """In eval, torch's CUDA batch norm returns the running mean and 1/sqrt(running var + eps)
    as save_mean/save_rstd where its CPU kernel returns empty tensors (a ResNet failed to lower on
    an H200 for this). The CUDA module, run on the CPU client, gives eager's output (float32 rtol
    1e-5 / atol 1e-5; bfloat16 rtol/atol 1e-2) and those statistics (rtol 1e-5 in their dtype);
    the CPU module keeps torch's empty ones."""
    def f(x, w, b, rm, rv):
        if functional:
            return aten._native_batch_norm_legit_functional(x, w, b, rm, rv, False, 0.1, 1e-5)[:3]
        return aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)

    torch.manual_seed(0)
    x = torch.randn(2, 16, 5, 5).to(dtype)
    w, b, rm = (torch.randn(16).to(dtype) for _ in range(3))
    rv = (torch.rand(16) + 0.5).to(dtype)
    specs = [((2, 16, 5, 5), dtype), *[((16,), dtype)] * 4]
    dev = default_device().jax_device
    outs = {}
    for device_name, platform in (("cuda", "cuda"), ("cpu", "cpu")):
        gm, fakes = _cuda_graph(f, *[(s, d, device_name) for s, d in specs])
        expected = [tuple(v.meta["val"].shape) for v in gm.graph.find_nodes(op="output")[0].args[0]]
        plan = build_plan(gm, fakes, Device(platform, 0))
        text = lower_graph(gm, plan, fakes).module_text
        launch = make_launcher(compile_module(text, default_device()))
        outs[platform] = launch([import_tensor(t, dev) for t in (x, w, b, rm, rv)])
        assert [tuple(o.shape) for o in outs[platform]] == [tuple(fakes[0].shape), *expected[1:]]
    out, save_mean, save_rstd = outs["cuda"]
    eager = torch.nn.functional.batch_norm(x.float(), rm.float(), rv.float(), w.float(), b.float(), False, 0.1, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), eager, rtol=tol, atol=tol)
    assert save_mean.shape == save_rstd.shape == (16,)
    torch.testing.assert_close(save_mean.float(), rm.float(), rtol=1e-5, atol=0)
    torch.testing.assert_close(save_rstd.float(), torch.rsqrt(rv.float() + 1e-5), rtol=1e-5, atol=0)
    assert outs["cpu"][1].shape == outs["cpu"][2].shape == (0,)
    torch.testing.assert_close(outs["cpu"][0], out, rtol=0, atol=0)
