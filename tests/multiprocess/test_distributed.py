"""fx2xla.distributed: groups of real processes on 127.0.0.1 (2 processes x 4 CPU devices), started
directly and by torchrun; a peer killed mid-loop; settings that are wrong before anything starts.
Every subprocess runs under a timeout and is killed in a `finally` if still alive."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from fx2xla import distributed

WORKER = Path(__file__).with_name("worker.py")
ROOT = WORKER.parents[2]
TIMEOUT_S = 120
# What a launcher may have left in this process's environment; the workers start clean of it.
GROUP_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
              "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FX2XLA_COORDINATOR_ADDRESS", "FX2XLA_COORDINATOR_PORT",
              "FX2XLA_PUBLIC_DISTRIBUTED", "JAX_COORDINATOR_ADDRESS", "XLA_FLAGS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in GROUP_VARS and not k.startswith("TORCHELASTIC_")}
    env.update(extra)
    return env


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state, ppid, pgrp, session, ...)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _session_members(sid: int) -> list[int]:
    """The live processes of session `sid`, children before their parents (descending pid)."""
    if not os.path.isdir("/proc"):
        return []
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat(int(name))
            if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
                members.append(int(name))
    return sorted(members, reverse=True)


class Group:
    """Processes started together, their output in files (no pipe can fill up and stall one).

    Each command runs in a session of its own (torchrun and the workers it starts), so that
    `kill_leftovers` ends a launcher's children too, not only the launcher. A process still
    running at `wait`'s timeout is a hang to be explained: every process of its session gets
    SIGABRT, one at a time, on which Python's faulthandler (PYTHONFAULTHANDLER) writes each
    thread's stack to its stderr, and the failure shows those stacks."""

    def __init__(self, tmp_path: Path, commands: list, env: dict):
        self.procs, self.files = [], []
        env = {**env, "PYTHONFAULTHANDLER": "1"}
        for i, cmd in enumerate(commands):
            out, err = open(tmp_path / f"{i}.out", "w+"), open(tmp_path / f"{i}.err", "w+")
            self.files.append((out, err))
            self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err,
                                               start_new_session=True))
        self.started = time.monotonic()

    def wait(self, i: int, timeout: float = TIMEOUT_S) -> int:
        try:
            return self.procs[i].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        self._abort_one_by_one(self.procs[i])
        try:
            self.procs[i].wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        out, err = self.output(i)
        raise AssertionError(f"process {i} ({' '.join(map(str, self.procs[i].args))[:200]}) still ran "
                             f"{time.monotonic() - self.started:.0f} s after the group started; its session's "
                             f"stacks (stderr):\n{err[-12000:]}\nstdout:\n{out[-3000:]}")

    @staticmethod
    def _abort_one_by_one(proc) -> None:
        """SIGABRT to each process of proc's session in turn, each given up to 5 s to write its
        stacks and die before the next: they share the stderr file, and stacks written at once
        interleave line by line."""
        for pid in _session_members(proc.pid) or [proc.pid]:
            try:
                os.kill(pid, signal.SIGABRT)
            except (ProcessLookupError, PermissionError):
                continue
            for _ in range(50):
                if not _alive(pid):
                    break
                time.sleep(0.1)

    @staticmethod
    def _signal(proc, sig) -> None:
        try:
            os.killpg(proc.pid, sig)  # the session's process group: the command and its children
        except (ProcessLookupError, PermissionError):
            pass

    def output(self, i: int) -> tuple[str, str]:
        out, err = self.files[i]
        out.seek(0)
        err.seek(0)
        return out.read(), err.read()

    def kill_leftovers(self):
        for p in self.procs:
            self._signal(p, signal.SIGKILL)  # also children whose launcher is gone
            if p.poll() is None:
                p.kill()
            p.wait()
        for out, err in self.files:
            out.close()
            err.close()


def worker(mode: str, *args) -> list:
    return [sys.executable, str(WORKER), mode, *map(str, args)]


def explicit(mode: str, port: int, pid: int, *args) -> list:
    return worker(mode, "--address", f"127.0.0.1:{port}", "--n", 2, "--pid", pid, *args)


def results(text: str) -> list:
    # Gloo's C++ logging shares stdout and writes lines in pieces: a RESULT may follow one on its line.
    return [json.loads(m) for m in re.findall(r"RESULT (\{.*\})$", text, re.MULTILINE)]


def check_reduction(found: list):
    assert sorted(r["process_index"] for r in found) == [0, 1]
    for r in sorted(found, key=lambda r: r["process_index"]):
        me = r["process_index"]
        assert r["process_count"] == 2 and r["jax_process_index"] == me and r["is_initialized"]
        assert r["global_ids"] == [0, 1, 2, 3, 2048, 2049, 2050, 2051]
        assert r["local_ids"] == [me * 2048 + i for i in range(4)]
        assert r["sum"] == r["expected"] == sum(range(64))
        assert "already initialized" in r["different_args"] and "local_device_count=4 (now 5)" in r["different_args"]
        assert r["private_client"] and not r["public_client"]
        assert r["public_share"] == "from process 0"


def test_a_hung_group_fails_with_its_stacks_and_leaves_no_process(tmp_path):
    """The harness itself: a launcher whose child hangs fails `wait` with both processes' Python
    stacks (the line each one hangs on), and `kill_leftovers` ends the child as well."""
    child = "import time\ntime.sleep(600)\n"  # hangs on its line 2
    launcher = ("import subprocess, sys, time\n"
                f"p = subprocess.Popen([sys.executable, '-c', {child!r}])\n"
                "print(p.pid, flush=True)\n"
                "time.sleep(600)\n")  # hangs on its line 4
    group = Group(tmp_path, [[sys.executable, "-c", launcher]], clean_env())
    try:
        for _ in range(100):  # the child's pid, once the launcher has started it
            if group.output(0)[0].strip():
                break
            time.sleep(0.1)
        child_pid = int(group.output(0)[0].split()[0])
        with pytest.raises(AssertionError) as info:
            group.wait(0, timeout=3)
        stacks = str(info.value)
        assert stacks.count("Fatal Python error: Aborted") == 2, stacks  # both processes' stacks
        assert 'File "<string>", line 2 in <module>' in stacks and 'File "<string>", line 4 in <module>' in stacks
    finally:
        group.kill_leftovers()
    for _ in range(50):
        if not os.path.exists(f"/proc/{child_pid}") or "Z" in Path(f"/proc/{child_pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the launcher's child {child_pid} outlived kill_leftovers")


def test_two_processes_one_global_mesh(tmp_path):
    """Two processes join, see one global mesh, sum across it, and meet at barriers (private and
    public) and share a text (public). The public barrier and share are gathers over every device:
    each process's 4 devices join one 2-device gloo group with its peer in the other process. No
    such group is still connecting once the process has printed its RESULT, which jax's own
    multihost_utils did not ensure (a peer could exit first and leave the other hung at exit)."""
    port = free_port()
    group = Group(tmp_path, [explicit("reduce", port, i) for i in (0, 1)], clean_env())
    try:
        codes = [group.wait(i) for i in (0, 1)]
        outputs = [group.output(i) for i in (0, 1)]
        assert codes == [0, 0], outputs
        check_reduction([r for out, _ in outputs for r in results(out)])
        for out, _ in outputs:
            # Gloo logs one "[Gloo] Rank r is connected to p peer ranks ..." line per group joined,
            # in pieces that threads joining at once interleave: count the tags. 4 groups of 8
            # devices (the sum) and 4 of 2 (the public gathers), all before the RESULT line.
            before, after = out.split("RESULT {", 1)
            assert before.count("[Gloo]") >= 8 and "[Gloo]" not in after, out
    finally:
        group.kill_leftovers()


def test_torchrun_without_arguments(tmp_path):
    if not torch_distributed_available():
        pytest.skip("this torch build has no torch.distributed (torchrun and TCPStore need it)")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(WORKER), "reduce"]
    group = Group(tmp_path, [cmd], clean_env())
    try:
        code = group.wait(0)
        out, err = group.output(0)
        assert code == 0, (out, err)
        check_reduction(results(out))
    finally:
        group.kill_leftovers()


def test_killed_peer_is_named_and_the_survivor_exits(tmp_path):
    # The timeouts of jax's own bounds are long enough that exiting well before them is the watchdog.
    port, bound_s = free_port(), 20
    args = ("--heartbeat-timeout", bound_s, "--collective-timeout", bound_s, "--victim", 1)
    group = Group(tmp_path, [explicit("kill", port, i, *args) for i in (0, 1)], clean_env())
    try:
        assert group.wait(1) == -9, group.output(1)
        killed_at = time.monotonic()
        code = group.wait(0, timeout=bound_s * 3)
        elapsed = time.monotonic() - killed_at
        out, err = group.output(0)
        assert code == distributed.EXIT_CODE, (out, err)
        assert elapsed < bound_s / 2, elapsed
        victim = f"process 1 of 2 (host {socket.gethostname()}, pid {group.procs[1].pid}) is gone"
        assert victim in err and f"pid {group.procs[0].pid}) exits now" in err, err
    finally:
        group.kill_leftovers()


def test_collective_error_before_the_watchdog_names_the_peer(tmp_path):
    """A collective reading from a peer as it is killed fails at once ("Gloo AllGather failed ...
    Connection reset by peer"), and that error can end the program before the watchdog sees the
    peer's connection close (fresh-clone CI saw it once: the survivor exited with status 1). The
    worker makes that order certain: process 0's program ends on such a jax runtime error, and
    process 1 is killed 0.2 s later. Process 0 still exits with EXIT_CODE, naming process 1,
    after the error's traceback, within 5 s of the kill."""
    port = free_port()
    group = Group(tmp_path, [explicit("raise", port, i) for i in (0, 1)], clean_env())
    try:
        assert group.wait(1) == -9, group.output(1)
        killed_at = time.monotonic()
        code = group.wait(0, timeout=60)
        elapsed = time.monotonic() - killed_at
        out, err = group.output(0)
        assert code == distributed.EXIT_CODE, (out, err)
        assert "JaxRuntimeError" in err and "Connection reset by peer" in err, err
        victim = f"process 1 of 2 (host {socket.gethostname()}, pid {group.procs[1].pid}) is gone"
        assert victim in err and f"pid {group.procs[0].pid}) exits now" in err, err
        assert elapsed < 5, elapsed
    finally:
        group.kill_leftovers()


def test_public_mode_killed_peer_raises_after_the_collective_timeout(tmp_path):
    # No private jax, so no watchdog: the collective waiting for the dead peer raises after
    # collective_timeout_s, and the survivor exits at once instead of waiting in jax's shutdown.
    port, collective_s, heartbeat_s = free_port(), 5, 60
    args = ("--heartbeat-timeout", heartbeat_s, "--collective-timeout", collective_s, "--victim", 1)
    group = Group(tmp_path, [explicit("kill", port, i, *args) for i in (0, 1)],
                  clean_env(FX2XLA_PUBLIC_DISTRIBUTED="1"))
    try:
        assert group.wait(1) == -9, group.output(1)
        killed_at = time.monotonic()
        code = group.wait(0, timeout=heartbeat_s)
        elapsed = time.monotonic() - killed_at
        out, err = group.output(0)
        assert code == 1, (out, err)
        assert "JaxRuntimeError" in err and "Gloo" in err, err
        assert collective_s - 1 < elapsed < collective_s + 10, elapsed
    finally:
        group.kill_leftovers()


def test_join_times_out_naming_the_coordinator(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there: process 0 never comes
    cmd = worker("join", "--address", address, "--n", 2, "--pid", 1, "--init-timeout", 3)
    group = Group(tmp_path, [cmd], clean_env())
    try:
        code = group.wait(0, timeout=60)
        out, err = group.output(0)
        assert code == distributed.EXIT_CODE, (out, err)
        assert f"nothing answers at the coordinator address {address}" in err, err
        assert "init_timeout_s=3" in err
    finally:
        group.kill_leftovers()


@pytest.mark.parametrize("env,message", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is unset"),
    ({"RANK": "1"}, "RANK=1 but WORLD_SIZE is unset"),
    ({"WORLD_SIZE": "2", "RANK": "two"}, "RANK='two' is not an integer"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 with WORLD_SIZE=2: need 0 <= RANK < WORLD_SIZE"),
    ({}, "no process group given"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "no coordinator address"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "MASTER_ADDR=127.0.0.1 but MASTER_PORT is unset"),
    ({"WORLD_SIZE": "2", "RANK": "0", "FX2XLA_COORDINATOR_ADDRESS": "nohostport"},
     "FX2XLA_COORDINATOR_ADDRESS='nohostport' is not 'host:port'"),
], ids=["no-rank", "no-world-size", "bad-rank", "rank-out-of-range", "nothing", "no-address", "no-master-port",
        "bad-address"])
def test_bad_environment_raises_before_anything_starts(monkeypatch, env, message):
    import jax

    for name in GROUP_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(distributed.DistributedError, match=re.escape(message)):
        distributed.initialize()
    assert not jax.distributed.is_initialized() and distributed.group_settings() is None


def test_initialize_after_the_backend_started_says_to_call_it_first():
    import jax

    jax.devices()  # this pytest process's backend (conftest's 8 CPU devices)
    for kwargs in ({}, {"local_device_count": 2}):
        with pytest.raises(distributed.DistributedError, match="must run before jax's backend starts"):
            distributed.initialize("127.0.0.1:1", 1, 0, **kwargs)
    assert not jax.distributed.is_initialized()


class FakeClient:
    def __init__(self):
        self.barriers = []

    def key_value_set(self, key, value):
        raise AssertionError("not used here")

    def blocking_key_value_get(self, key, timeout_ms):
        raise AssertionError("not used here")

    def wait_at_barrier(self, barrier_id, timeout_ms):
        self.barriers.append((barrier_id, timeout_ms))


def test_coordination_client_private_path_and_public_fallback(monkeypatch):
    """barrier() waits at the coordination service's barrier through jax's private client, and
    gathers a checksum of its name over every device in public mode (or where the client lacks
    what it needs); names that differ between processes raise, naming the barrier."""
    from jax._src import distributed as jax_distributed
    import numpy as np

    synced, processes = [], 1

    def gather(row):
        synced.append(int(row[0]))
        rows = np.stack([row] * processes)
        rows[1:] += np.uint32(1)  # the other processes' names differ
        return rows

    monkeypatch.setattr(distributed, "gather_from_processes", gather)
    monkeypatch.delenv("FX2XLA_PUBLIC_DISTRIBUTED", raising=False)
    fake = FakeClient()
    monkeypatch.setattr(jax_distributed.global_state, "client", fake)

    assert distributed.coordination_client() is fake
    distributed.barrier("step", timeout_s=1.5)
    assert fake.barriers == [("fx2xla/barrier/step", 1500)] and synced == []

    assert distributed.coordination_client(public=True) is None
    monkeypatch.setenv("FX2XLA_PUBLIC_DISTRIBUTED", "1")
    distributed.barrier("step", timeout_s=1.5)
    assert synced == [zlib.crc32(b"step")] and len(fake.barriers) == 1
    processes = 2
    with pytest.raises(distributed.DistributedError, match="barrier 'step': the processes arrived at differently named"):
        distributed.barrier("step")

    # A jax whose client lacks what this module calls: the public path, not an AttributeError.
    monkeypatch.delenv("FX2XLA_PUBLIC_DISTRIBUTED")
    monkeypatch.setattr(jax_distributed.global_state, "client", object())
    assert distributed.coordination_client() is None


def test_gather_from_processes_in_one_process():
    """One process of 8 CPU devices (the suite's): every device takes part, and the result is
    this process's row, stacked, in its dtype and shape (0-d, empty and text rows included). A
    dtype jax would narrow (int64 without x64) is refused rather than truncated."""
    import numpy as np

    for row in (np.arange(6, dtype=np.int32).reshape(2, 3), np.array(7, np.uint32), np.zeros(0, np.uint8),
                np.frombuffer("ünï".encode(), np.uint8)):
        out = distributed.gather_from_processes(row)
        assert out.dtype == row.dtype and out.shape == (1, *row.shape)
        np.testing.assert_array_equal(out[0], row)
    assert distributed.ProcessShare(0, None)("k", "from process 0 ✓") == "from process 0 ✓"
    with pytest.raises(ValueError, match="would narrow this int64 row to int32"):
        distributed.gather_from_processes(np.arange(3))


def test_gather_whole_named_and_other_shardings():
    """runtime.handoff.gather_whole: a mesh-sharded array (split over a 2x4 mesh, bf16 and int32)
    by fx2xla's own replicating gather, another sharding by jax's process_allgather; both give
    the array's whole value exactly."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fx2xla.runtime.handoff import gather_whole

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    for dtype in (jnp.bfloat16, jnp.int32):
        value = np.arange(8 * 12).reshape(8, 12).astype(dtype)
        split = jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b")))
        whole = gather_whole(split)
        assert whole.dtype == value.dtype and whole.shape == value.shape
        np.testing.assert_array_equal(whole, value)
    single = jax.device_put(np.arange(5, dtype=np.float32), jax.devices()[3])
    np.testing.assert_array_equal(gather_whole(single), np.arange(5, dtype=np.float32))


def test_gathered_arrays_become_torch_tensors_in_every_dtype():
    """runtime.handoff.gather_array (a sharded output made whole) and numpy_to_torch: bf16 and
    float8 too, which torch.from_numpy refuses, bit for bit; 0-d, empty, non-contiguous and int64
    values; the tensor is a copy (writing it leaves the source alone)."""
    import jax
    import ml_dtypes
    import numpy as np
    import torch

    from fx2xla.runtime.handoff import gather_array, numpy_to_torch

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    value = torch.randn(8, 12).to(torch.bfloat16)
    split = jax.device_put(value.float().numpy().astype(ml_dtypes.bfloat16),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b")))
    whole = gather_array(split, torch.device("cpu"))
    assert whole.dtype == torch.bfloat16 and torch.equal(whole, value)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        t = torch.randn(3, 4).to(dtype)
        source = t.float().numpy().astype(getattr(ml_dtypes, str(dtype).removeprefix("torch.")))
        back = numpy_to_torch(source)
        assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8)), dtype
    source = np.arange(12, dtype=np.int64).reshape(3, 4).T
    for a in (source, np.array(7, np.int64), np.zeros((0, 3), np.float32)):
        t = numpy_to_torch(a)
        assert t.shape == a.shape and t.dtype == torch.from_numpy(np.ascontiguousarray(a)).dtype
        np.testing.assert_array_equal(t.numpy(), a)
    numpy_to_torch(source)[0, 0] = 100
    assert source[0, 0] == 0


def torch_distributed_available() -> bool:
    import torch.distributed

    return torch.distributed.is_available()


@pytest.mark.parametrize("agent_store", [True, False], ids=["torchrun-agent-store", "process-0-hosts"])
def test_processes_agree_on_the_coordinator_port(agent_store):
    if not torch_distributed_available():
        pytest.skip("this torch build has no torch.distributed (TCPStore)")
    from datetime import timedelta

    from torch.distributed import TCPStore

    store_port = free_port()
    # torchrun's agent store stands in as a server of this process's own.
    agent = TCPStore("127.0.0.1", store_port, 1, is_master=True, timeout=timedelta(seconds=30),
                     wait_for_workers=False) if agent_store else None
    got, errors = {}, []

    def join(pid):
        try:
            got[pid] = distributed.agree_port("127.0.0.1", store_port, pid, 2, 30, agent_store=agent_store)
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=join, args=(pid,)) for pid in (1, 0)]  # the reader may come first
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and sorted(got) == [0, 1], errors
    assert got[0][0] == got[1][0] and 0 < got[0][0] < 65536
    if agent is not None:
        assert agent.num_keys() > 0  # the port went through the store torchrun's agent would hold
