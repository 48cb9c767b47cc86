"""Serving warm-up: every shape compiled before traffic; nothing compiles afterwards."""
import warnings

import pytest
import torch

import fx2xla


class Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1)).softmax(-1)


def test_warmup_then_no_recompile():
    torch.manual_seed(0)
    model = Scorer().eval()
    compiled = torch.compile(model, backend="fx2xla")
    shapes = [(2, 8), (4, 8), (4, 16)]
    with torch.no_grad():
        report = fx2xla.warmup(compiled, [fx2xla.TensorSpec(s, torch.int64) for s in shapes], progress=False)
        assert report["signatures"] == 3 and report["compiles"] >= 1
        with fx2xla.no_recompile():
            for s in shapes:  # warmed-up shapes run, and match eager
                ids = torch.randint(0, 50, s)
                torch.testing.assert_close(compiled(ids), model(ids))
            with pytest.raises(fx2xla.RecompileError, match="after warm-up") as info:
                compiled(torch.randint(0, 50, (3, 5)))
            assert "[3, 5]" in str(info.value)
        compiled(torch.randint(0, 50, (3, 5)))  # outside the region it compiles again


def test_no_recompile_option_allows_only_warmup():
    compiled = torch.compile(lambda x: x.cumsum(0) * 2, backend="fx2xla", options={"no_recompile": True})
    with pytest.raises(fx2xla.RecompileError, match="no_recompile"):
        compiled(torch.randn(4))
    fx2xla.warmup(compiled, [torch.randn(4), (torch.randn(6),), torch.Size([9])], progress=False)
    x = torch.randn(6)
    torch.testing.assert_close(compiled(x), x.cumsum(0) * 2)
    with pytest.raises(fx2xla.RecompileError, match="no_recompile"):
        compiled(torch.randn(7))


def test_recompile_error_is_itself_and_names_what_changed():
    """`except fx2xla.RecompileError` catches it (not Dynamo's BackendCompilerFailed), and the
    message names the input and how it changed: dtype, shape, or a new input."""
    model = torch.nn.Linear(8, 4)
    compiled = torch.compile(model, backend="fx2xla", options={"no_recompile": True})
    fx2xla.warmup(compiled, [torch.randn(2, 8)], progress=False)
    x = torch.randn(2, 8)
    torch.testing.assert_close(compiled(x), model(x))
    with pytest.raises(fx2xla.RecompileError) as info:
        compiled(torch.randn(2, 8, dtype=torch.float64))
    assert type(info.value) is fx2xla.RecompileError
    assert "dtype float32 -> float64" in str(info.value) and "L['args'][0]" in str(info.value)
    with pytest.raises(fx2xla.RecompileError, match=r"shape float32\[2, 8\] -> float32\[3, 8\]"):
        compiled(torch.randn(3, 8))


def test_recompile_error_after_a_dynamo_reset_ignores_what_came_before():
    """Signatures compiled before `torch._dynamo.reset()` (whose frame ids start again from 0)
    do not count for a function compiled after it: the same function, compiled earlier at the
    very shape that now recompiles, does not turn the message into "the same input signature"."""
    model = torch.nn.Linear(8, 4)
    torch.compile(torch.nn.Linear(8, 4), backend="fx2xla")(torch.randn(3, 8))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fx2xla", options={"no_recompile": True})
    fx2xla.warmup(compiled, [torch.randn(2, 8)], progress=False)
    with pytest.raises(fx2xla.RecompileError, match=r"shape float32\[2, 8\] -> float32\[3, 8\]"):
        compiled(torch.randn(3, 8))


def test_recompile_error_of_a_dynamic_graph_names_the_shape():
    compiled = torch.compile(lambda x: x * 2, backend="fx2xla", dynamic=True)
    compiled(torch.randn(3))
    with fx2xla.no_recompile(), pytest.raises(fx2xla.RecompileError, match=r"float32\[3\] -> float32\[5\]"):
        compiled(torch.randn(5))


_PUBLIC_ERRORS = """
import torch, fx2xla
from torch._dynamo.exc import BackendCompilerFailed
c = torch.compile(lambda x: x + 1, backend="fx2xla", options={"no_recompile": True})
try:
    c(torch.randn(2))
except BackendCompilerFailed as e:
    assert isinstance(e.inner_exception, fx2xla.RecompileError), type(e.inner_exception)
    print("wrapped", type(e.inner_exception).__name__)
"""


def test_errors_private_and_public_paths():
    """Private path (default): fx2xla's errors derive from Dynamo's pass-through base and reach
    the user unwrapped. Public fallback (FX2XLA_PUBLIC_ERRORS=1): plain RuntimeErrors, which
    Dynamo wraps; the fx2xla error is then the wrapper's inner_exception."""
    import os
    import subprocess
    import sys

    from fx2xla.errors import passthrough_base

    assert passthrough_base(public=True) is RuntimeError
    assert issubclass(passthrough_base(public=False), RuntimeError)
    assert issubclass(fx2xla.RecompileError, passthrough_base(public=False))
    env = {**os.environ, "FX2XLA_PUBLIC_ERRORS": "1"}
    out = subprocess.run([sys.executable, "-c", _PUBLIC_ERRORS], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "wrapped RecompileError" in out.stdout


@pytest.mark.parametrize("n", [3, 6, 11])
def test_dynamic_shapes_match_eager(n):
    def f(x, y):
        return (x @ y).relu().sum(0) + x.shape[0]

    compiled = torch.compile(f, backend="fx2xla", dynamic=True)
    for m in (n, n + 1, 2 * n):
        x, y = torch.randn(m, 5), torch.randn(5, n)
        torch.testing.assert_close(compiled(x, y), f(x, y))


def test_mark_dynamic_specialises_per_size_and_caches():
    def f(x):
        return torch.nn.functional.gelu(x).mean(-1)

    compiled = torch.compile(f, backend="fx2xla")
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    compiled(x)
    before = fx2xla.metrics()["specializations"]
    for b in (2, 5, 2, 5):
        xb = torch.randn(b, 8)
        torch.testing.assert_close(compiled(xb), f(xb))
    assert fx2xla.metrics()["specializations"] - before == 2  # one per new size, then cached


def test_batch_buckets_pad_and_share_executables():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).eval()
    compiled = torch.compile(model, backend="fx2xla", options={"batch_buckets": [4, 8]})
    x = torch.randn(2, 8)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        compiled(x)
        before = fx2xla.metrics()["specializations"]
        for b in (3, 5, 6, 7, 8):  # (batch 1 would be a new static graph: Dynamo specialises 1)
            xb = torch.randn(b, 8)
            out = compiled(xb)
            assert out.shape == (b, 3)
            torch.testing.assert_close(out, model(xb), rtol=1e-4, atol=1e-5)
        # 3 shares bucket 4 (compiled already for the first call, batch 2); 5-8 share bucket 8.
        assert fx2xla.metrics()["specializations"] - before == 1


def test_batch_buckets_leave_graphs_padding_would_change():
    """batch_buckets pads only graphs whose inputs and outputs hold the batch in dim 0 alone and
    that read no number computed from it: a graph returning h.t(), a flatten, a concatenation
    along the batch, h.unsqueeze(0) and x.shape[0] * ones, and one taking an input batched in dim
    1, compile per batch size instead, with a warning saying why; every output equals eager's
    (float32, rtol 1e-4, atol 1e-5) in shape and values at batches 2, 4 and 3. A model that
    flattens the batch inside (an LM head over [batch * seq, hidden]) and returns [batch, seq,
    out] is still padded: batches 3 and 4 share one executable."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).eval()

    def outputs(x):
        h = lin(x)
        return h.t(), h.reshape(-1), torch.cat([h, h]), h.unsqueeze(0), x.shape[0] * torch.ones(1)

    def batched_in_dim_1(x, y):
        return lin(x) + y.t()

    options = {"batch_buckets": [1, 2, 4, 8]}
    for fn, make in ((outputs, lambda b: (torch.randn(b, 8),)),
                     (batched_in_dim_1, lambda b: (torch.randn(b, 8), torch.randn(4, b)))):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="fx2xla", options=options)
        with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for b in (2, 4, 3):
                args = make(b)
                for a, e in zip(compiled(*args), fn(*args)) if fn is outputs else [(compiled(*args), fn(*args))]:
                    assert a.shape == e.shape
                    torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        assert any("batch_buckets: not padding this graph" in str(w.message) for w in seen)

    def lm_head(x):
        b, s, _ = x.shape
        return lin(x.reshape(b * s, 8)).reshape(b, s, 4)

    torch._dynamo.reset()
    compiled = torch.compile(lm_head, backend="fx2xla", options=options)
    with torch.no_grad():
        compiled(torch.randn(2, 5, 8))
        before = fx2xla.metrics()["specializations"]
        for b in (3, 4):
            x = torch.randn(b, 5, 8)
            torch.testing.assert_close(compiled(x), lm_head(x), rtol=1e-4, atol=1e-5)
        assert fx2xla.metrics()["specializations"] - before == 1


class _Spy(torch.nn.Module):
    """Records the arguments of each call; its one parameter says where the model lives."""

    def __init__(self, device):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, device=device))
        self.calls = []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def test_warmup_zeros_are_made_where_the_model_lives():
    """TensorSpec / torch.Size warm-up inputs are made on the model's parameters' device (a
    CUDA model warms up on its GPU), a compiled module's too; a TensorSpec's own device wins.
    ("meta" stands in for a GPU here: only where the zeros are made is under test.)"""
    meta = torch.device("meta")
    spy = _Spy(meta)
    fx2xla.warmup(spy, [(fx2xla.TensorSpec((2, 3), torch.int64), torch.Size([4])),
                        {"x": fx2xla.TensorSpec((2,), device="cpu")}], progress=False)
    ((a, b), _), ((), kwargs) = spy.calls
    assert (a.device, a.dtype, tuple(a.shape)) == (meta, torch.int64, (2, 3)) and b.device == meta
    c = kwargs["x"]
    assert c.device == torch.device("cpu") and torch.equal(c, torch.zeros(2))
    inner = _Spy(meta)  # compiled: the module inside torch.compile's wrapper says where
    fx2xla.warmup(torch.compile(inner, backend="eager"), [torch.Size([2])], progress=False)
    assert [args[0].device for args, _ in inner.calls] == [meta]
    calls = []  # no parameters to go by: torch's default device
    fx2xla.warmup(lambda x: calls.append(x), [torch.Size([2])], progress=False)
    assert [x.device for x in calls] == [torch.device("cpu")]
