"""Host offloading (fx2xla/offload.py): `fx2xla.place_to_host` / `fx2xla.place_to_device` inside
and outside compiled code, the `offload` option on a small training step (one device, SPMD, the
disk cache), its errors, `explain_memory` and the metrics.

On the CPU client (these tests) XLA compiles the host memory kind into the executable's layout
(`S(5)` in the entry computation layout, "pinned_host" among the executable's output memory
kinds) and drops the placement annotations inside the module: its device memory is host memory,
so nothing is measured here beyond what the executable says (fx2xla/offload.py).
Float comparisons with eager use tests/conftest.py's tolerances (float32: rtol 1e-4, atol 1e-5;
bfloat16: rtol 1.6e-2, atol 1e-2); integers are exact.
"""
from __future__ import annotations

import copy
import re

import jax
import pytest
import torch
import torch.nn.functional as F

import fx2xla
from fx2xla import offload
from fx2xla.metrics import live_graphs
from fx2xla.runtime import executable_cache

from tests.conftest import tolerance

HOST = 'mhlo.memory_kind = "pinned_host"'


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def snapshot() -> set:
    return {id(g) for g in live_graphs}


def graphs_since(before: set) -> dict:
    """The graphs compiled since `before`, by kind (forward, backward, inference)."""
    return {g.name.rsplit("_", 1)[-1]: g for g in sorted(live_graphs, key=lambda g: g.name) if id(g) not in before}


def module(graph) -> str:
    return graph.static.lowered.module_text


def func_signature(text: str) -> tuple[str, str]:
    """(arguments, results) of the module's main function, as text."""
    line = next(l for l in text.splitlines() if "func.func public @main" in l)
    args, _, results = line.partition(") -> (")
    return args, results


# -- the ops -------------------------------------------------------------------------------------------

def _round_trip(x, w):
    h = torch.tanh(x * w) if x.is_floating_point() else x * w
    kept = fx2xla.place_to_host(h)
    back = fx2xla.place_to_device(kept)
    return back * 2 + kept.sum()  # `kept` is also read directly: through an inserted place_to_device


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (4, 8)), (torch.bfloat16, (4, 8)), (torch.int64, (4, 8)),
                                         (torch.float32, ()), (torch.int64, ())],
                         ids=["f32", "bf16", "i64", "f32-0d", "i64-0d"])
def test_values_and_gradients_match_eager(dtype, shape):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        x0, w0 = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    else:
        x0, w0 = torch.randint(-50, 50, shape, generator=g), torch.randint(-50, 50, shape, generator=g)
    grads = dtype.is_floating_point

    def run(fn):
        x, w = x0.clone().requires_grad_(grads), w0.clone().requires_grad_(grads)
        out = fn(x, w)
        if grads:
            out.float().square().sum().backward()
        return out.detach(), (x.grad, w.grad) if grads else ()

    before = snapshot()
    expected, expected_grads = run(_round_trip)
    actual, actual_grads = run(torch.compile(_round_trip, backend="fx2xla", fullgraph=True,
                                             options={"fallback": "error"}))
    assert actual.dtype == dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, **tolerance(dtype))
    for a, e in zip(actual_grads, expected_grads):
        torch.testing.assert_close(a, e, **tolerance(dtype))
    graphs = graphs_since(before)
    assert set(graphs) == ({"forward", "backward"} if grads else {"inference"})
    for g in graphs.values():  # the StableHLO says where the values live
        text = module(g)
        assert '_xla_buffer_placement = "pinned_host"' in text
        assert '_xla_buffer_placement = "device"' in text


def test_eager_identity_and_gradient_goes_back():
    x = torch.randn(3, 5, requires_grad=True)
    h = fx2xla.place_to_host(x)
    d = fx2xla.place_to_device(h)
    assert torch.equal(h, x) and torch.equal(d, x) and h is not x
    assert h.grad_fn is not None and "place_to_host" in h.grad_fn.name()
    (d * torch.arange(5.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(5.0).expand(3, 5))
    # The gradient of place_to_host is place_to_device of the incoming gradient, and back.
    joint = torch.fx.experimental.proxy_tensor.make_fx(
        lambda t, g: torch.autograd.grad(fx2xla.place_to_host(t), t, g))(x.detach().requires_grad_(), torch.ones(3, 5))
    targets = [n.target for n in joint.graph.nodes if n.op == "call_function"]
    assert offload.place_to_host_op in targets and offload.place_to_device_op in targets


def test_host_value_returned_from_a_graph_is_in_device_memory():
    fn = torch.compile(lambda x: fx2xla.place_to_host(x * 3), backend="fx2xla", options={"fallback": "error"})
    before = snapshot()
    x = torch.randn(6)
    torch.testing.assert_close(fn(x), x * 3)
    (g,) = graphs_since(before).values()
    _, results = func_signature(module(g))
    assert "pinned_host" not in results  # torch's tensors live in device memory
    assert g.static.exe.get_output_memory_kinds() == [["device"]]


# -- options and errors --------------------------------------------------------------------------------

def test_unknown_offload_value_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"offload='weights'.*'activations' or 'optimizer'"):
        offload.parse_offload("weights")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match=r"'activations' or 'optimizer'"):
        torch.compile(model, backend="fx2xla", options={"offload": ["activations", "gradients"]})(torch.randn(2, 4))
    assert offload.parse_offload(None) == frozenset()
    assert offload.parse_offload(("optimizer", "activations")) == {"activations", "optimizer"}


def test_device_without_host_memory_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(offload, "memory_kinds", lambda device: ["device"])
    model = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match=r"device cpu:0 .*has none: its memory kinds are \['device'\]") as info:
        torch.compile(model, backend="fx2xla", options={"offload": "activations"})(torch.randn(2, 4))
    assert isinstance(info.value, offload.OffloadError) or isinstance(info.value.__cause__, offload.OffloadError) \
        or isinstance(getattr(info.value, "inner_exception", None), offload.OffloadError)
    with pytest.raises(Exception, match=r"place_to_host/place_to_device needs the 'pinned_host' memory kind"):
        torch.compile(lambda x: fx2xla.place_to_host(x) + 1, backend="fx2xla")(torch.randn(3))


def test_cpu_client_has_host_memory():
    kinds = {m.kind for m in jax.devices("cpu")[0].addressable_memories()}
    assert {"device", "pinned_host", "unpinned_host"} <= kinds


# -- training with offload -----------------------------------------------------------------------------

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def train(model, x, y, options=None, compiled=True, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    forward = torch.compile(model, backend="fx2xla", options=options) if compiled else model
    step = torch.compile(opt.step, backend="fx2xla", options=options) if compiled else opt.step
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), opt


def _device_puts(monkeypatch) -> list:
    """The memory kinds jax.device_put was asked for (a host input not handed over as the buffer
    the previous graph left it in is copied there by one)."""
    calls = []
    original = jax.device_put

    def spy(x, device=None, *args, **kwargs):
        calls.append(getattr(device, "memory_kind", None))
        return original(x, device, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    return calls


def test_activations_and_optimizer_state_live_in_host_memory(monkeypatch):
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    model, reference = mlp(), mlp()
    expected, ref_opt = train(reference, x, y, compiled=False)
    metrics0 = fx2xla.metrics()
    before = snapshot()
    puts = _device_puts(monkeypatch)
    losses, opt = train(model, x, y, {"offload": ["activations", "optimizer"]})
    torch.testing.assert_close(losses, expected, **tolerance(torch.float32))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, **tolerance(torch.float32))
    graphs = graphs_since(before)
    fw, bw, step = graphs["forward"], graphs["backward"], graphs["inference"]
    # The forward leaves the activations it saves for the backward in host memory ...
    saved = [r for r in fw.plan.results if r.memory_kind == "pinned_host"]
    assert {r.node.name for r in saved} == {"addmm", "gelu"}  # (x and the weights are inputs: not copied)
    assert fw.plan.results[0].memory_kind is None  # the user's output stays on the device
    _, results = func_signature(module(fw))
    assert results.count(HOST) == len(saved)
    assert fw.static.exe.get_output_memory_kinds()[0].count("pinned_host") == len(saved)
    # ... and the backward takes them from there.
    bw_host = [n.name for n, p in zip([n for n in bw.gm.graph.nodes if n.op == "placeholder"], bw.plan.inputs)
               if p.memory_kind == "pinned_host"]
    assert sorted(bw_host) == ["addmm", "gelu"]
    args, _ = func_signature(module(bw))
    assert args.count(HOST) == 2
    assert "S(5)" in _entry_layout(bw)
    # AdamW's moments: in host memory in and out of the step (parameters and step counts are not).
    state = [s for p in model.parameters() for s in (opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    host_inputs = [p for p in step.plan.inputs if p.memory_kind == "pinned_host"]
    assert len(host_inputs) == len(state) == 8
    assert len([r for r in step.plan.results if r.memory_kind == "pinned_host"]) == 8
    for s, ref in zip(state, [s for p in reference.parameters() for s in (ref_opt.state[p]["exp_avg"],
                                                                           ref_opt.state[p]["exp_avg_sq"])]):
        torch.testing.assert_close(s, ref, **tolerance(torch.float32))
    # Zero-copy hand-offs: only the first step's moments (fresh torch tensors) are copied into host
    # memory; the activations and later moments arrive as the buffers the graphs left there.
    assert puts.count("pinned_host") == 8
    # metrics(): bytes per call, counted per execution.
    m = fx2xla.metrics()
    act = (32 * 64 + 32 * 64) * 4
    moments = 2 * sum(p.numel() for p in model.parameters()) * 4
    assert fw.offload_per_call == (act, 0) and bw.offload_per_call == (0, act)
    assert step.offload_per_call == (moments, moments)
    assert m["offloaded_bytes"] - metrics0["offloaded_bytes"] == 3 * (act + moments)
    assert m["reloaded_bytes"] - metrics0["reloaded_bytes"] == 3 * (act + moments)


def _entry_layout(graph) -> str:
    from fx2xla.runtime.executor import optimized_hlo_text

    return offload.entry_layout(optimized_hlo_text(graph.static.exe))


def test_explain_memory_reports_bytes_per_memory_kind():
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    before = snapshot()
    train(mlp(), x, y, {"offload": "activations"}, steps=1)
    fw_off, bw_off = graphs_since(before)["forward"], graphs_since(before)["backward"]
    torch._dynamo.reset()
    before = snapshot()
    train(mlp(), x, y, None, steps=1)
    fw_base = graphs_since(before)["forward"]
    act = (32 * 64 + 32 * 64) * 4
    on, base = offload.memory_by_kind(fw_off), offload.memory_by_kind(fw_base)
    # XLA's compiled layout: the saved activations moved from device to host memory.
    assert on["results"]["pinned_host"] == act and "pinned_host" not in base["results"]
    assert on["results"]["device"] == base["results"]["device"] - act
    assert offload.memory_by_kind(bw_off)["arguments"]["pinned_host"] == act
    # XLA:CPU's memory analysis does not split host bytes out: its host_* fields stay 0 and the
    # host results count among the device's, the same bytes as without offloading.
    xla_on, xla_base = on["xla"], base["xla"]
    assert xla_on["host_output_size_in_bytes"] in (0, act)
    if xla_on["host_output_size_in_bytes"] == 0:
        assert xla_on["output_size_in_bytes"] == xla_base["output_size_in_bytes"]
    else:  # a runtime that splits them: fewer device bytes
        assert xla_on["output_size_in_bytes"] == xla_base["output_size_in_bytes"] - act
    report = fx2xla.explain_memory([fw_off, bw_off])
    assert re.search(r"results by memory kind \(XLA's compiled layout, per device\): device .*, pinned_host 16\.0 KiB",
                     report)
    assert "left there" in report and "result addmm" in report and "input gelu" in report
    assert "XLA's memory analysis (per device)" in report
    assert fw_base.name in fx2xla.explain_memory()  # every live graph


# -- interplay -----------------------------------------------------------------------------------------

def test_sharded_activations_are_offloaded_as_shards(monkeypatch):
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    reference = mlp()
    expected, _ = train(reference, x.clone(), y, compiled=False)
    model = mlp()
    mesh = fx2xla.Mesh((8,), ("data",))
    fx2xla.mark_sharding(x, mesh, ("data", None))
    before = snapshot()
    puts = _device_puts(monkeypatch)
    losses, _ = train(model, x, y, {"offload": "activations"})
    torch.testing.assert_close(losses, expected, **tolerance(torch.float32))
    graphs = graphs_since(before)
    fw, bw = graphs["forward"], graphs["backward"]
    assert fw.mesh is mesh and bw.mesh is mesh
    saved = [r for r in fw.plan.results if r.memory_kind == "pinned_host"]
    assert saved and all(r.sharding[0] == ("data",) for r in saved)  # split over the batch, as computed
    assert fw.static.exe.get_output_memory_kinds()[0].count("pinned_host") == len(saved)
    # Per device: its shard of each activation.
    assert fw.offload_per_call[0] == sum(r.node.meta["val"].numel() for r in saved) * 4 // 8
    assert offload.memory_by_kind(fw)["results"]["pinned_host"] == fw.offload_per_call[0]
    assert "pinned_host" not in puts  # the backward took the host shards as the forward left them


def test_disk_cache_keeps_the_memory_kinds(monkeypatch):
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    expected, _ = train(mlp(), x, y, compiled=False, steps=2)
    first, _ = train(mlp(), x, y, {"offload": "activations"}, steps=2)
    torch._dynamo.reset()
    executable_cache.clear()  # the next compile must come from disk
    hits = fx2xla.metrics()["disk_hits"]
    before = snapshot()
    again, _ = train(mlp(), x, y, {"offload": "activations"}, steps=2)
    assert fx2xla.metrics()["disk_hits"] > hits
    torch.testing.assert_close(first, expected, **tolerance(torch.float32))
    assert torch.equal(again, first)
    fw = graphs_since(before)["forward"]
    assert "pinned_host" in fw.static.exe.get_output_memory_kinds()[0]


def test_saved_activations_are_the_host_buffers_themselves():
    """Between forward and backward, torch holds each offloaded activation as a tensor over the
    very buffer XLA left in pinned_host memory (zero-copy on the CPU client)."""
    from fx2xla.sharding import sharded_twins

    model = torch.compile(mlp(), backend="fx2xla", options={"offload": "activations"})
    earlier = set(sharded_twins())
    loss = F.mse_loss(model(torch.randn(32, 16)), torch.randn(32, 16))  # forward only, so far
    host = [(ptr, array) for key, (_, ptr, array) in sharded_twins().items()
            if key not in earlier and array.sharding.memory_kind == "pinned_host" and not array.is_deleted()]
    assert len(host) >= 2
    assert all(ptr == array.unsafe_buffer_pointer() for ptr, array in host)
    loss.backward()
