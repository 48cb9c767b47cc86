"""Few-row float32 matmuls on the CPU (fx2xla/torch_kernels.py, `fx2xla_few_rows_matmul`;
lowering/linalg.py: FEW_ROWS, few_row_matmuls; plan.GraphPlan.few_rows).

A CPU inference graph sends a float32 mm/addmm of 2-8 static rows against a transposed dense
weight (nn.Linear's, or merge_linears' concatenation) to the kernel library's few-row matmul,
with the weight handed over as torch holds it. What these tests hold it to:
- results equal eager's at float32 rtol 1e-5 / atol 1e-5 (the kernel sums in another order than
  torch's GEMM), for 2, 3, 4, 5 and 8 rows, K and N with and without remainders of the kernel's
  chunks (16 floats with AVX-512, 8 without) and of its tiles of 1-4 rows of W, weights large
  enough to be cut across XLA's threads, with and without a bias, 2-D and 3-D inputs;
- the plan lists the matmuls (and not as weight-left ones), no weight is relaid, the optimized
  HLO calls the kernel, and the handler runs once per matmul per call;
- left to XLA's dot: 1 and 9 rows, bf16, training graphs, dynamic rows; the option
  torch_kernels without "few_rows_matmul" gives the weight-left form, within the same tolerance;
- four threads calling one compiled model get, on every call, the bits a single call gives, with
  the waits for a split's last parts polled (the default) or slept at once; also five threads at
  once whose calls all ask the library's helper threads for the kernel's parts
  (FX2XLA_HELPER_THREADS=1);
- with helper threads (their parts counted), an executable gives the bits it gives without them
  (the default), on the main thread and on another, in a child process;
- a transformers LLaMA decode token at batch 4 (merged q/k/v and gate/up) runs its projections
  in the kernel, and its logits match eager's at float32 rtol 1e-4 / atol 1e-4;
- called directly, the handler computes 1-20 rows (beyond 8: 8 at a time against one tile of W)
  and edge shapes (K of 1, 7, 9, 15, 16, 17 and 513; N of 1, 3, 5, 6 and 1001) within float32
  rounding of a float64
  reference (|error| <= 1e-5 x sum |x| |w| per element), gives zeros for an empty contraction,
  and refuses bfloat16 operands with a message that says what it takes."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from fx2xla import torch_kernels
from fx2xla.metrics import live_graphs
from fx2xla.runtime.executor import optimized_hlo_text
from fx2xla.testing import llama, mlp

from tests.conftest import calls_in_threads, llama_decode_step
from tests.lowering.test_linear_weights import NO_FEW_ROWS, laid_count

TARGET = "fx2xla_few_rows_matmul"
TOL = dict(rtol=1e-5, atol=1e-5)
pytestmark = pytest.mark.skipif(not torch_kernels.available("few_rows_matmul"), reason=torch_kernels.status())


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(model, *args, **options):
    """`model` compiled with fx2xla (and `options`) and called on args under no_grad: (result,
    the new graphs, handler calls it made, compiled)."""
    before = {id(g) for g in live_graphs}
    calls = torch_kernels.few_rows_calls()
    compiled = torch.compile(model, backend="fx2xla", options=options or None)
    with torch.no_grad():
        out = compiled(*args)
    return out, [g for g in live_graphs if id(g) not in before], torch_kernels.few_rows_calls() - calls, compiled


def planned(graphs) -> tuple[int, int]:
    """(matmuls planned for the kernel, matmuls planned with the weight on the left)."""
    return sum(len(g.plan.few_rows) for g in graphs), sum(len(g.plan.weight_lhs) for g in graphs)


class Stack(torch.nn.Module):
    def __init__(self, k, n, bias):
        super().__init__()
        self.a = torch.nn.Linear(k, n, bias=bias)
        self.b = torch.nn.Linear(n, 19, bias=bias)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


# K, N of the first Linear: remainders of 8-float chunks and 8-column groups (37 x 45), a small
# even one, and a 4 MiB weight that XLA's threads share.
SHAPES = [(64, 256), (37, 45), (1024, 1024)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("k,n", SHAPES, ids=[f"{k}x{n}" for k, n in SHAPES])
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8])
def test_matches_eager(rows, k, n, bias):
    """Both Linears run in the kernel: eager's result within TOL; both planned as few-row
    matmuls, none weight-left, no weight relaid; the optimized HLO calls the kernel twice and
    the handler ran twice."""
    torch.manual_seed(0)
    model = Stack(k, n, bias).eval()
    x = torch.randn(rows, k)
    out, graphs, calls, _ = run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **TOL)
    assert planned(graphs) == (2, 0) and laid_count(graphs) == 0
    assert calls == 2
    hlo = optimized_hlo_text(graphs[0].static.exe)
    assert len(re.findall(rf'custom_call_target="{TARGET}"', hlo)) == 2, hlo


def test_three_d_input():
    """A [2, 3, 64] input (6 rows once flattened) takes the kernel too, and matches eager."""
    torch.manual_seed(0)
    model = mlp(64, 128, 32).eval()
    x = torch.randn(2, 3, 64)
    out, graphs, calls, _ = run(model, x)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **TOL)
    assert planned(graphs) == (2, 0) and calls == 2


@pytest.mark.parametrize("case", ["one_row", "nine_rows", "bf16", "option_off"])
def test_left_to_xla(case):
    """One row (XLA's dot is fast there), 9 rows (weight on the left: faster from there on),
    bf16, and the option torch_kernels without "few_rows_matmul" (weight on the left at 4 rows)
    make no kernel call and match eager; the option off agrees with the kernel within TOL."""
    torch.manual_seed(0)
    model = mlp(64, 128, 32).eval()
    rows = {"one_row": 1, "nine_rows": 9}.get(case, 4)
    x = torch.randn(rows, 64)
    tol = TOL
    options = {"torch_kernels": NO_FEW_ROWS} if case == "option_off" else {}
    if case == "bf16":
        model, x, tol = model.bfloat16(), x.bfloat16(), dict(rtol=1.6e-2, atol=2e-2)
    out, graphs, calls, _ = run(model, x, **options)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), **tol)
    assert calls == 0 and planned(graphs)[0] == 0
    if case in ("nine_rows", "option_off"):
        assert planned(graphs) == (0, 2)
    if case == "option_off":
        torch._dynamo.reset()
        with_kernel, graphs, calls, _ = run(model, x)
        assert calls == 2 and planned(graphs) == (2, 0)
        torch.testing.assert_close(with_kernel, out, **TOL)


def test_training_and_dynamic_rows_keep_xla():
    """A training graph (its weights change every step) and symbolic rows (dynamic=True) make no
    kernel call; the gradients and every batch size match eager."""
    torch.manual_seed(0)
    model = mlp(32, 64, 16)
    x = torch.randn(4, 32)
    calls = torch_kernels.few_rows_calls()
    torch.compile(model, backend="fx2xla")(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
    compiled = torch.compile(model.eval(), backend="fx2xla", dynamic=True)
    with torch.no_grad():
        for batch in (2, 5, 8):
            xb = torch.randn(batch, 32)
            torch.testing.assert_close(compiled(xb), model(xb), **TOL)
    assert torch_kernels.few_rows_calls() == calls


def _split_stack():
    """A compiled Stack whose first weight (4 MiB) is cut across XLA's threads, four inputs of 8
    rows and one call's result for each, checked against eager's within TOL."""
    torch.manual_seed(0)
    model = Stack(1024, 1024, True).eval()
    inputs = [torch.randn(8, 1024) for _ in range(4)]
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        refs = [compiled(x) for x in inputs]
        for x, ref in zip(inputs, refs):
            torch.testing.assert_close(ref, model(x), **TOL)
    return compiled, inputs, refs


def test_threads():
    """Four threads calling one compiled model whose first weight (4 MiB) is cut across XLA's
    threads get, on every call, the bits one call of it gives, and eager's result within TOL."""
    compiled, inputs, refs = _split_stack()
    calls = torch_kernels.few_rows_calls()
    results = calls_in_threads(compiled, inputs, 20)
    assert torch_kernels.few_rows_calls() - calls == 4 * 20 * 2
    for i in range(4):
        for out in results[i]:
            assert torch.equal(out, refs[i])


@pytest.mark.parametrize("spin", [True, False], ids=["polled", "slept"])
def test_split_waits_polled_or_slept(spin):
    """A model whose 4 MiB weight is cut across XLA's threads, called 30 times from each of four
    threads with split waits polled (torch_kernels.split_spin(True), the default) or slept at
    once (False): every result is the bits one call gives, within TOL of eager's. The counters
    agree with the setting: slept, no caller polled; polled, none polled beyond those that waited,
    and none saw its parts end beyond those that polled. set_split_spin returns the setting it
    replaced, and the block restores the default."""
    compiled, inputs, refs = _split_stack()
    with torch_kernels.split_spin(spin):
        assert torch_kernels.set_split_spin(spin) is spin  # the block's own setting
        before, parts = torch_kernels.split_waits(), torch_kernels.split_parts()["parts"]
        results = calls_in_threads(compiled, inputs, 30)
        after = torch_kernels.split_waits()
    assert torch_kernels.set_split_spin(True) is True  # restored on leaving
    assert torch_kernels.split_parts()["parts"] > parts  # the weight was cut into parts
    waits, polled, polled_out = (after[k] - before[k] for k in ("waits", "polled", "polled_out"))
    if spin:
        assert polled <= waits and polled_out <= polled, after
    else:
        assert polled == 0 and polled_out == 0, after
    for i in range(4):
        assert len(results[i]) == 30
        for out in results[i]:
            assert torch.equal(out, refs[i])


@pytest.mark.skipif(torch_kernels.helper_count() < 1, reason="helper threads need two usable cores or more")
def test_threads_with_helpers(monkeypatch):
    """Five threads (the main one among them) calling one compiled model whose 4 MiB weight is
    cut into parts, compiled with FX2XLA_HELPER_THREADS=1 so that each call asks the library's
    helper threads for them (torch_kernels.run_helped; one split is posted at a time, the others
    go to XLA's pool): every result, on every thread, is the bits one call gives, and within TOL
    of eager's (eager's first: see docs/usage.md on the helper threads)."""
    import threading

    torch.manual_seed(0)
    model = Stack(1024, 1024, True).eval()
    inputs = [torch.randn(8, 1024) for _ in range(5)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
    before = set(live_graphs)  # held: no id of theirs is reused
    monkeypatch.setenv("FX2XLA_HELPER_THREADS", "1")
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        refs = [compiled(x) for x in inputs]
    monkeypatch.delenv("FX2XLA_HELPER_THREADS")
    for ref, want in zip(refs, expected):
        torch.testing.assert_close(ref, want, **TOL)
    graphs = [g for g in live_graphs if g not in before and g.static is not None and g.plan.few_rows]
    assert len(graphs) == 1 and graphs[0].static.helped
    results, errors = {i: [] for i in range(5)}, []

    def work(i):
        try:
            with torch.no_grad():
                for _ in range(20):
                    results[i].append(compiled(inputs[i]))
        except Exception as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    work(0)
    for t in threads:
        t.join()
    assert not errors, errors[0]
    for i in range(5):
        assert len(results[i]) == 20
        for out in results[i]:
            assert torch.equal(out, refs[i])


HELPING = """
import json, os, threading
import torch
import fx2xla
from fx2xla import torch_kernels
from fx2xla.metrics import live_graphs

torch.manual_seed(0)
model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(1024, 1024), torch.nn.Tanh())]).eval()
x = torch.randn(4, 1024)
out = {}
with torch.no_grad():
    eager = model(x)
    for mode in ("on", "off"):
        torch._dynamo.reset()
        if mode == "on":
            os.environ["FX2XLA_HELPER_THREADS"] = "1"
        before = set(live_graphs)  # held: no id of theirs is reused
        compiled = torch.compile(model, backend="fx2xla")
        first = compiled(x)
        os.environ.pop("FX2XLA_HELPER_THREADS", None)
        [spec] = [g.static for g in live_graphs if g not in before and g.static is not None and g.plan.few_rows]
        helped = torch_kernels.helped_parts()
        ys = [compiled(x) for _ in range(80)]
        out[mode] = {"helped": spec.helped, "helped_parts": torch_kernels.helped_parts() - helped,
                     "same": all(torch.equal(y, first) for y in ys), "first": first.tolist(),
                     "err": float((first - eager).abs().max())}
        box = {}

        def other():
            before = torch_kernels.helped_parts()
            with torch.no_grad():
                box["ys"] = [compiled(x) for _ in range(80)]
            box["helped_parts"] = torch_kernels.helped_parts() - before

        t = threading.Thread(target=other)
        t.start()
        t.join()
        out[mode]["other_thread_helped_parts"] = box["helped_parts"]
        out[mode]["other_thread_same"] = all(torch.equal(y, first) for y in box["ys"])
print(json.dumps(out))
"""


@pytest.mark.serial  # the helpers join a split only while no other process takes their core
@pytest.mark.skipif(torch_kernels.helper_count() < 1,
                    reason="helper threads need two usable cores or more")
def test_helper_threads_take_parts():
    """In a child process, an inference graph whose four 4 MiB few-row matmuls split into parts,
    compiled with FX2XLA_HELPER_THREADS=1: its calls, from the main thread and from another, ask
    the library's helper threads, which run parts of them; the results are the bits of the first
    call, the same as compiled without it (the default: no help asked, no part run by a helper),
    and within TOL of eager's (computed before any compiled call)."""
    done = subprocess.run([sys.executable, "-c", HELPING], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    out = json.loads(done.stdout.strip().splitlines()[-1])
    on, off = out["on"], out["off"]
    assert on["helped"] and not off["helped"], out
    assert on["helped_parts"] > 0 and on["other_thread_helped_parts"] > 0, on
    assert off["helped_parts"] == 0 and off["other_thread_helped_parts"] == 0, off
    assert on["same"] and off["same"] and on["other_thread_same"] and off["other_thread_same"], out
    assert on["first"] == off["first"], "parts run by helpers gave other bits"
    assert on["err"] <= TOL["atol"] * 10 and off["err"] <= TOL["atol"] * 10, out


def test_llama_decode_token():
    """A transformers LLaMA (merged q/k/v and gate/up), one token at batch 4 after a cached
    prompt: the kernel runs its projections and head, and the logits match eager's."""
    torch.manual_seed(0)
    model = llama(layers=2).eval()
    step, token, mask, expected = llama_decode_step(model, 4)
    out, graphs, calls, _ = run(step, token, mask)
    # per layer q/k/v (merged), o, gate/up (merged), down; and the head
    assert planned(graphs)[0] == 2 * 4 + 1 and calls == 2 * 4 + 1
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def _direct(x, w):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return np.asarray(jax.jit(lambda x, w: jax.ffi.ffi_call(TARGET, out)(x, w))(x, w))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 16, 20])
@pytest.mark.parametrize("k,n", [(1, 5), (7, 33), (9, 8), (15, 3), (16, 6), (17, 5), (513, 1), (600, 1001)])
def test_handler_directly(m, k, n):
    """The handler on its own: rows beyond 8 (taken 8 at a time), K below, at and just past one
    16-float chunk, N not a whole number of tiles (4 rows of W up to 4 rows of x, 2 beyond), a
    single column, and a 2.3 MiB weight cut across XLA's threads, each element within
    1e-5 x sum |x| |w| of a float64 reference."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    out = _direct(x, w)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
    assert out.shape == (m, n) and np.all(np.abs(out - ref) <= bound)


def test_handler_empty_and_refusals():
    """An empty contraction gives zeros; bfloat16 operands are refused, naming the kernel and
    what it takes."""
    assert np.array_equal(_direct(np.zeros((3, 0), np.float32), np.zeros((4, 0), np.float32)), np.zeros((3, 4)))
    x = jnp.ones((2, 8), jnp.bfloat16)
    with pytest.raises(Exception, match=f"{TARGET}: x, W and y must be float32"):
        jax.jit(lambda x: jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((2, 4), jnp.float32))(x, x[:4]))(x)


EIGHT_LANES = """
import jax, jax.numpy as jnp, numpy as np
from fx2xla import torch_kernels
assert torch_kernels.load()[0]
bad = []
for m in (1, 2, 3, 4, 5, 8, 9, 20):
    for k, n in ((1, 5), (7, 33), (9, 8), (15, 3), (16, 6), (17, 5), (600, 1001)):
        rng = np.random.default_rng(m * 1000 + k + n)
        x = rng.standard_normal((m, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        out = jax.ShapeDtypeStruct((m, n), jnp.float32)
        y = np.asarray(jax.jit(lambda x, w: jax.ffi.ffi_call("fx2xla_few_rows_matmul", out)(x, w))(x, w))
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
        if y.shape != (m, n) or not np.all(np.abs(y - ref) <= bound):
            bad.append((m, k, n))
print("bad", bad)
"""


def test_handler_with_eight_lanes():
    """The 8-lane tiles (2 x 4, 4 x 2 and 8 x 1 accumulators: what a CPU without AVX-512 runs),
    forced with FX2XLA_FEW_ROWS_LANES=8 in a child process: 1-20 rows and the edge shapes of
    test_handler_directly, each element within 1e-5 x sum |x| |w| of a float64 reference."""
    env = {**os.environ, "FX2XLA_FEW_ROWS_LANES": "8"}
    done = subprocess.run([sys.executable, "-c", EIGHT_LANES], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "bad []", done.stdout
