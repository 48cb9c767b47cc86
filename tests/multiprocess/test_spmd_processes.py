"""One mesh over 2 processes × 4 virtual CPU devices (127.0.0.1), started by a plain launcher and
by torchrun: fx2xla's SPMD graphs give the same results as one process with 8 devices. Each process hands in only its own devices' shards;
outputs come back whole (gathered) or stay sharded (each process its own block); an input can be
built from each process's own rows; 5 AdamW steps under DP and under FSDP equal the one-process
run and eager. float32 throughout: rtol 1e-4, atol 1e-5 (the collectives sum in another order
than one device does)."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import tolerance

HERE = Path(__file__).resolve().parent
WORKER = HERE / "spmd_worker.py"
TIMEOUT = 240  # both processes import torch and jax and compile ~8 graphs on 2 cores
TOL = dict(rtol=1e-4, atol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(cmds: list[list[str]], env: dict) -> list[str]:
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for c in cmds]
    try:
        logs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"worker exited {p.returncode}:\n{log[-4000:]}"
    return logs


def _env(cache_dir=None) -> dict:
    from tests.multiprocess.test_distributed import clean_env  # no launcher's leftovers

    extra = {} if cache_dir is None else {"FX2XLA_CACHE_DIR": str(cache_dir)}  # a cold cache
    return clean_env(PYTHONPATH=str(HERE.parents[1]), **extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process with every device (8), the same code."""
    out = tmp_path_factory.mktemp("single") / "results"
    _run_group([[sys.executable, str(WORKER), str(out), "--single"]], _env(out.parent / "cache"))
    return torch.load(f"{out}.0")


@pytest.fixture(scope="module", params=["plain", "torchrun"])
def group(request, reference, tmp_path_factory):
    """Both processes' results (started by a plain launcher with explicit arguments, or by
    torchrun with none), and the one-process reference."""
    out = tmp_path_factory.mktemp("spmd") / "results"
    if request.param == "plain":
        address = f"127.0.0.1:{_free_port()}"
        cmds = [[sys.executable, str(WORKER), str(out), "--address", address, "--n", "2", "--pid", str(k)]
                for k in range(2)]
    else:
        cmds = [[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
                 f"--master-port={_free_port()}", str(WORKER), str(out)]]
    _run_group(cmds, _env(out.parent / "cache"))
    return [torch.load(f"{out}.{k}") for k in range(2)], reference


def test_forward_whole_local_and_from_local_rows(group):
    (p0, p1), single = group
    from tests.multiprocess.spmd_worker import model_and_data

    model, x, _ = model_and_data()
    with torch.no_grad():
        eager, hidden = model(x), torch.nn.functional.gelu(model[0](x))
    for res in (p0, p1):
        f = res["forward"]
        torch.testing.assert_close(f["whole"], single["forward"]["whole"], **TOL)
        torch.testing.assert_close(f["whole"], eager, **tolerance(torch.float32))
        assert f["sharded_type"] == "ShardedTensor"
        lo, hi = f["local_rows"]
        assert hi - lo == 16 and f["local"].shape == (16, 64)  # its own half, not the whole
        torch.testing.assert_close(f["local"], hidden[lo:hi], **tolerance(torch.float32))
        torch.testing.assert_close(f["gathered"], hidden, **tolerance(torch.float32))
        assert f["from_local_shape"] == (32, 16)  # two processes' 16 rows each
        torch.testing.assert_close(f["from_local"], eager, **tolerance(torch.float32))
    assert p0["forward"]["local_rows"] != p1["forward"]["local_rows"]
    # Devices alternating between processes: each holds every other block of rows, so there is
    # no block of its own to return (one process holds them all); the gathered whole is right.
    for res in (p0, p1):
        assert "do not form one block" in res["forward"]["mixed_local"]
        assert not res["forward"]["mixed_whole"].any()
    assert single["forward"]["mixed_local"] == "no error"


@pytest.mark.parametrize("plan", ["data", "fsdp"])
def test_five_training_steps_equal_one_process(group, plan):
    (p0, p1), single = group
    from tests.multiprocess.spmd_worker import model_and_data

    model, x, y = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    eager = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        eager.append(loss.detach())
    for res in (p0, p1):
        torch.testing.assert_close(res[plan]["losses"], single[plan]["losses"], **TOL)
        torch.testing.assert_close(res[plan]["losses"], torch.stack(eager), **TOL)
        for p, q, r in zip(res[plan]["params"], single[plan]["params"], model.parameters()):
            torch.testing.assert_close(p, q, **TOL)
            torch.testing.assert_close(p, r.detach(), **TOL)


def test_a_peer_killed_mid_step_ends_the_other_naming_it(tmp_path):
    """Process 1 is SIGKILLed in the middle of an FSDP training step: process 0, waiting in a
    collective or about to, exits with fx2xla.distributed.EXIT_CODE within 30 s of the kill
    (jax's own bounds are 60 s and more here), and says which process is gone."""
    import time

    from fx2xla.distributed import EXIT_CODE

    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path / "r"), "--address", address, "--n", "2",
                               "--pid", str(k), "--kill-after", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
             for k in range(2)]
    try:
        victim = procs[1].communicate(timeout=TIMEOUT)[0]
        killed = time.monotonic()
        survivor = procs[0].communicate(timeout=30)[0]  # the bound: well before any jax timeout
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[1].returncode == -9 and "killing itself in step 2" in victim
    assert procs[0].returncode == EXIT_CODE, survivor[-3000:]
    assert "process 1 of 2" in survivor and "is gone" in survivor
    assert waited < 30


def test_auto_sharding_runs_process_0s_plan_everywhere(group):
    """Every process must run the same plan: process 0 solves and the others take its
    solution, through jax's coordination service or (public mode) a broadcast collective; the
    outputs equal eager's (float32 tolerances)."""
    (p0, p1), _ = group
    from tests.multiprocess.spmd_worker import model_and_data

    model, x, _ = model_and_data()
    with torch.no_grad():
        eager = model(x)
    for mode in ("private", "public"):
        assert p0["auto"][mode]["cached"] is None  # process 0 solved (cold cache)
        assert p1["auto"][mode]["cached"] == "process 0"
        assert p0["auto"][mode]["specs"] == p1["auto"][mode]["specs"]
        for res in (p0, p1):
            torch.testing.assert_close(res["auto"][mode]["output"], eager, **tolerance(torch.float32))
