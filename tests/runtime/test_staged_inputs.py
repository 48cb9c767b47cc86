"""Small CPU inputs that arrive afresh on every call are copied into buffers XLA already holds
(staged) instead of imported over DLPack (fx2xla/plan_executor.py, STAGE_MAX_BYTES). Every test
compares with eager on the same inputs: exact for these elementwise graphs in every dtype
(float32, bfloat16, float64, int64, bool), float32 within rtol=1e-6 for the matmul."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fx2xla
from fx2xla.plan_executor import STAGE_MAX_BYTES
from tests.conftest import calls_in_threads, tolerance


def staged_since(before: int) -> int:
    return fx2xla.metrics()["staged_inputs"] - before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool])
def test_new_values_every_call(dtype):
    """Each call sees its own values, from the second call on through the staging buffer; a
    result stays what it was after later calls overwrite the buffer."""
    def f(x, y):
        return (x & y) if dtype is torch.bool else x * 2 + y

    c = torch.compile(f, backend="fx2xla")
    make = (lambda: torch.rand(3, 5) > 0.5) if dtype is torch.bool else (
        lambda: (torch.randn(3, 5) * 100).to(dtype))
    kept = []
    before = fx2xla.metrics()["staged_inputs"]
    for _ in range(6):
        x, y = make(), make()
        out = c(x, y)
        torch.testing.assert_close(out, f(x, y), rtol=0, atol=0)
        kept.append((out, f(x, y)))
    assert staged_since(before) == 2 * 5  # both inputs, every call after the first
    for out, expected in kept:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("fn", [
    lambda x: x.reshape(4, 2) + 0,
    lambda x: x.clone(),
    lambda x: x.t().contiguous(),
    lambda x: x[0] * 1,
    lambda x: x.to(torch.float64),
], ids=["reshape", "clone", "transpose", "select", "cast"])
def test_results_do_not_alias_the_staging_buffer(fn):
    """Results that XLA could have taken straight from the input keep their values when the
    next call writes new values into the same staging buffer."""
    c = torch.compile(fn, backend="fx2xla")
    inputs = [torch.randn(2, 4) for _ in range(4)]
    before = fx2xla.metrics()["staged_inputs"]
    outs = [c(x) for x in inputs]
    assert staged_since(before) == len(inputs) - 1
    for x, out in zip(inputs, outs):
        torch.testing.assert_close(out, fn(x), rtol=0, atol=0)


def test_edge_shapes_and_a_changing_shape():
    """0-d and empty inputs, and a dynamic dimension: a call whose shape differs from its
    staging buffer's imports its input and is still right."""
    c = torch.compile(lambda x: x * 3 - 1, backend="fx2xla")
    for x in [torch.tensor(2.5), torch.tensor(-1.0), torch.empty(0, 3), torch.empty(0, 3)]:
        torch.testing.assert_close(c(x), x * 3 - 1, rtol=0, atol=0)
    d = torch.compile(lambda x: x * 0.5 + 2, backend="fx2xla", dynamic=True)
    for n in (3, 5, 5, 7, 3, 3):
        x = torch.randn(n, 4)
        torch.testing.assert_close(d(x), x * 0.5 + 2, rtol=0, atol=0)


def test_large_and_grad_inputs_are_imported():
    """An input above STAGE_MAX_BYTES, or one that requires grad, is imported as before."""
    n = STAGE_MAX_BYTES // 4 + 1
    c = torch.compile(lambda x: x + 1, backend="fx2xla")
    before = fx2xla.metrics()["staged_inputs"]
    for _ in range(3):
        x = torch.randn(n)
        torch.testing.assert_close(c(x), x + 1, rtol=0, atol=0)
    assert staged_since(before) == 0
    w = torch.randn(4, 4)
    g = torch.compile(lambda x: (x @ w).relu(), backend="fx2xla")
    for _ in range(3):
        x = torch.randn(8, 4, requires_grad=True)
        out = g(x)
        torch.testing.assert_close(out, (x @ w).relu(), **tolerance(torch.float32))
        out.sum().backward()
        torch.testing.assert_close(x.grad, ((x @ w) > 0).float() @ w.t(), **tolerance(torch.float32))


@pytest.mark.parametrize("view", [lambda b: b.t(), lambda b: b[:, ::2], lambda b: b[1:, 1:]],
                         ids=["transposed", "strided-columns", "offset"])
def test_strided_inputs_are_staged(view):
    """Strided views (copied straight into their staging buffer, not made dense first) are
    staged from the second call on, leave their base tensors as they were, and give eager's
    results exactly (a max reduction: its result is dense whatever the input's strides, so
    the call stages); one that requires grad is imported, with eager's gradient."""
    def f(x):
        return x.amax(dim=0) * 2 - 1

    c = torch.compile(f, backend="fx2xla")
    before = fx2xla.metrics()["staged_inputs"]
    for _ in range(4):
        base = torch.randn(6, 8)
        kept = base.clone()
        x = view(base)
        assert not x.is_contiguous()
        torch.testing.assert_close(c(x), f(x), rtol=0, atol=0)
        assert torch.equal(base, kept)
    assert staged_since(before) == 3
    base = torch.randn(6, 8, requires_grad=True)
    out = c(view(base))
    torch.testing.assert_close(out, f(view(base)), rtol=0, atol=0)
    out.sum().backward()
    eager_base = base.detach().clone().requires_grad_()
    f(view(eager_base)).sum().backward()
    torch.testing.assert_close(base.grad, eager_base.grad, rtol=0, atol=0)
    assert staged_since(before) == 3


class Accumulator(torch.nn.Module):
    """A decode step's shape in small: a buffer written in place every call (as a static KV
    cache is, by position) and a result computed from it and from the call's fresh inputs."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("cache", torch.zeros(width, width))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("w", torch.randint(-3, 4, (width, width), generator=torch.Generator().manual_seed(0))
                             .to(torch.float32))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        self.steps.add_(1)
        return self.cache @ self.w + pos.to(torch.float32).sum(), self.steps * 10


@pytest.mark.parametrize("width", [4, 64], ids=["inline", "asynchronous"])
def test_calls_that_write_inputs_in_place_stage(width):
    """A call that writes a buffer in place and returns another result stages its fresh inputs
    from the second call on; results and the buffers after every call are eager's, exactly
    (integer-valued floats). At width 64 the executable is long enough for XLA:CPU to run it
    on its own thread (not inline), so the next call's copies into the staging buffers would
    race with it, were the call to return before the execution ends."""
    eager, compiled_module = Accumulator(width), Accumulator(width)
    c = torch.compile(compiled_module, backend="fx2xla")
    before = fx2xla.metrics()["staged_inputs"]
    kept = []
    calls = 6 if width == 4 else 40
    with torch.no_grad():
        for step in range(calls):
            x = torch.randint(-50, 50, (1, width)).to(torch.float32)
            pos = torch.tensor([step % width])
            out, want = c(x, pos), eager(x, pos)
            for o, w in zip(out, want):
                torch.testing.assert_close(o, w, rtol=0, atol=0)
            kept.append((out, [w.clone() for w in want]))
            torch.testing.assert_close(compiled_module.cache, eager.cache, rtol=0, atol=0)
            torch.testing.assert_close(compiled_module.steps, eager.steps, rtol=0, atol=0)
    assert staged_since(before) == 2 * (calls - 1)
    for out, want in kept:
        for o, w in zip(out, want):
            torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_calls_whose_only_results_are_written_in_place_import():
    """A call that only writes a buffer in place exports no result, so nothing waits for its
    execution before it returns: its inputs are imported, never staged, and the buffer ends as
    eager's."""
    class Adder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(4))

        def forward(self, x):
            self.total.add_(x)

    eager, compiled_module = Adder(), Adder()
    c = torch.compile(compiled_module, backend="fx2xla")
    before = fx2xla.metrics()["staged_inputs"]
    with torch.no_grad():
        for _ in range(5):
            x = torch.randint(-9, 9, (4,)).to(torch.float32)
            c(x)
            eager(x)
            torch.testing.assert_close(compiled_module.total, eager.total, rtol=0, atol=0)
    assert staged_since(before) == 0


def test_many_threads_each_get_their_own_values():
    """Calls in flight at once from eight threads each stage into their own buffers: every
    result equals, bit for bit, the single-threaded call's on its own input (the same
    executable), and that one matches eager within float32's tolerance (XLA's dot sums in
    another order than torch's). Warmed up under the threads' grad mode, the threads make
    no new graph."""
    w = torch.randn(16, 16)
    c = torch.compile(lambda x: torch.tanh(x @ w) * 2, backend="fx2xla")
    inputs = [torch.randn(4, 16) for _ in range(8)]
    with torch.no_grad():  # calls_in_threads runs under no_grad
        single = [c(x) for x in inputs]
    before, graphs = fx2xla.metrics()["staged_inputs"], fx2xla.metrics()["graphs"]
    results = calls_in_threads(c, inputs, calls=40)
    for i, outs in results.items():
        torch.testing.assert_close(single[i], torch.tanh(inputs[i] @ w) * 2, **tolerance(torch.float32))
        assert len(outs) == 40
        for out in outs:
            assert torch.equal(out, single[i])
    assert staged_since(before) > 0
    assert fx2xla.metrics()["graphs"] == graphs


def test_off_with_the_environment_variable(tmp_path):
    """FX2XLA_STAGE_INPUTS=0 (read when a graph compiles) imports every input; results agree."""
    script = textwrap.dedent("""
        import torch, fx2xla
        c = torch.compile(lambda x: x * 2 + 1, backend="fx2xla")
        for _ in range(4):
            x = torch.randn(6)
            torch.testing.assert_close(c(x), x * 2 + 1, rtol=0, atol=0)
        print("staged", fx2xla.metrics()["staged_inputs"])
    """)
    for value, staged in (("0", 0), ("1", 3)):
        env = {**os.environ, "FX2XLA_STAGE_INPUTS": value}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"staged {staged}" in out.stdout


def test_index_checked_graph_stages_and_still_raises():
    """A graph with index checks stages its ids too; an out-of-range id still raises
    IndexOutOfRangeError, and the calls after it are right again."""
    table = torch.randn(50, 8)
    c = torch.compile(lambda ids: torch.nn.functional.embedding(ids, table) * 2, backend="fx2xla")
    before = fx2xla.metrics()["staged_inputs"]
    for _ in range(4):
        ids = torch.randint(0, 50, (6,))
        torch.testing.assert_close(c(ids), table[ids] * 2, rtol=0, atol=0)
    assert staged_since(before) == 2 * 3  # the ids, and the table (a captured tensor: an input, not a parameter)
    with pytest.raises(fx2xla.IndexOutOfRangeError):
        c(torch.tensor([1, 2, 3, 4, 5, 50]))
    for _ in range(3):
        ids = torch.randint(0, 50, (6,))
        torch.testing.assert_close(c(ids), table[ids] * 2, rtol=0, atol=0)
