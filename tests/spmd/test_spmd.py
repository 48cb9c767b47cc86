"""SPMD on 8 virtual CPU devices (tests/conftest.py): a mesh, mark_sharding eagerly and inside
compiled code, shard_module, fsdp; data parallel, Megatron tensor parallel (MLP, attention), a
2-D mesh and FSDP. Every result is compared with eager PyTorch on the same inputs (float32:
rtol 1e-4, atol 1e-5; bfloat16: rtol 1.6e-2, atol 1e-2, as tests/conftest.py states), five
training steps with eager's and with fx2xla's on one device; the optimized HLO must hold the
collectives the plan implies, and each device's memory_analysis() must shrink as the plan says."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fx2xla
from fx2xla.metrics import live_graphs
from fx2xla.runtime.executor import optimized_hlo_text
from fx2xla.sharding import ShardingError, collectives, normalize_spec

from tests.conftest import tolerance


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def graphs_since(before: set) -> list:
    return sorted((g for g in live_graphs if id(g) not in before), key=lambda g: g.name)


def snapshot() -> set:
    return {id(g) for g in live_graphs}


def ops_in(graph) -> list[str]:
    return [c.op for c in collectives(optimized_hlo_text(graph.static.exe))]


def memory(graph):
    return graph.static.exe.get_compiled_memory_stats()


def mlp(d=16, h=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.GELU(), torch.nn.Linear(h, d))


MEGATRON_MLP = {"0.weight": ("model", None), "0.bias": ("model",), "2.weight": (None, "model")}


# -- API -----------------------------------------------------------------------------------------

def test_mesh_uses_the_real_device_list():
    import jax

    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    assert mesh.shape == {"data": 2, "model": 4} and mesh.size == 8
    assert mesh.device_ids == tuple(d.id for d in jax.devices("cpu"))
    assert "data=2" in repr(mesh)
    with pytest.raises(ShardingError, match="needs 16 cpu devices"):
        fx2xla.Mesh((4, 4), ("a", "b"))
    with pytest.raises(ShardingError, match="2 mesh dims"):
        fx2xla.Mesh((2, 4), ("a",))
    with pytest.raises(ShardingError, match="distinct"):
        fx2xla.Mesh((2, 4), ("a", "a"))
    explicit = fx2xla.Mesh(jax.devices("cpu")[4:], ("x",))
    assert explicit.device_ids == (4, 5, 6, 7)


def test_spec_spellings_agree():
    """Axis names, PyTorch/XLA's axis indices, tuples, short specs and DTensor placements
    name the same sharding; mistakes raise ShardingError naming the spec."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    want = (("data",), ("model",), ())
    assert normalize_spec(("data", "model", None), 3, mesh) == want
    assert normalize_spec((0, 1), 3, mesh) == want
    assert normalize_spec([Shard(0), Shard(1)], 3, mesh) == want
    assert normalize_spec([Replicate(), Shard(-1)], 2, mesh) == ((), ("model",))
    assert normalize_spec(((("data", "model")), None), 2, mesh) == (("data", "model"), ())
    assert normalize_spec((), 0, mesh) == ()
    with pytest.raises(ShardingError, match="unknown mesh axis 'batch'"):
        normalize_spec(("batch",), 1, mesh)
    with pytest.raises(ShardingError, match="used twice"):
        normalize_spec(("data", "data"), 2, mesh)
    with pytest.raises(ShardingError, match="3 entries for a 2-d"):
        normalize_spec(("data", None, None), 2, mesh)
    t = torch.randn(4, 8)
    assert fx2xla.mark_sharding(t, mesh, ("data", "model")) is t
    assert t._fx2xla_sharding.spec == (("data",), ("model",))
    fx2xla.clear_sharding(t)
    assert not hasattr(t, "_fx2xla_sharding")


def test_shard_module_and_fsdp_report_and_refuse():
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    model = mlp()
    assert fx2xla.shard_module(model, mesh, {"*.weight": ("model", None)}) == {
        "0.weight": (("model",), ()), "2.weight": (("model",), ())}
    with pytest.raises(ShardingError, match=r"\['*nothing*'\]|match no parameter"):
        fx2xla.shard_module(model, mesh, {"nothing*": ("model",)})
    with pytest.raises(ShardingError, match="no axis 'fsdp'"):
        fx2xla.fsdp(model, mesh)
    flat = fx2xla.Mesh((8,), ("fsdp",))
    odd = torch.nn.Linear(3, 5)  # no dim divisible by 8: stays replicated
    assert fx2xla.fsdp(odd, flat) == {}
    assert fx2xla.fsdp(mlp(), flat) == {"0.weight": (("fsdp",), ()), "0.bias": (("fsdp",),),
                                        "2.weight": ((), ("fsdp",)), "2.bias": (("fsdp",),)}


# -- inference -------------------------------------------------------------------------------------

def test_data_parallel_forward():
    mesh = fx2xla.Mesh((8,), ("data",))
    model, x = mlp(), torch.randn(32, 16)
    expected = model(x)
    fx2xla.mark_sharding(x, mesh, ("data", None))
    before = snapshot()
    with torch.no_grad():
        out = torch.compile(model, backend="fx2xla")(x)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    assert out.shape == (32, 16) and out.is_contiguous() and out.device.type == "cpu"
    (g,) = graphs_since(before)
    assert g.mesh is mesh
    assert g.plan.results[0].sharding == (("data",), ())
    assert ops_in(g) == []  # replicated weights, sharded batch: nothing to communicate
    # Each device holds 1/8 of x and all of the weights.
    weights = sum(p.numel() for p in model.parameters()) * 4
    assert memory(g).argument_size_in_bytes == weights + x.numel() * 4 // 8


def test_megatron_mlp_on_a_2d_mesh():
    """Column-parallel then row-parallel Linear: one all-reduce, weights split 4 ways."""
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    model, x = mlp(), torch.randn(8, 16)
    expected = model(x)
    fx2xla.shard_module(model, mesh, MEGATRON_MLP)
    fx2xla.mark_sharding(x, mesh, ("data", None))
    before = snapshot()
    with torch.no_grad():
        out = torch.compile(model, backend="fx2xla")(x)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    (g,) = graphs_since(before)
    assert ops_in(g) == ["all-reduce"]
    w1, b1, w2, b2 = (p.numel() * 4 for p in model.parameters())
    assert memory(g).argument_size_in_bytes == w1 // 4 + b1 // 4 + w2 // 4 + b2 + x.numel() * 4 // 2
    report = fx2xla.explain_sharding(g)
    assert "('model', None)" in report and "user" in report and "propagated" in report and "default" in report
    assert "all-reduce x1" in report and "memory per device" in report
    assert "0.weight" in report and "2.bias" in report  # inputs by the user's names


class Attention(torch.nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape

        def split(t):
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.o(att.transpose(1, 2).reshape(b, s, d))


ATTENTION_TP = {"q.weight": ("model", None), "k.weight": ("model", None), "v.weight": ("model", None),
                "q.bias": ("model",), "k.bias": ("model",), "v.bias": ("model",), "o.weight": (None, "model")}


def test_megatron_attention():
    """Heads split over `model` (q/k/v column-parallel, o row-parallel): one all-reduce."""
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    torch.manual_seed(0)
    model, x = Attention(), torch.randn(4, 8, 32)
    expected = model(x)
    fx2xla.shard_module(model, mesh, ATTENTION_TP)
    fx2xla.mark_sharding(x, mesh, ("data", None, None))
    before = snapshot()
    with torch.no_grad():
        out = torch.compile(model, backend="fx2xla")(x)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    (g,) = graphs_since(before)
    assert ops_in(g).count("all-reduce") == 1 and "all-gather" not in ops_in(g)


def test_bf16_megatron_mlp():
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    model, x = mlp().to(torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    expected = model(x)
    fx2xla.shard_module(model, mesh, MEGATRON_MLP)
    with torch.no_grad():
        out = torch.compile(model, backend="fx2xla")(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, **tolerance(torch.bfloat16))


def test_sharded_embedding_with_int64_ids():
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    torch.manual_seed(0)
    emb, ids = torch.nn.Embedding(100, 32), torch.randint(0, 100, (4, 6))
    expected = emb(ids)
    fx2xla.mark_sharding(emb.weight, mesh, (None, "model"))
    fx2xla.mark_sharding(ids, mesh, ("data", None))
    before = snapshot()
    with torch.no_grad():
        out = torch.compile(emb, backend="fx2xla")(ids)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    (g,) = graphs_since(before)
    assert g.plan.results[0].sharding == (("data",), (), ("model",))


def test_mark_sharding_inside_compiled_code():
    """A constraint inside compiled code, its result used or discarded, reaches the module;
    its gradient carries the same constraint in the backward graph."""
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    torch.manual_seed(0)
    x, w = torch.randn(8, 16), torch.randn(16, 32, requires_grad=True)

    def used(x, w):
        h = fx2xla.mark_sharding(x @ w, mesh, ("data", "model"))
        return torch.relu(h).sum(0)

    def discarded(x, w):
        h = x @ w
        fx2xla.mark_sharding(h, mesh, ("data", "model"))
        return torch.relu(h).sum(0)

    for fn in (used, discarded):
        torch._dynamo.reset()
        w.grad = None
        fn(x, w).sum().backward()
        expected_grad = w.grad.clone()
        expected = fn(x, w)
        w.grad = None
        before = snapshot()
        out = torch.compile(fn, backend="fx2xla")(x, w)
        torch.testing.assert_close(out, expected, **tolerance(torch.float32))
        out.sum().backward()
        torch.testing.assert_close(w.grad, expected_grad, **tolerance(torch.float32))
        fw, bw = sorted(graphs_since(before), key=lambda g: "backward" in g.name)
        for g in (fw, bw):
            assert g.mesh is mesh
            assert any(n.target is torch.ops.fx2xla.mark_sharding.default for n in g.gm.graph.nodes), g.name
        # The discarded constraint still shards the value relu reads.
        marks = [n for n in fw.gm.graph.nodes if n.target is torch.ops.fx2xla.mark_sharding.default]
        assert any(u.target is torch.ops.aten.relu.default for m in marks for u in m.users)


def test_two_meshes_in_one_graph_are_refused():
    a, b = fx2xla.Mesh((8,), ("x",)), fx2xla.Mesh((8,), ("y",))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    fx2xla.mark_sharding(x, a, ("x", None))
    fx2xla.mark_sharding(y, b, ("y", None))
    with pytest.raises(ShardingError, match="several meshes"):
        torch.compile(lambda x, y: x + y, backend="fx2xla")(x, y)


def test_resident_sharded_parameters_are_not_resharded():
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    model = mlp()
    fx2xla.shard_module(model, mesh, MEGATRON_MLP)
    compiled = torch.compile(model, backend="fx2xla")
    before = snapshot()
    with torch.no_grad():
        compiled(torch.randn(8, 16))
        (g,) = graphs_since(before)
        first = [r.buffer if r else None for r in g.resident_buffers()]
        out = compiled(x := torch.randn(8, 16))
        again = [r.buffer if r else None for r in g.resident_buffers()]
    assert any(b is not None for b in first)
    assert all(a is b for a, b in zip(first, again))  # the same device buffers
    assert len(first[0].sharding.device_set) == 8
    torch.testing.assert_close(out, model(x), **tolerance(torch.float32))


# -- training -----------------------------------------------------------------------------------

def _plan(name: str, model, x):
    if name == "dp":
        mesh = fx2xla.Mesh((8,), ("data",))
        fx2xla.mark_sharding(x, mesh, ("data", None))
    elif name == "dp_x_tp":
        mesh = fx2xla.Mesh((2, 4), ("data", "model"))
        fx2xla.shard_module(model, mesh, MEGATRON_MLP)
        fx2xla.mark_sharding(x, mesh, ("data", None))
    else:
        mesh = fx2xla.Mesh((8,), ("fsdp",))
        fx2xla.fsdp(model, mesh, axis="fsdp")
        fx2xla.mark_sharding(x, mesh, ("fsdp", None))
    return mesh


def _train(model, x, y, backend, steps=5):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    forward = torch.compile(model, backend=backend) if backend else model
    step = torch.compile(opt.step, backend=backend) if backend else opt.step
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses), opt, forward


@pytest.mark.parametrize("plan", ["dp", "dp_x_tp", "fsdp"])
def test_five_training_steps_match_one_device(plan):
    model = mlp()
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    eager_model, single_model = copy.deepcopy(model), copy.deepcopy(model)
    eager_losses, *_ = _train(eager_model, x.clone(), y, None)
    single_losses, *_ = _train(single_model, x.clone(), y, "fx2xla")
    torch._dynamo.reset()
    mesh = _plan(plan, model, x)
    before = snapshot()
    losses, opt, forward = _train(model, x, y, "fx2xla")
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses, eager_losses, **tol)
    torch.testing.assert_close(losses, single_losses, **tol)
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q, **tol)
    graphs = {g.name.rsplit("_", 1)[-1]: g for g in graphs_since(before)}
    fw, bw, step = graphs["forward"], graphs["backward"], graphs["inference"]
    assert fw.mesh is bw.mesh is mesh
    if plan == "dp":  # nothing in the optimizer step is sharded: it runs on one device
        assert step.mesh is None
    else:
        assert step.mesh is mesh
        assert ops_in(step) == []  # every parameter updates where its shard lives
    params = sum(p.numel() for p in model.parameters()) * 4
    if plan == "dp":
        assert "all-reduce" in ops_in(bw)  # gradients of replicated weights summed over the batch
        assert ops_in(fw) == []
    elif plan == "dp_x_tp":
        assert "all-reduce" in ops_in(fw) and "all-reduce" in ops_in(bw)
    else:  # FSDP: gather the weights to use them, reduce-and-scatter their gradients
        assert "all-gather" in ops_in(fw)
        assert set(ops_in(bw)) & {"reduce-scatter", "all-reduce"}
        # Each device holds 1/8 of the parameters and of AdamW's two moments, in every graph.
        assert memory(fw).argument_size_in_bytes <= params // 8 + x.numel() * 4 // 8
        assert memory(step).argument_size_in_bytes <= 4 * params // 8 + 64
        p0 = next(iter(model.parameters()))
        assert opt.state[p0]["exp_avg"].shape == p0.shape  # torch still sees whole tensors
        # The step's new parameter shards stay on their devices: the next forward takes them
        # as they are instead of splitting the parameter again.
        from fx2xla.sharding import sharded_twin

        twin = sharded_twin(p0)
        assert len(twin.sharding.device_set) == 8 and not twin.sharding.is_fully_replicated
        forward(x)
        assert any(r is not None and r.tensor is p0 and r.buffer is twin for r in fw.resident_buffers())


@torch.library.custom_op("fx2xla_spmd_test::halve", mutates_args=())
def _halve(x: torch.Tensor) -> torch.Tensor:
    return x / 2


@_halve.register_fake
def _(x):
    return torch.empty_like(x)


def test_sharded_graph_with_eager_islands_is_refused():
    mesh = fx2xla.Mesh((8,), ("data",))
    x = torch.randn(8, 4)
    fx2xla.mark_sharding(x, mesh, ("data", None))
    with pytest.raises(ShardingError, match="sharded over a mesh but has ops without a lowering rule.*halve"):
        torch.compile(lambda x: _halve(x * 2) + 1, backend="fx2xla")(x)


def test_sharded_buffer_and_its_update():
    """A BatchNorm's running statistics (buffers, written in the graph) sharded with the
    channels: values and the buffers' new contents match eager."""
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    torch.manual_seed(0)
    bn, x = torch.nn.BatchNorm1d(8), torch.randn(16, 8)
    ref = copy.deepcopy(bn)
    expected = ref(x)
    marked = fx2xla.shard_module(bn, mesh, {"weight": ("model",), "bias": ("model",),
                                            "running_*": ("model",)})
    assert set(marked) == {"weight", "bias", "running_mean", "running_var"}
    fx2xla.mark_sharding(x, mesh, ("data", "model"))
    out = torch.compile(bn, backend="fx2xla")(x)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    torch.testing.assert_close(bn.running_mean, ref.running_mean, **tolerance(torch.float32))
    torch.testing.assert_close(bn.running_var, ref.running_var, **tolerance(torch.float32))
    assert bn.num_batches_tracked == ref.num_batches_tracked


def test_backward_takes_the_forwards_shards(monkeypatch):
    """Saved activations the forward left sharded reach the backward as those shards (no new
    split of the whole tensor), and the gradients still match eager."""
    from fx2xla.sharded_call import PlacedHandOff
    from fx2xla.sharding import sharded_twins

    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    model, x = mlp(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    F.mse_loss(ref(x), torch.zeros(8, 16)).backward()
    fx2xla.shard_module(model, mesh, MEGATRON_MLP)
    fx2xla.mark_sharding(x, mesh, ("data", None))
    before = snapshot()
    out = torch.compile(model, backend="fx2xla")(x)
    (fw,) = graphs_since(before)
    taken, split = [], []
    real_hand_off = PlacedHandOff.__call__

    def hand_off(self, t, sharding, *rest):
        buf = real_hand_off(self, t, sharding, *rest)
        twin = sharded_twins().get(id(t))
        (taken if twin is not None and twin.array is buf else split).append(tuple(t.shape))
        return buf

    monkeypatch.setattr(PlacedHandOff, "__call__", hand_off)
    F.mse_loss(out, torch.zeros(8, 16)).backward()
    assert taken, "the backward split every saved activation again"
    assert (8, 64) in taken  # the hidden activation, sharded (data, model) by the forward
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tolerance(torch.float32))


def test_export_of_a_sharded_model_warns_and_runs_on_one_device(tmp_path):
    mesh = fx2xla.Mesh((8,), ("fsdp",))
    model, x = mlp(), torch.randn(8, 16)
    fx2xla.fsdp(model, mesh)
    with pytest.warns(UserWarning, match="packages do not keep shardings"):
        fx2xla.export(model, (x,), str(tmp_path / "pkg"))
    loaded = fx2xla.load(str(tmp_path / "pkg"))
    torch.testing.assert_close(loaded(x), model(x), **tolerance(torch.float32))


@pytest.mark.parametrize("metadata", ["aot", "none"])
def test_fsdp_step_updates_its_shards_in_place(metadata, monkeypatch):
    """A compiled FSDP optimizer step writes each sharded parameter and AdamW moment into the
    device buffers it read (donated): the previous shards are consumed, the new ones sit at the
    same addresses on all 8 devices, and every step's parameters match eager (float32: rtol
    1e-4, atol 1e-5). Replicated written inputs (the step counts) are not donated. Without
    AOTAutograd's metadata (its private API gone), the step cannot tell its own write from a
    user's, so it splits the parameters again: the same values, without the in-place update."""
    import fx2xla.compiled_graph as cg

    if metadata == "none":
        monkeypatch.setattr(cg, "aot_metadata", lambda: None)
    mesh = fx2xla.Mesh((8,), ("fsdp",))
    model, x, y = mlp(), torch.randn(32, 16), torch.randn(32, 16)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=True)
    fx2xla.fsdp(model, mesh, axis="fsdp")
    fx2xla.mark_sharding(x, mesh, ("fsdp", None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    forward, step = torch.compile(model, backend="fx2xla"), torch.compile(opt.step, backend="fx2xla")
    p0 = model[0].weight
    before, previous = snapshot(), None
    for k in range(3):
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        F.mse_loss(forward(x), y).backward()
        step()
        opt.zero_grad(set_to_none=True)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
        twin = fx2xla.sharding.sharded_twin(p0)
        pointers = [twin.addressable_data(d).unsafe_buffer_pointer() for d in range(8)]
        if previous is not None:
            old, old_pointers = previous
            assert old.is_deleted() == (metadata == "aot")
            assert (pointers == old_pointers) == (metadata == "aot")
        previous = twin, pointers
    graphs = {g.name.rsplit("_", 1)[-1]: g for g in graphs_since(before)}
    plan = graphs["inference"].plan
    written = {i for i, _ in plan.mutations}
    donated = {i for i, p in enumerate(plan.inputs) if p.donated}
    replicated = {i for i in written if mesh.named_sharding(plan.inputs[i].sharding).is_fully_replicated}
    assert len(replicated) == 4  # the step counts
    assert donated == written - replicated and len(donated) == 12  # 4 parameters, 2 moments each
    assert memory(graphs["inference"]).alias_size_in_bytes == 3 * sum(p.numel() for p in model.parameters()) * 4 // 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_stay_sharded_on_request(dtype, monkeypatch):
    """options={"outputs": "sharded"}: an inference graph's sharded output comes back as an
    fx2xla.ShardedTensor holding the executable's shards (not assembled until torch needs it
    whole); its pieces share the device buffers and equal eager's slices; torch ops on it and its
    full_tensor() and local_tensor() equal eager; from_local of a whole tensor is that tensor; a
    replicated output is a plain tensor; a second compiled graph
    reading it takes its shards (not a new split) and equals eager. Tolerances per dtype as
    tests/conftest.py states."""
    from fx2xla.sharded_call import PlacedHandOff

    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU()).to(dtype)
    x = torch.randn(8, 16, dtype=dtype)
    with torch.no_grad():
        ref = model(x)
    fx2xla.shard_module(model, mesh, {"0.weight": ("model", None), "0.bias": ("model",)})
    fx2xla.mark_sharding(x, mesh, ("data", None))
    tol = tolerance(dtype)
    compiled = torch.compile(lambda x: (model(x), model(x).sum()), backend="fx2xla", options={"outputs": "sharded"})
    with torch.no_grad():
        out, total = compiled(x)
        assert type(out) is fx2xla.ShardedTensor and type(total) is torch.Tensor
        assert out.shape == ref.shape and out.dtype == dtype and out.spec == (("data",), ("model",))
        assert out.mesh is mesh and out._whole is None  # nothing assembled yet
        pieces = out.shards()
        assert len(pieces) == 8
        for k, (index, piece) in enumerate(pieces):
            assert piece.shape == (4, 16)
            assert piece.data_ptr() == out.array.addressable_data(k).unsafe_buffer_pointer()
            torch.testing.assert_close(piece, ref[index], **tol)
        torch.testing.assert_close(total, ref.sum(), **tolerance(dtype, scale=4))  # a sum of 512
        torch.testing.assert_close(out * 2, ref * 2, **tol)  # eager torch on it: assembled once
        torch.testing.assert_close(out.full_tensor(), ref, **tol)
        torch.testing.assert_close(out.local_tensor(), ref, **tol)  # one process holds every shard
        assert "ShardedTensor(shape=(8, 64)" in repr(out)
        own = fx2xla.ShardedTensor.from_local(x, mesh, ("data", None))  # one process: its rows are all
        assert own.shape == x.shape and own.spec == (("data",), ())
        torch.testing.assert_close(own.full_tensor(), x, rtol=0, atol=0)

        consumer = torch.compile(lambda h: torch.tanh(h) * 3, backend="fx2xla")
        consumer(compiled(x)[0])  # compiled once
        fresh, _ = compiled(x)
        handed = []
        real = PlacedHandOff.__call__
        monkeypatch.setattr(PlacedHandOff, "__call__",
                            lambda self, t, sharding, *rest: handed.append(real(self, t, sharding, *rest)) or handed[-1])
        result = consumer(fresh)
    # Dynamo hands the graph the whole value (assembled in torch: its guards and AOTAutograd
    # read it), but the graph takes the shards behind it, not a new split of it.
    assert any(b is fresh.array for b in handed)
    torch.testing.assert_close(result, torch.tanh(ref) * 3, **tol)


def test_sharded_outputs_option_applies_to_inference_only():
    """Training graphs' outputs feed autograd: they come back whole (plain tensors, gradients
    equal eager's), and a wrong option value is refused by name."""
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    model, x = mlp(), torch.randn(8, 16)
    ref = copy.deepcopy(model)
    fx2xla.shard_module(model, mesh, MEGATRON_MLP)
    fx2xla.mark_sharding(x, mesh, ("data", None))
    out = torch.compile(model, backend="fx2xla", options={"outputs": "sharded"})(x)
    assert type(out) is torch.Tensor
    out.sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tolerance(torch.float32))
    with pytest.raises(Exception, match="outputs='local'.*'whole' or 'sharded'"):
        torch.compile(model, backend="fx2xla", options={"outputs": "local"})(x)


def test_a_sharded_deep_stack_is_not_folded_and_keeps_its_memory_share():
    """Eight identical layers are folded into a scan when nothing is sharded, but a stack under
    FSDP is not (the scan's stacked weights would be one replicated input): each device holds
    1/8 of the weights and of the batch, and the output equals eager (float32 tolerances)."""
    from fx2xla.metrics import metrics

    def stack():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                     for _ in range(8)])

    x = torch.randn(32, 64)
    with torch.no_grad():
        expected = stack()(x)
        folds = metrics()["scan_folds"]
        torch.testing.assert_close(torch.compile(stack(), backend="fx2xla")(x), expected, **tolerance(torch.float32))
        assert metrics()["scan_folds"] == folds + 1
        torch._dynamo.reset()
        mesh = fx2xla.Mesh((8,), ("fsdp",))
        model = stack()
        fx2xla.fsdp(model, mesh, axis="fsdp")
        xs = x.clone()
        fx2xla.mark_sharding(xs, mesh, ("fsdp", None))
        before = snapshot()
        out = torch.compile(model, backend="fx2xla")(xs)
    torch.testing.assert_close(out, expected, **tolerance(torch.float32))
    assert metrics()["scan_folds"] == folds + 1
    (g,) = graphs_since(before)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert memory(g).argument_size_in_bytes == (params + x.numel() * 4) // 8


def test_collectives_count_every_element_of_a_tuple():
    """XLA combines the gradient all-reduces of data parallel into one whose result is a tuple,
    and numbers a long tuple's elements in comments ("/*index=5*/"): every element's bytes are
    counted. Shown on a literal HLO line and on a real step: four layers (8 gradients), whose
    backward all-reduces exactly the parameters' bytes."""
    line = ("  %all-reduce = (f32[4]{0}, f32[4,4]{1,0}, f32[4]{0}, f32[4,4]{1,0}, f32[4]{0}, /*index=5*/f32[8]{0}) "
            "all-reduce(%a, %b, %c, %d, %e, %f), channel_id=1, to_apply=%sum")
    (c,) = collectives(line)
    assert c.op == "all-reduce" and c.bytes == 4 * (4 + 16 + 4 + 16 + 4 + 8)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    eager_losses, *_ = _train(copy.deepcopy(model), x.clone(), y, None, steps=2)
    _plan("dp", model, x)
    before = snapshot()
    losses, *_ = _train(model, x, y, "fx2xla", steps=2)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)
    bw = next(g for g in graphs_since(before) if g.name.endswith("backward"))
    found = collectives(optimized_hlo_text(bw.static.exe))
    assert {c.op for c in found} == {"all-reduce"}
    assert sum(c.bytes for c in found) == sum(p.numel() for p in model.parameters()) * 4
    # Over the 8 devices of the mesh, a ring all-reduce sends 2 * 7/8 of those bytes.
    assert all(c.group == 8 for c in found)
    assert sum(c.moved for c in found) == pytest.approx(sum(c.bytes for c in found) * 2 * 7 / 8)


def test_collectives_read_their_group_size():
    """Each form XLA prints replica groups in gives the group's size, and `moved` the bytes a
    ring over it sends per device: all-reduce 2 (n-1)/n of its result, all-gather (n-1)/n,
    reduce-scatter (n-1) times its result, a group of one nothing."""
    cases = [
        ("%a = f32[64,64]{1,0} all-gather(%p), replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}",
         8, 16384 * 7 / 8),
        ("%b = f32[16]{0} all-reduce(%p), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%s", 4, 64 * 2 * 3 / 4),
        ("%c = f32[16]{0} all-reduce(%p), replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%s", 2, 64.0),
        ("%d = f32[2]{0} reduce-scatter(%p), replica_groups=mesh['a'=2,'b'=4] {'a','b'}, dimensions={0}", 8, 8 * 7),
        ("%e = f32[4]{0} all-to-all(%p), replica_groups=mesh['a'=2,'b'=4] {'a'}, dimensions={0}", 2, 16 / 2),
        ("%f = f32[4]{0} all-reduce(%p), replica_groups=mesh['a'=2,'b'=4] {}, to_apply=%s", 1, 0.0),
    ]
    for line, group, moved in cases:
        (c,) = collectives(line)
        assert (c.group, c.moved) == (group, moved), line
