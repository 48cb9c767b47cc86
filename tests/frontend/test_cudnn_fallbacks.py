"""cuDNN fused attention on CUDA, and every way it falls back to the math rules, checked on the
CPU. Graphs are planned and lowered for CUDA from FakeTensors on `cuda:0` (as in
tests/runtime/test_plan.py), with one of two stand-ins for cuDNN:
- `xla_cudnn`: jax.nn.dot_product_attention(implementation="cudnn") runs jax's own XLA
  implementation (the same API and residual layout: [B, Lq, H], in the inputs' dtype), so the
  CUDA modules compile and run on the CPU client and their values are checked;
- `real_cudnn`: jax's real cuDNN path, told a cuDNN version (tracing it needs no GPU): the
  modules hold cuDNN's custom calls, read as text, never run.
Tolerances, bf16 against float32 eager on the same (bf16) values: outputs and log-sum-exps
rtol 1.6e-2 / atol 1e-2 (conftest's bf16), x2 for outputs (sums of Lk rounded terms) and x4
for gradients (two rounded GEMMs more); a fully masked row is exactly 0 (eager's math SDPA
gives 0 for a bool mask and for a -inf float mask alike)."""
import math
import re
from types import SimpleNamespace

import jax
import pytest
import torch
from tests.conftest import tolerance
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fx2xla.compiled_graph import CompiledGraph
from fx2xla.lowering import nn
from fx2xla.lowering.graph import lower_graph
from fx2xla.plan import build_plan
from fx2xla.plan_executor import wrap_outputs
from fx2xla.runtime import Device, compile_module, default_device
from fx2xla.runtime.executor import make_launcher
from fx2xla.runtime.handoff import import_tensor

aten = torch.ops.aten
B, H, L, D = 2, 4, 16, 32
BF16 = torch.bfloat16


def _fa():
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


@pytest.fixture
def torch_has_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def xla_cudnn(monkeypatch):
    """cuDNN's attention stood in for by jax's XLA one. Returns the stand-in's state: `calls`
    (each call's query shape, return_residual, and whether jax would export dbias then),
    `refuse_residual` (raise on return_residual, except for fx2xla's layout probe),
    `refuse_vjp` (a custom_vjp whose backward raises), `backward_tries`."""
    real = jax.nn.dot_product_attention
    state = SimpleNamespace(calls=[], refuse_residual=False, refuse_vjp=False, backward_tries=0)

    def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                              implementation=None, return_residual=False):
        assert implementation == "cudnn"
        dbias = bias is not None or mask is not None
        if dbias and hasattr(_fa(), "should_export_dbias"):
            dbias = _fa().should_export_dbias((1,) * 4, tuple(query.shape), None)
        state.calls.append(SimpleNamespace(shape=tuple(query.shape), residual=return_residual, dbias=dbias))
        if return_residual and state.refuse_residual and tuple(query.shape) != (1, 16, 2, 64):
            raise NotImplementedError("cuDNN refuses this training forward")

        def fake_cudnn(q, k, v, bias, mask):  # (its name puts "cudnn" in the module's text)
            return real(q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal, implementation="xla",
                        return_residual=return_residual)

        if not state.refuse_vjp:
            return jax.jit(fake_cudnn)(query, key, value, bias, mask)

        @jax.custom_vjp
        def attention(q, k, v, bias, mask):
            return fake_cudnn(q, k, v, bias, mask)

        def backward(res, g):
            state.backward_tries += 1
            raise NotImplementedError("cuDNN's backward refuses this form")

        attention.defvjp(lambda *args: (attention(*args), None), backward)
        return attention(query, key, value, bias, mask)

    monkeypatch.setattr(jax.nn, "dot_product_attention", dot_product_attention)
    return state


@pytest.fixture
def real_cudnn(monkeypatch):
    """jax's real cuDNN attention path, traced for CUDA here: it only asks for cuDNN's version."""
    monkeypatch.setattr(_fa(), "check_cudnn_version", lambda: 91000)


@pytest.fixture
def math_calls(monkeypatch):
    """Counts of the generic (math) attention rules' runs: forward, backward."""
    calls = {"forward": 0, "backward": 0}
    real_forward, real_backward = nn.math_attention, nn.math_attention_grads

    def forward(*args, **kwargs):
        calls["forward"] += 1
        return real_forward(*args, **kwargs)

    def backward(*args, **kwargs):
        calls["backward"] += 1
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(nn, "math_attention", forward)
    monkeypatch.setattr(nn, "math_attention_grads", backward)
    return calls


def _lowered(fn, *specs):
    """`fn` traced on FakeTensors (specs: (shape, dtype)) on cuda:0, planned and lowered for CUDA."""
    with FakeTensorMode():
        fakes = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in specs]
    gm = make_fx(torch.func.functionalize(fn))(*fakes)
    plan = build_plan(gm, fakes, Device("cuda", 0))
    return lower_graph(gm, plan, fakes)


def _lowered_node(op, *specs):
    """A graph of one `op` node (which make_fx would decompose) on cuda:0 FakeTensors, lowered for CUDA."""
    graph, mode = torch.fx.Graph(), FakeTensorMode()
    with mode:
        fakes = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in specs]
    nodes = []
    for i, fake in enumerate(fakes):
        nodes.append(graph.placeholder(f"arg{i}"))
        nodes[-1].meta["val"] = fake
    node = graph.call_function(op, tuple(nodes))
    with mode:
        node.meta["val"] = op(*fakes)
    graph.output((node,))
    gm = torch.fx.GraphModule({}, graph)
    plan = build_plan(gm, fakes, Device("cuda", 0))
    return lower_graph(gm, plan, fakes)


def _run(lowered, *tensors):
    """The CUDA module (free of custom calls) run on the CPU client, outputs as the graph's."""
    launch = make_launcher(compile_module(lowered.module_text, default_device()))
    dev = default_device().jax_device
    outs = launch([import_tensor(t.contiguous(), dev) for t in tensors])
    return wrap_outputs(lowered.outputs, outs, {})


def _qkv(heads=H, seq=L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, seq, D, generator=g).to(BF16) for _ in range(3)]


def _reference(q, k, v, mask=None, causal=False, grad=None):
    """Eager float32 math attention of the bf16 values, its (q, k, v) gradients for `grad`, and
    the float64 log-sum-exp (0 where a row has no key, as the fused kernels' convention)."""
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    m = mask.float() if mask is not None and mask.dtype != torch.bool else mask
    out = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=m, is_causal=causal)
    grads = torch.autograd.grad(out, (q32, k32, v32), grad.float()) if grad is not None else None
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    lse = torch.logsumexp(s, -1)
    return out.detach(), grads, torch.where(lse.isneginf(), 0, lse)


def _flash_forward(q, k, v):
    out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[:2]
    return out, lse  # a training forward: the log-sum-exp is read


# -- the training forward's log-sum-exp (cuDNN's residual) --------------------------------------

@pytest.mark.parametrize("heads", [H, L], ids=["H!=Lq", "H==Lq"])
def test_training_forward_takes_cudnn_log_sum_exp_in_its_layout(torch_has_cuda, xla_cudnn, math_calls, heads):
    """jax 0.10 returns the residual as [B, Lq, H] in bf16: the training forward takes it (no
    silent fall back to the math rules when H != Lq, no transposed values when H == Lq), as the
    float32 [B, H, Lq] log-sum-exp the math rule gives."""
    q, k, v = _qkv(heads)
    lowered = _lowered(_flash_forward, *[((B, heads, L, D), BF16)] * 3)
    assert [c.residual for c in xla_cudnn.calls if c.shape == (B, L, heads, D)] == [True]
    assert math_calls["forward"] == 0
    out, lse = _run(lowered, q, k, v)
    ref, _, ref_lse = _reference(q, k, v, causal=True)
    assert lse.dtype == torch.float32 and lse.shape == (B, heads, L)
    torch.testing.assert_close(lse, ref_lse.float(), **tolerance(BF16))
    torch.testing.assert_close(out.float(), ref, **tolerance(BF16, 2))


@pytest.mark.parametrize("heads", [H, L], ids=["H!=Lq", "H==Lq"])
def test_training_forward_uses_jax_cudnn_residual(torch_has_cuda, real_cudnn, math_calls, heads):
    """The same through jax's real cuDNN path (traced, not run): cuDNN's forward, no math rule."""
    text = _lowered(_flash_forward, *[((B, heads, L, D), BF16)] * 3).module_text
    assert math_calls["forward"] == 0
    assert "__cudnn$fmha" in text


def test_training_forward_refused_by_cudnn_falls_back_to_math(torch_has_cuda, xla_cudnn, math_calls):
    """A training forward cuDNN refuses (its residual) runs the math rule: same values."""
    xla_cudnn.refuse_residual = True
    q, k, v = _qkv()
    lowered = _lowered(_flash_forward, *[((B, H, L, D), BF16)] * 3)
    assert [c.residual for c in xla_cudnn.calls if c.shape == (B, L, H, D)] == [True]  # tried, refused
    assert math_calls["forward"] == 1
    out, lse = _run(lowered, q, k, v)
    ref, _, ref_lse = _reference(q, k, v, causal=True)
    torch.testing.assert_close(lse, ref_lse.float(), **tolerance(BF16))
    torch.testing.assert_close(out.float(), ref, **tolerance(BF16, 2))


# -- the backward -------------------------------------------------------------------------------

def _efficient_backward(g, q, k, v, bias, out, lse, seed, offset):
    return aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False])[:3]


def _backward_inputs(bias):
    """The backward's inputs; the rules recompute from q, k, v: the saved output and
    log-sum-exp are not read (zeros here)."""
    q, k, v = _qkv()
    g = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(9)).to(BF16)
    zero = torch.zeros((), dtype=torch.int64)
    specs = [((B, H, L, D), BF16)] * 4 + [(tuple(bias.shape), bias.dtype), ((B, H, L, D), BF16), ((B, H, 32), torch.float32),
                                          ((), torch.int64), ((), torch.int64)]
    return (g, q, k, v, bias, torch.zeros_like(q), torch.zeros(B, H, 32), zero, zero), specs


def test_cudnn_backward_refused_by_its_vjp_falls_back_to_math(torch_has_cuda, xla_cudnn, math_calls):
    """cuDNN's backward refusing a form its forward took (jax's vjp rule raises): the CUDA
    backward rule runs the math rule, and its gradients are eager's."""
    xla_cudnn.refuse_vjp = True
    bias = torch.randn(1, 1, L, L, generator=torch.Generator().manual_seed(3)).to(BF16)
    args, specs = _backward_inputs(bias)
    lowered = _lowered(_efficient_backward, *specs)
    assert xla_cudnn.backward_tries == 1 and math_calls["backward"] == 1
    g, q, k, v = args[:4]
    _, grads, _ = _reference(q, k, v, mask=bias, grad=g)
    for actual, expected in zip(_run(lowered, *args), grads):
        torch.testing.assert_close(actual.float(), expected, **tolerance(BF16, 4))


def _one_node_graph(op, args, outputs):
    """A CPU graph of one `op` node whose results `outputs` are returned."""
    import operator

    graph, mode = torch.fx.Graph(), FakeTensorMode()
    placeholders = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            node = graph.placeholder(f"arg{i}")
            node.meta["val"] = mode.from_tensor(a)
            placeholders.append(node)
        else:
            placeholders.append(a)
    node = graph.call_function(op, tuple(placeholders))
    with mode:
        node.meta["val"] = op(*[p.meta["val"] if isinstance(p, torch.fx.Node) else p for p in placeholders])
    outs = []
    for i in outputs:
        outs.append(graph.call_function(operator.getitem, (node, i)))
        outs[-1].meta["val"] = node.meta["val"][i]
    graph.output(tuple(outs))
    return torch.fx.GraphModule({}, graph), [p.meta["val"] for p in placeholders if isinstance(p, torch.fx.Node)]


def test_compile_refusal_lowers_again_with_math_rules(monkeypatch, xla_cudnn, math_calls):
    """XLA/cuDNN rejecting a fused-attention module at compile time (after jax's checks let it
    through): the graph is lowered again with the math rules, with a warning, and runs right.
    (A CPU graph given the CUDA rule, whose cuDNN module the stubbed compiler refuses.)"""
    import fx2xla.compiled_graph as compiled_graph
    from fx2xla.lowering.registry import PLATFORM_LOWERINGS

    op = aten._scaled_dot_product_efficient_attention.default
    monkeypatch.setitem(PLATFORM_LOWERINGS, (op, "cpu"), PLATFORM_LOWERINGS[(op, "cuda")])
    texts, real_compile = [], compiled_graph.compile_module

    def compile_refusing_cudnn(text, device, **kwargs):
        texts.append(text)
        if nn.CUDNN_MARKER in text:
            raise RuntimeError("UNIMPLEMENTED: no cuDNN fused MHA plan for these inputs")
        return real_compile(text, device, **kwargs)

    monkeypatch.setattr(compiled_graph, "compile_module", compile_refusing_cudnn)
    q, k, v = _qkv()
    gm, fakes = _one_node_graph(op, (q, k, v, None, False), outputs=[0])  # inference: the output alone
    with pytest.warns(UserWarning, match="cuDNN fused attention did not compile"):
        graph = CompiledGraph(gm, fakes, default_device(), "refused")
    assert len(texts) == 2 and nn.CUDNN_MARKER in texts[0] and nn.CUDNN_MARKER not in texts[1]
    assert len(xla_cudnn.calls) == 1 and math_calls["forward"] == 1  # cuDNN first, then the math rule
    (out,) = graph([q, k, v])
    torch.testing.assert_close(out.float(), _reference(q, k, v)[0], **tolerance(BF16, 2))


def test_package_compile_refusal_lowers_again_with_math_rules(monkeypatch, tmp_path, xla_cudnn, math_calls):
    """The same for a loaded dynamic package compiling a new shape (LoadedModel._new_variant)."""
    import fx2xla
    import fx2xla.package as package
    from fx2xla.lowering.registry import PLATFORM_LOWERINGS

    op = aten.scaled_dot_product_attention.default  # what torch.export keeps
    monkeypatch.setitem(PLATFORM_LOWERINGS, (op, "cpu"), PLATFORM_LOWERINGS[(op, "cuda")])

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q, k, v = _qkv()
    seq = torch.export.Dim("seq", min=2, max=64)
    path = fx2xla.export(Attention(), (q, k, v), str(tmp_path / "pkg"),
                         dynamic_shapes={"q": {2: seq}, "k": {2: seq}, "v": {2: seq}})
    run = fx2xla.load(path)
    texts, real_compile = [], package.compile_module

    def compile_refusing_cudnn(text, device, **kwargs):
        texts.append(text)
        if nn.CUDNN_MARKER in text:
            raise RuntimeError("UNIMPLEMENTED: no cuDNN fused MHA plan for these inputs")
        return real_compile(text, device, **kwargs)

    monkeypatch.setattr(package, "compile_module", compile_refusing_cudnn)  # where the package reads it
    q, k, v = _qkv(seq=8, seed=1)
    with pytest.warns(UserWarning, match="cuDNN fused attention did not compile"):
        out = run(q, k, v)
    assert len(texts) == 2 and nn.CUDNN_MARKER in texts[0] and nn.CUDNN_MARKER not in texts[1]
    assert math_calls["forward"] == 1  # the second lowering: the math rule
    torch.testing.assert_close(out.float(), _reference(q, k, v)[0], **tolerance(BF16, 2))


# -- fully masked rows ----------------------------------------------------------------------------

def _masks():
    """A bool mask and a -inf float mask, each with a fully masked row (and a partly masked one)."""
    keep = torch.ones(B, 1, L, L, dtype=torch.bool)
    keep[0, 0, 3] = False  # every key masked for query 3 of batch 0
    keep[1, 0, 5, :7] = False
    return {"bool": keep, "-inf": torch.zeros(keep.shape).masked_fill(~keep, -math.inf).to(BF16)}


@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_fully_masked_rows_match_eager_on_cudnn(torch_has_cuda, xla_cudnn, math_calls, kind):
    """Through cuDNN's attention (inference, then training forward and backward), a row whose
    every key is masked gives 0 as eager does, not the mean of v (a bool mask: jax's large
    negative) nor NaN (a -inf bias); its log-sum-exp is 0 and its gradients are 0."""
    mask = _masks()[kind]
    q, k, v = _qkv()
    ref, _, ref_lse = _reference(q, k, v, mask=mask)

    lowered = _lowered_node(aten.scaled_dot_product_attention.default, *[((B, H, L, D), BF16)] * 3,
                            (tuple(mask.shape), mask.dtype))
    out = _run(lowered, q, k, v, mask)[0]
    assert math_calls["forward"] == 0 and xla_cudnn.calls
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    torch.testing.assert_close(out.float(), ref, **tolerance(BF16, 2))
    if kind == "bool":
        return  # the fused kernels' own ops take float biases

    def training(q, k, v, bias, g):
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)
        grads = aten._scaled_dot_product_efficient_attention_backward(
            g, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False])
        return out, lse, *grads[:3]

    g = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(9)).to(BF16)
    lowered = _lowered(training, *[((B, H, L, D), BF16)] * 3, (tuple(mask.shape), BF16), ((B, H, L, D), BF16))
    assert math_calls == {"forward": 0, "backward": 0}
    out, lse, *grads = _run(lowered, q, k, v, mask, g)
    _, ref_grads, _ = _reference(q, k, v, mask=mask, grad=g)
    torch.testing.assert_close(out.float(), ref, **tolerance(BF16, 2))
    torch.testing.assert_close(lse[..., :L], ref_lse.float(), **tolerance(BF16))
    assert torch.equal(lse[0, :, 3], torch.zeros_like(lse[0, :, 3]))
    for actual, expected in zip(grads, ref_grads):
        assert actual.isfinite().all()
        torch.testing.assert_close(actual.float(), expected, **tolerance(BF16, 4))
    assert torch.equal(grads[0][0, :, 3], torch.zeros_like(grads[0][0, :, 3]))


@pytest.mark.parametrize("kind", ["bool", "-inf"])
def test_fully_masked_rows_match_eager_on_math_rules(kind):
    """fx2xla's math rule (the CPU's attention) gives eager's 0 for a fully masked row, and
    eager's gradients (float32: 1e-4 / 1e-5)."""
    mask = _masks()[kind]
    mask = mask if kind == "bool" else mask.float()
    q, k, v = (t.float().requires_grad_() for t in _qkv())

    def f(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    out = torch.compile(f, backend="fx2xla", options={"fallback": "error"})(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = f(q, k, v)
    ref_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    for actual, ref in zip(grads, ref_grads):
        torch.testing.assert_close(actual, ref, **tolerance(torch.float32))


# -- dbias ----------------------------------------------------------------------------------------

_BACKWARD = re.compile(r"%\w+:(\d+) = stablehlo\.custom_call @__cudnn\$fmha\w*Backward")


@pytest.mark.parametrize("path", ["private", "public"])
def test_cudnn_backward_exports_no_unread_dbias(monkeypatch, torch_has_cuda, real_cudnn, math_calls, path):
    """jax's cuDNN backward computes dbias whenever a bias exists; fx2xla never reads it (a
    wanted bias gradient runs the math rules). Private path: jax's should_export_dbias answers
    False inside fx2xla's traces (dq, dk, dv and the workspace: 4 results), and stays jax's
    elsewhere; public fallback, where that function moved: dbias exported (5 results)."""
    if path == "public":
        monkeypatch.setattr(nn, "fused_attention_module", lambda: SimpleNamespace())
    bias = torch.zeros(1, 1, L, L, dtype=BF16)
    text = _lowered(_efficient_backward, *_backward_inputs(bias)[1]).module_text
    assert math_calls["backward"] == 0
    assert [int(n) for n in _BACKWARD.findall(text)] == [4 if path == "private" else 5], _BACKWARD.findall(text)
    assert _fa().should_export_dbias((1, 1, L, L), (B, L, H, D), None)  # others still get jax's answer


def test_cudnn_attention_sees_no_dbias_export(torch_has_cuda, xla_cudnn):
    """Inside the CUDA rules' calls, jax is told to export no dbias (what the real path reads)."""
    bias = torch.zeros(1, 1, L, L, dtype=BF16)
    _lowered(_efficient_backward, *_backward_inputs(bias)[1])
    assert xla_cudnn.calls and all(c.dbias is False for c in xla_cudnn.calls)
