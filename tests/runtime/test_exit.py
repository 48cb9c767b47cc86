"""A process that used fx2xla exits with status 0: before the interpreter finalizes, every live
tensor's memory is pinned by a C++ reference that is never dropped, so no XLA thread that lets
go of a tensor handed in from torch takes the GIL during finalization (which CPython answers by
ending the thread, and XLA's noexcept frames by std::terminate: SIGABRT), and executions still
running are waited for, a bounded time (else SIGSEGV, as XLA's threads run into destroyed state). Fresh processes that
load a package, compile and run once, or train with parameters written in place, all exit with 0 (FX2XLA_EXIT_RUNS of each kind
by default, 30 under -m slow). Values are checked against eager in each child (float32:
rtol 1e-4, atol 1e-4)."""
import concurrent.futures
import os
import subprocess
import sys
import time

import pytest
import torch

import fx2xla
from fx2xla.testing import LogitsOnly, gpt2, token_ids

_RUNS = int(os.environ.get("FX2XLA_EXIT_RUNS", "6"))

_LOAD_CHILD = """
import sys, torch, fx2xla
run = fx2xla.load(sys.argv[1])
ids, expected = torch.load(sys.argv[2])
torch.testing.assert_close(run(ids), expected, rtol=1e-4, atol=1e-4)
"""

_COMPILE_CHILD = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
x = torch.randn(64, 256)
with torch.no_grad():
    expected = model(x)
    out = torch.compile(model, backend="fx2xla")(x)
torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
"""

# Training steps whose parameters and moments XLA writes in place (runtime/inplace.py): at exit
# they are torch views that hold XLA's buffers.
_TRAIN_CHILD = """
import copy, sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 16))
start = copy.deepcopy(model)
x = torch.randn(8, 64)
def train(m, backend):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    fwd = torch.compile(m, backend=backend) if backend else m
    step = torch.compile(opt.step, backend=backend) if backend else opt.step
    for _ in range(3):
        fwd(x).square().mean().backward()
        step()
        opt.zero_grad()
    return opt
def eager():
    m = copy.deepcopy(start)
    train(m, None)
    return [p.detach() for p in m.parameters()]
def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))
opt = train(model, "fx2xla")
# Eager's own reference, confirmed by a second run from the same start (a third where they
# differ): about one process in a hundred, under load, the first eager AdamW step computes
# exp_avg_sq.sqrt() (MKL's vector sqrt, two threads of 4096 elements) on one thread to about 12
# bits, and a rerun gives the right values (docs/testing.md, "Eager's own glitch").
ref, again = eager(), eager()
if not same(ref, again):
    third = eager()
    confirmed = [r for r in (ref, again) if same(r, third)]
    print(f"eager disagreed with itself; a third run agrees with {len(confirmed)} of the two", file=sys.stderr)
    if not confirmed:
        raise AssertionError("eager gave three different results from the same start")
    ref = confirmed[0]
for p, q in zip(model.parameters(), ref):
    torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
"""


def _run_children(args_list, env) -> list:
    def one(args):
        return subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, env=env, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two at a time: the machine's cores
        return list(pool.map(one, args_list))


def _assert_all_exit_cleanly(results) -> None:
    failed = [(r.returncode, r.stderr[-800:]) for r in results if r.returncode != 0]
    assert not failed, f"{len(failed)} of {len(results)} processes failed: {failed[:3]}"


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=2, hidden=64, heads=2, vocab=100, positions=64)).eval()
    ids = token_ids(2, 16, vocab=100)
    root = tmp_path_factory.mktemp("exit")
    path = fx2xla.export(model, (ids,), str(root / "pkg"))
    with torch.no_grad():
        torch.save((ids, model(ids)), root / "io.pt")
    return path, str(root / "io.pt"), dict(os.environ, FX2XLA_CACHE_DIR=str(root / "cache"))


def _load_runs(package, runs):
    path, io, env = package
    _assert_all_exit_cleanly(_run_children([(_LOAD_CHILD, path, io)] * runs, env))


def _compile_runs(tmp_path, runs):
    env = dict(os.environ, FX2XLA_CACHE_DIR=str(tmp_path / "cache"))
    _assert_all_exit_cleanly(_run_children([(_COMPILE_CHILD,)] * runs, env))


def test_processes_that_load_a_package_exit_cleanly(package):
    _load_runs(package, _RUNS)


def test_processes_that_compile_exit_cleanly(tmp_path):
    _compile_runs(tmp_path, _RUNS)


def test_processes_that_train_in_place_exit_cleanly(tmp_path):
    """Processes whose parameters and AdamW moments XLA wrote in place (torch views holding
    XLA's buffers when the interpreter finalizes) exit with 0, their parameters matching
    eager's after 3 steps (f32 rtol 1e-4 / atol 1e-5), eager's confirmed by a second eager run
    from the same start."""
    env = dict(os.environ, FX2XLA_CACHE_DIR=str(tmp_path / "cache"))
    _assert_all_exit_cleanly(_run_children([(_TRAIN_CHILD,)] * _RUNS, env))


@pytest.mark.slow
def test_thirty_processes_that_load_a_package_exit_cleanly(package):
    _load_runs(package, 30)


@pytest.mark.slow
def test_thirty_processes_that_compile_exit_cleanly(tmp_path):
    _compile_runs(tmp_path, 30)


_IN_FLIGHT_CHILD = """
import jax, jax.numpy as jnp, torch
from fx2xla.runtime import compile_module, default_device, handoff

def heavy(a):
    for _ in range(150):
        a = jnp.tanh(a @ a)
    return a

device = default_device()
exe = compile_module(jax.jit(heavy).lower(jax.ShapeDtypeStruct((1024, 1024), jnp.float32)).as_text(), device)
x = handoff.import_tensor(torch.randn(1024, 1024), device.jax_device)
y = exe.execute([x])  # 1.5-9 s of work, still running when the script ends; only it holds the tensor
del x, y
"""


def test_an_execution_holding_a_handed_in_tensor_may_outlive_the_script():
    """An execution still running when the script ends, the only holder of a tensor handed in
    from torch: the exit hook waits for it to finish before the interpreter finalizes, and the
    process exits with 0 (it died of SIGSEGV where the execution outlived finalization)."""
    r = subprocess.run([sys.executable, "-c", _IN_FLIGHT_CHILD], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_executions_outliving_their_scripts_on_crowded_cores():
    """Three such processes at once on this machine's cores (their XLA threads kept off the CPU
    for whole windows of the exit wait): each exits with 0. With the wait reading CPU time alone,
    18 of 30 such processes died of SIGSEGV at exit on 2 cores."""
    procs = [subprocess.Popen([sys.executable, "-c", _IN_FLIGHT_CHILD], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]


_BUSY_CHILD = """
import atexit, threading, time, torch
from fx2xla.runtime import default_device, handoff

handoff.import_tensor(torch.randn(4), default_device().jax_device)  # a tensor handed in: the hook works
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
atexit.register(lambda: print(time.monotonic(), flush=True))  # runs before fx2xla's hook (LIFO)
"""


def test_the_exit_wait_is_bounded():
    """A thread that never stops using the CPU (here a daemon thread spinning in Python) holds
    the exit for FX2XLA_EXIT_WAIT_S seconds at most: the process exits with 0, within that wait
    plus 10 s from the script's end."""
    env = dict(os.environ, FX2XLA_EXIT_WAIT_S="1")
    r = subprocess.run([sys.executable, "-c", _BUSY_CHILD], capture_output=True, text=True, timeout=120, env=env)
    ended = time.monotonic()
    assert r.returncode == 0, r.stderr[-2000:]
    assert ended - float(r.stdout.split()[-1]) < 11.0


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux's /proc")
def test_the_exit_wait_sees_threads_waiting_for_a_core():
    """The exit wait asks the kernel too: a thread that spins counts as running (runnable_threads()
    >= 1) and keeps wait_for_other_threads from returning True within its limit; once it ended,
    no other thread of the process runs or waits for a core (0, within 2 s: torch's OpenMP workers
    end their spin) and the wait returns True. CPU time alone took a thread kept off the cores by
    other processes for an ended execution (SIGSEGV at exit, once, in CI)."""
    import threading

    from fx2xla.runtime import handoff

    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert handoff.runnable_threads() >= 1
        assert not handoff.wait_for_other_threads(0.2)
    finally:
        stop.set()
        t.join()
    deadline = time.monotonic() + 2.0
    while handoff.runnable_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handoff.runnable_threads() == 0
    assert handoff.wait_for_other_threads(5.0)
