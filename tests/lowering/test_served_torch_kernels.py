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
- FX2XLA_SERVE_TORCH_KERNELS=1, read when the library loads, serves; unset or 0 serves nothing."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import fx2xla
from fx2xla import torch_kernels
from fx2xla.testing import SmallCNN

from tests.conftest import tolerance

pytestmark = pytest.mark.skipif(not torch_kernels.available("matmul"), reason=torch_kernels.status())
TOL = tolerance(torch.float32)


@pytest.fixture(autouse=True)
def _serving_on():
    with torch_kernels.serving(True):
        yield


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(256, 1024)
        self.down = torch.nn.Linear(1024, 256)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _train_step(model, make_input, steps: int = 2):
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


def _inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda step: torch.randn(*shape, generator=g)


def test_training_step_serves_its_matmuls():
    torch.manual_seed(0)
    served = _train_step(MLP(), _inputs((32, 256)))
    assert served == 2 * 5  # the forward's two matmuls, the backward's three, per step


def test_serving_off_serves_nothing_with_the_same_results():
    torch.manual_seed(0)
    with torch_kernels.serving(False):
        served = _train_step(MLP(), _inputs((32, 256)))
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
    served = _train_step(train, _inputs((8, 3, 32, 32)))
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


def test_off_with_the_environment_variable():
    script = textwrap.dedent("""
        import torch
        from fx2xla import torch_kernels
        from fx2xla.testing import SmallCNN
        model = SmallCNN().eval()
        x = torch.randn(8, 3, 32, 32)
        with torch.no_grad():
            out = torch.compile(model, backend="fx2xla")(x)
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)
        print("served", torch_kernels.served_calls())
    """)
    for value, served in ((None, 0), ("0", 0), ("1", 3)):
        env = {k: v for k, v in os.environ.items() if k != "FX2XLA_SERVE_TORCH_KERNELS"}
        if value is not None:
            env["FX2XLA_SERVE_TORCH_KERNELS"] = value
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"served {served}" in out.stdout
