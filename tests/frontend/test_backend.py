"""The backend is registered by entry point, dumps its graphs, and caches executables."""
import os
import subprocess
import sys

import torch

import fx2xla


def test_registered_without_import():
    code = (
        "import torch\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='fx2xla', fullgraph=True)\n"
        "x = torch.arange(4.)\n"
        "torch.testing.assert_close(f(x), x * 2 + 1)\n"
        "import sys; assert 'fx2xla.backend' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert "fx2xla" in torch._dynamo.list_backends()


def test_dump_dir_writes_fx_stablehlo_and_hlo(tmp_path, monkeypatch):
    monkeypatch.setenv("FX2XLA_DUMP_DIR", str(tmp_path))

    def train_step_like(x, w):
        return (x * w + 1).sum() if False else x * w + 1

    torch.compile(train_step_like, backend="fx2xla")(torch.randn(3), torch.randn(3))
    names = sorted(os.listdir(tmp_path))
    stems = {n.rsplit(".", 2)[0] for n in names}
    assert len(stems) == 1, names
    stem = stems.pop()
    assert "inference" in stem and stem.startswith("000_") or "inference" in stem
    assert {f"{stem}.fx.txt", f"{stem}.stablehlo.mlir", f"{stem}.hlo.txt"} <= set(names)
    assert "aten.mul" in (tmp_path / f"{stem}.fx.txt").read_text()
    assert "stablehlo.multiply" in (tmp_path / f"{stem}.stablehlo.mlir").read_text()
    assert "HloModule" in (tmp_path / f"{stem}.hlo.txt").read_text()


def test_training_graphs_are_named_forward_and_backward(tmp_path, monkeypatch):
    monkeypatch.setenv("FX2XLA_DUMP_DIR", str(tmp_path))
    w = torch.randn(3, requires_grad=True)
    out = torch.compile(lambda x: x * w * w, backend="fx2xla")(torch.randn(3))
    out.sum().backward()
    names = " ".join(sorted(os.listdir(tmp_path)))
    assert "forward" in names and "backward" in names


def test_executable_cache_hit_and_recompile_on_new_shape(monkeypatch):
    monkeypatch.setenv("FX2XLA_CACHE_DIR", "")  # memory cache only

    def f(x):
        return x * 2 + 1.2345  # a module no other test compiles

    x = torch.randn(4, 3)
    before = fx2xla.metrics()
    torch.compile(f, backend="fx2xla", dynamic=False)(x)
    mid = fx2xla.metrics()
    assert mid["compiles"] - before["compiles"] == 1

    # The same graph and shapes compiled again (a fresh Dynamo cache): the executable is reused.
    torch._dynamo.reset()
    torch.compile(f, backend="fx2xla", dynamic=False)(x)
    after = fx2xla.metrics()
    assert after["cache_hits"] == mid["cache_hits"] + 1
    assert after["compiles"] == mid["compiles"]

    # New shapes: a new executable.
    out = torch.compile(f, backend="fx2xla", dynamic=False)(torch.randn(5, 3))
    assert fx2xla.metrics()["compiles"] == after["compiles"] + 1
    assert out.shape == (5, 3)


def test_dynamic_graph_specialises_per_shape():
    """A graph with symbolic sizes (Dynamo's automatic dynamic shapes) runs every size."""

    def f(x):
        return x * 2 + x.shape[0]

    c = torch.compile(f, backend="fx2xla")
    for n in (3, 5, 7, 5):
        x = torch.randn(n, 2)
        torch.testing.assert_close(c(x), f(x))


def test_aot_wrappers_bypassed_only_when_they_do_nothing(monkeypatch):
    import fx2xla.backend as backend

    seen = []
    real = backend.aot_wrappers_needed

    def spy(meta, graph_inputs, dynamo_inputs):
        seen.append(real(meta, graph_inputs, dynamo_inputs))
        return seen[-1]

    monkeypatch.setattr(backend, "aot_wrappers_needed", spy)

    def plain(x):
        return x * 2

    def mutates(x):
        x.add_(1)
        return x * 2

    def aliases(x):
        return x * 2, x.view(-1)  # second output is a view of the input

    for fn, expect in [(plain, False), (mutates, True), (aliases, True)]:
        torch._dynamo.reset()
        seen.clear()
        x = torch.randn(2, 3)
        ref = fn(x.clone())
        out = torch.compile(fn, backend="fx2xla")(x.clone())
        torch.testing.assert_close(out, ref)
        assert seen == [expect], (fn.__name__, seen)
    # The public fallback: unknown metadata keeps AOTAutograd's wrappers.
    assert real(None, 1, 1) is True
    assert real(object(), 1, 1) is True


def test_metrics_count_executions_and_report():
    c = torch.compile(lambda x: x * 5.5 - 2, backend="fx2xla")
    x = torch.randn(3)
    c(x)
    before = fx2xla.metrics()["executions"]
    for _ in range(3):
        c(x)
    assert fx2xla.metrics()["executions"] - before == 3
    report = fx2xla.metrics_report()
    assert "executions" in report and "compiles" in report and "disk_hits" in report


def test_metrics_keep_what_freed_graphs_counted():
    """Process-wide counts do not go down when a graph is freed: its executions and staged
    inputs stay in metrics() after Dynamo drops it and it is collected. Results equal eager's
    (float32, rtol=atol=1e-6)."""
    import gc

    c = torch.compile(lambda x: x * 3 + 1, backend="fx2xla")
    x = torch.randn(4)
    for _ in range(4):
        torch.testing.assert_close(c(x), x * 3 + 1, rtol=1e-6, atol=1e-6)
    m = fx2xla.metrics()
    del c
    torch._dynamo.reset()
    gc.collect()
    after = fx2xla.metrics()
    assert after["executions"] == m["executions"] and after["staged_inputs"] == m["staged_inputs"]
    assert m["staged_inputs"] >= 3


def test_execute_seconds_when_timing_is_on(monkeypatch):
    """With FX2XLA_TIME_EXECUTE=1 each call adds to execute_seconds and import_seconds; a graph
    compiled without it adds to neither. Results equal eager's (float32, rtol=atol=1e-4)."""
    x = torch.randn(64, 64)
    plain = torch.compile(lambda x: (x @ x.t()).sin(), backend="fx2xla")
    plain(x)
    m = fx2xla.metrics()
    for _ in range(3):
        torch.testing.assert_close(plain(x), (x @ x.t()).sin(), rtol=1e-4, atol=1e-4)
    after = fx2xla.metrics()
    assert (after["execute_seconds"], after["import_seconds"]) == (m["execute_seconds"], m["import_seconds"])
    monkeypatch.setenv("FX2XLA_TIME_EXECUTE", "1")
    c = torch.compile(lambda x: (x @ x.t()).tanh(), backend="fx2xla")
    for _ in range(3):
        before = fx2xla.metrics()
        torch.testing.assert_close(c(x), (x @ x.t()).tanh(), rtol=1e-4, atol=1e-4)
        now = fx2xla.metrics()
        assert now["execute_seconds"] > before["execute_seconds"]
        assert now["import_seconds"] > before["import_seconds"]
