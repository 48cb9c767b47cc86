"""The main thread serving its executions' torch work (fx2xla/csrc/torch_kernels.cc, "Serving";
torch_kernels.worth_serving, runtime.executor.make_served_launcher).

A call from the main thread of a CPU executable that calls the matmul or a convolution handler
runs their products and convolutions whole, on torch's own team, until its execution's results
are ready; other threads' calls run them as before, and so does every call with serving off.
Serving is opt-in (FX2XLA_SERVE_TORCH_KERNELS=1, or torch_kernels.serving(True)); these tests
switch it on. What these tests hold it to, against eager at conftest's float32 tolerance (rtol 1e-4, atol 1e-5):
- an MLP training step (forward, loss, backward): its five large matmuls are served on the main
  thread, with eager's loss and gradients, and the same within tolerance with serving off (then
  none is served);
- a SmallCNN's inference and training steps serve their convolutions (and the convolutions'
  backward);
- a scanned loop's body calls the convolution once per step, a count the server does not know:
  every one is served and the result is eager's;
- calls from other threads are not served, and while the main thread serves, four other threads
  calling the same model get their own inputs' results on every call;
- with jax's CPU client executing inline (`jax_cpu_enable_async_dispatch` False), nothing is
  served and an MLP training step and a SmallCNN's inference still match eager, with no hang;
- FX2XLA_SERVE_TORCH_KERNELS=1, read when the library loads, serves; unset or 0 serves nothing;
  `auto` serves from the second main-thread call; any other value is refused by name;
- serving "auto" (plan_executor.ServeTrial): an MLP training step's forward and backward each
  alternate served and unserved main-thread calls, the first of each way untimed, then
  SERVE_TRIAL_ROUNDS timed each, and choose; every step, trial or not, has eager's loss and
  gradients; after the choice each step serves exactly the handler calls of the executables
  that chose serving; calls from other threads neither serve nor count in the trial."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import fx2xla
from fx2xla import torch_kernels
from fx2xla.metrics import live_graphs
from fx2xla.plan_executor import SERVE_TRIAL_ROUNDS
from fx2xla.testing import SmallCNN

from tests.conftest import tolerance

pytestmark = pytest.mark.skipif(not torch_kernels.available("matmul"), reason=torch_kernels.status())
TOL = tolerance(torch.float32)


@pytest.fixture(autouse=True)
def _serving_on():
    with torch_kernels.serving(True):
        yield


# The MLP's batch rows: at 4-64 rows its forward would multiply with the weight on the left of
# XLA's dot (option linear_weight_lhs) and call no handler.
ROWS = 128


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 1024)
        self.down = torch.nn.Linear(1024, 256)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def train_step(model, make_input, steps: int = 2):
    """`steps` compiled training steps (forward, square-mean loss, backward, SGD) of `model`
    beside eager's on a copy, comparing loss and gradients each step; the handler calls served
    in them."""
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fx2xla")
    before = torch_kernels.served_calls()
    for step in range(steps):
        x = make_input(step)
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        loss = compiled(x).square().mean()
        loss.backward()
        ref = twin(x).square().mean()
        ref.backward()
        torch.testing.assert_close(loss, ref, **TOL)
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
        with torch.no_grad():
            for p, q in zip(model.parameters(), twin.parameters()):
                p.sub_(0.01 * p.grad)
                q.sub_(0.01 * q.grad)
    return torch_kernels.served_calls() - before


def make_inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda step: torch.randn(*shape, generator=g)


def test_training_step_serves_its_matmuls():
    torch.manual_seed(0)
    served = train_step(MLP(), make_inputs((ROWS, 256)))
    assert served == 2 * 5  # the forward's two matmuls, the backward's three, per step


def test_serving_off_serves_nothing_with_the_same_results():
    torch.manual_seed(0)
    with torch_kernels.serving(False):
        served = train_step(MLP(), make_inputs((ROWS, 256)))
    assert served == 0


def test_convolutions_served_in_inference_and_training():
    torch.manual_seed(0)
    model = SmallCNN().eval()
    x = torch.randn(8, 3, 64, 64)
    compiled = torch.compile(model, backend="fx2xla")
    before = torch_kernels.served_calls()
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert torch_kernels.served_calls() - before == 2 * 3
    torch._dynamo.reset()
    torch.manual_seed(0)
    train = SmallCNN().train()
    served = train_step(train, make_inputs((8, 3, 32, 32)))
    assert served == 2 * 6  # per step: 3 convolutions forward, 3 convolution backwards


class ScannedConv(torch.nn.Module):
    """One 3x3 convolution applied once per step of a scanned loop."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x, steps):
        def body(carry, _):
            y = torch.tanh(self.conv(carry))
            return y, y.mean()
        return fx2xla.scan(body, x, steps)


def test_a_loop_body_is_served_at_every_step():
    """The server serves until the results are ready, whatever the number of handler calls: a
    loop of 5 steps serves 5 convolutions."""
    torch.manual_seed(0)
    model = ScannedConv().eval()
    x, steps = torch.randn(4, 8, 16, 16), torch.zeros(5)
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        compiled(x, steps)
        before = torch_kernels.served_calls()
        got = compiled(x, steps)
        served = torch_kernels.served_calls() - before
        want = model(x, steps)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert served == 5


def test_other_threads_run_as_before_and_beside_a_serving_main_thread():
    """Calls from other threads, one at a time, serve nothing. Then four threads call a CNN 20
    times each while the main thread calls it too: the main thread's results equal its call
    alone exactly (each served the same way), the others' are their own inputs' within
    tolerance (their convolutions may be served by the main thread, whole, or sliced on XLA's
    threads), and the main thread served at least its own 60 convolutions."""
    torch.manual_seed(0)
    model = SmallCNN().eval()
    compiled = torch.compile(model, backend="fx2xla")
    inputs = [torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    with torch.no_grad():
        alone_main = compiled(inputs[0])
        torch.testing.assert_close(alone_main, model(inputs[0]), **TOL)
    alone, errors = {}, []

    def single(i):
        with torch.no_grad():
            alone[i] = compiled(inputs[i])

    before = torch_kernels.served_calls()
    for i in range(1, 5):  # alone, one thread at a time: none is served
        t = threading.Thread(target=single, args=(i,))
        t.start()
        t.join()
    assert torch_kernels.served_calls() == before
    for i in range(1, 5):
        torch.testing.assert_close(alone[i], model(inputs[i]), **TOL)

    def work(i):
        try:
            with torch.no_grad():
                for _ in range(20):  # served by the main thread or not: the same within tolerance
                    torch.testing.assert_close(compiled(inputs[i]), alone[i], **TOL)
        except BaseException as e:  # noqa: BLE001  raised below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    with torch.no_grad():
        for _ in range(20):
            assert torch.equal(compiled(inputs[0]), alone_main)
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    assert torch_kernels.served_calls() - before >= 20 * 3


_REPO = Path(__file__).resolve().parents[2]  # the script imports this module's helpers
_INLINE_SCRIPT = textwrap.dedent("""
    import json, jax
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # before the CPU client starts
    import torch
    from fx2xla import torch_kernels
    from fx2xla.runtime import client
    from fx2xla.testing import SmallCNN
    from tests.lowering.test_served_torch_kernels import MLP, ROWS, TOL, make_inputs, train_step

    torch.manual_seed(0)
    with torch_kernels.serving(True):
        train_step(MLP(), make_inputs((ROWS, 256)))  # two steps, each against eager
        cnn = SmallCNN().eval()
        y = torch.randn(8, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(cnn, backend="fx2xla")(y), cnn(y), **TOL)
    print(json.dumps({"async": client.cpu_dispatch_is_async(), "served": torch_kernels.served_calls(),
                      "matmuls": torch_kernels.matmul_calls()}))
""")


def test_inline_executions_are_not_served():
    """With jax's `jax_cpu_enable_async_dispatch` set False before the CPU client starts, the
    launching thread runs each execution to its end, so it cannot serve the work XLA's pool
    threads post to it (before this test it waited forever, in the first forward): with serving
    on, an MLP training step's loss and gradients (two steps) and a SmallCNN's inference still
    match eager's at conftest's float32 tolerance, within the subprocess's 300 s, and nothing is
    served while the matmul handler still runs."""
    out = subprocess.run([sys.executable, "-c", _INLINE_SCRIPT], capture_output=True, text=True, timeout=300,
                         cwd=_REPO,
                         env={k: v for k, v in os.environ.items() if k != "FX2XLA_SERVE_TORCH_KERNELS"})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["async"] is False and result["served"] == 0 and result["matmuls"] >= 2 * 5, result


def test_off_with_the_environment_variable():
    script = textwrap.dedent("""
        import torch
        from fx2xla import torch_kernels
        from fx2xla.testing import SmallCNN
        model = SmallCNN().eval()
        x = torch.randn(8, 3, 32, 32)
        compiled = torch.compile(model, backend="fx2xla")
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
        print("served", torch_kernels.served_calls())
    """)
    # two calls of three convolutions; "auto" times the first call unserved, the second served
    for value, served in ((None, 0), ("0", 0), ("1", 6), ("auto", 3)):
        env = {k: v for k, v in os.environ.items() if k != "FX2XLA_SERVE_TORCH_KERNELS"}
        if value is not None:
            env["FX2XLA_SERVE_TORCH_KERNELS"] = value
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"served {served}" in out.stdout
    env = {**os.environ, "FX2XLA_SERVE_TORCH_KERNELS": "sometimes"}
    out = subprocess.run([sys.executable, "-c", "from fx2xla import torch_kernels; torch_kernels.load()"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "FX2XLA_SERVE_TORCH_KERNELS must be 0, 1 or auto, not 'sometimes'" in out.stderr


def test_set_serving_takes_true_false_or_auto_and_gives_the_previous_back():
    assert torch_kernels.set_serving("auto") is True  # the fixture's setting
    with torch_kernels.serving(False):
        assert torch_kernels.set_serving(True) is False
    assert torch_kernels.set_serving(True) == "auto"  # the block gave "auto" back
    with pytest.raises(ValueError, match="serving must be True, False or 'auto', not 'always'"):
        torch_kernels.set_serving("always")


def _handler_calls(spec) -> int:
    """The matmul handler's call sites in `spec`'s optimized program (none is in a loop here)."""
    text = "\n".join(m.to_string() for m in spec.exe.hlo_modules())
    return text.count('custom_call_target="fx2xla_torch_matmul"')


def test_auto_times_each_executable_both_ways_then_keeps_its_choice():
    trial_steps = 2 * (SERVE_TRIAL_ROUNDS + 1)
    torch._dynamo.reset()  # graphs of their own, whose trials start here
    torch.manual_seed(0)
    before_graphs = set(map(id, live_graphs))
    with torch_kernels.serving("auto"):
        served_in_trial = train_step(MLP(), make_inputs((ROWS, 256)), steps=trial_steps)
        graphs = [g for g in live_graphs if id(g) not in before_graphs and g.static is not None
                  and g.static.serve_trial is not None]
        assert len(graphs) == 2  # the forward and the backward
        for g in graphs:
            trial = g.static.serve_trial
            assert trial.calls == trial_steps
            assert [len(t) for t in trial.seconds] == [SERVE_TRIAL_ROUNDS] * 2
            assert trial.choice == (min(trial.seconds[1]) < min(trial.seconds[0]))
        handler_calls = sorted(_handler_calls(g.static) for g in graphs)
        assert handler_calls == [2, 3]  # the forward's two matmuls, the backward's three
        # the served half of the trial: every call of each way but the untimed first
        assert served_in_trial == sum(handler_calls) * (SERVE_TRIAL_ROUNDS + 1)


def test_auto_after_its_trial_serves_what_it_chose():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP()
    compiled = torch.compile(model, backend="fx2xla")
    before_graphs = set(map(id, live_graphs))
    x = torch.randn(ROWS, 256)
    with torch_kernels.serving("auto"):
        for _ in range(2 * (SERVE_TRIAL_ROUNDS + 1)):
            compiled(x).sum().backward()
        graphs = [g for g in live_graphs if id(g) not in before_graphs and g.static is not None
                  and g.static.serve_trial is not None]
        assert len(graphs) == 2 and all(g.static.serve_trial.choice is not None for g in graphs)
        per_step = sum(_handler_calls(g.static) for g in graphs if g.static.serve_trial.choice)
        model.zero_grad(set_to_none=True)
        before = torch_kernels.served_calls()
        loss = compiled(x).square().mean()
        loss.backward()
        assert torch_kernels.served_calls() - before == per_step
    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    ref = twin(x).square().mean()
    ref.backward()
    torch.testing.assert_close(loss, ref, **TOL)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


def test_auto_counts_only_main_thread_calls():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SmallCNN().eval()
    compiled = torch.compile(model, backend="fx2xla")
    x = torch.randn(8, 3, 32, 32)
    before_graphs = set(map(id, live_graphs))
    with torch.no_grad():
        want = model(x)
    got = []

    def work():
        with torch.no_grad():
            for _ in range(3):
                got.append(compiled(x))

    with torch_kernels.serving("auto"):
        first = threading.Thread(target=work)  # compiles, alone (threads that miss Dynamo's cache at once each trace)
        first.start()
        first.join(timeout=600)
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in [first, *threads]), "a thread hung"
        (graph,) = [g for g in live_graphs if id(g) not in before_graphs and g.static is not None
                    and g.static.serve_trial is not None]
        assert graph.static.serve_trial.calls == 0 and graph.static.serve_trial.choice is None
        before = torch_kernels.served_calls()
        with torch.no_grad():
            got.append(compiled(x))  # the trial's first call: not served
            assert torch_kernels.served_calls() == before
            got.append(compiled(x))  # its second: served
            assert torch_kernels.served_calls() - before == 3
        assert graph.static.serve_trial.calls == 2
    assert len(got) == 11
    for out in got:
        torch.testing.assert_close(out, want, **TOL)
