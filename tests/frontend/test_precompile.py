"""torch's precompile path with fx2xla: `aot_compile` + `save_compiled_function`, then
`torch.compiler.load_compiled_function` in a fresh process runs with no Dynamo frame and
matches eager (float32 rtol 1e-4 / atol 1e-5). Graphs it does not cover are refused with an
error that says why; the private "are we precompiling?" test and its public fallback both
give correct results."""
import os
import subprocess
import sys

import pytest
import torch

import fx2xla.precompile as precompile

CHILD = r"""
import sys, torch, fx2xla
sys.path.insert(0, sys.argv[1])
from test_precompile import MLP
model = MLP()
model.load_state_dict(torch.load(sys.argv[2]))
x = torch.load(sys.argv[3])
with open(sys.argv[4], "rb") as f:
    fn = torch.compiler.load_compiled_function(f)
with torch.no_grad():
    out = fn(model, x)
torch.save(out, sys.argv[5])
print(len(torch._dynamo.utils.counters["frames"]), fx2xla.metrics()["graphs"])
"""


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))).softmax(-1)


def test_saved_and_loaded_in_a_fresh_process(tmp_path):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP().eval()
    x = torch.randn(4, 16)
    compiled = torch.compile(model, backend="fx2xla", fullgraph=True)
    with torch.no_grad():
        aot = compiled.forward.aot_compile(((x,), {}))
        torch.testing.assert_close(aot(model, x), model(x), rtol=1e-4, atol=1e-5)
        expected = model(x)
    aot.save_compiled_function(str(tmp_path / "mlp.aot"))
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    torch.save(x, tmp_path / "x.pt")
    env = dict(os.environ, FX2XLA_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(__file__), str(tmp_path / "weights.pt"),
                        str(tmp_path / "x.pt"), str(tmp_path / "mlp.aot"), str(tmp_path / "out.pt")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    frames, graphs = map(int, r.stdout.split()[-2:])
    assert frames == 0 and graphs == 1  # no Dynamo; the one graph rebuilt from the artifact
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected, rtol=1e-4, atol=1e-5)


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x * self.calls


def test_graphs_it_does_not_cover_are_refused():
    torch._dynamo.reset()
    compiled = torch.compile(Counter(), backend="fx2xla", fullgraph=True)
    with pytest.raises(Exception, match="aot_compile.*runtime wrappers"):
        with torch.no_grad():
            compiled.forward.aot_compile(((torch.ones(3),), {}))


@pytest.mark.parametrize("public", [False, True])
def test_precompile_check_private_and_public(monkeypatch, public):
    """Outside aot_compile the private check says no and torch.compile returns its fast path;
    the public fallback says yes everywhere (it cannot tell), and ordinary calls still give
    eager's results: inference, a buffer update and a training step alike."""
    check = precompile.make_in_precompile(public)
    assert check() is public
    monkeypatch.setattr(precompile, "in_precompile", check)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend="fx2xla")(x), model(x), rtol=1e-4, atol=1e-5)
    counter, eager_counter = torch.compile(Counter(), backend="fx2xla"), Counter()
    for _ in range(2):
        torch.testing.assert_close(counter(torch.ones(3)), eager_counter(torch.ones(3)), rtol=0, atol=0)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fx2xla")
    compiled(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_artifact_keeps_the_torch_kernels_option():
    """A graph compiled with options={"torch_kernels": False} is rebuilt from its artifact with
    XLA's own convolution (no torch kernel custom call), and matches eager (float32 rtol 1e-4,
    atol 1e-5)."""
    from fx2xla.metrics import live_graphs

    torch._dynamo.reset()
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).eval()
    x = torch.randn(2, 3, 8, 8)
    before = {id(g) for g in live_graphs}
    with torch.no_grad():
        torch.compile(conv, backend="fx2xla", options={"torch_kernels": False})(x)
    graph = next(g for g in live_graphs if id(g) not in before)
    fn = precompile.precompiled(graph, {"device_index": None, "check_indices": True, "torch_kernels": False})
    loaded = precompile.PrecompiledGraph.deserialize_compile_artifacts(
        precompile.PrecompiledGraph.serialize_compile_artifacts(fn))
    assert loaded.graph.torch_kernels is False
    with torch.no_grad():
        out = loaded(*[p.detach() for p in (conv.weight, conv.bias)], x)
    assert "fx2xla_torch_convolution" not in loaded.graph.static.lowered.module_text
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, conv(x), rtol=1e-4, atol=1e-5)
