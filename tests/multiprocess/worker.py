"""One process of a test group, run by test_distributed.py: `worker.py MODE [options]`.

Modes: `reduce` (join, check the global mesh, a cross-process sum, barriers, process 0's text
shared in public mode; prints a RESULT line of JSON, its last collective done), `kill` (join, then loop on a cross-process sum; process --victim SIGKILLs itself
after --iterations), `join` (join a group whose other process never comes), `raise` (join, meet
at a barrier; then process 0's program ends on the jax runtime error a collective raises when
its peer is killed, and process 1 SIGKILLs itself 0.2 s later: the error comes first, as a
collective reading from the peer when it dies can make it)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import numpy as np

from fx2xla import distributed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["reduce", "kill", "join", "raise"])
    p.add_argument("--address")  # omitted: torchrun's environment
    p.add_argument("--n", type=int)
    p.add_argument("--pid", type=int)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--init-timeout", type=float, default=60)
    p.add_argument("--heartbeat-timeout", type=float, default=100)
    p.add_argument("--collective-timeout", type=float)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--iterations", type=int, default=50)
    a = p.parse_args()
    kwargs = dict(local_device_count=a.devices, init_timeout_s=a.init_timeout, heartbeat_timeout_s=a.heartbeat_timeout,
                  collective_timeout_s=a.collective_timeout)
    distributed.initialize(a.address, a.n, a.pid, **kwargs)
    if a.mode == "join":
        raise SystemExit("joined a group that should have timed out")
    import jax

    me, n = distributed.process_index(), distributed.process_count()
    total = jax.jit(lambda x: x.sum())
    full = np.arange(n * a.devices * 8, dtype=np.float32).reshape(n * a.devices, 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("p",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
    rows = full.shape[0] // n
    x = jax.make_array_from_process_local_data(sharding, full[me * rows:(me + 1) * rows], full.shape)

    if a.mode == "raise":
        distributed.barrier("ready", timeout_s=60)
        if me == 0:
            raise jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Read error: Connection reset by peer")
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)

    if a.mode == "kill":
        for i in range(1_000_000):
            total(x).block_until_ready()
            if me == a.victim and i == a.iterations:
                os.kill(os.getpid(), signal.SIGKILL)
        return

    result = {
        "process_index": me, "process_count": n, "is_initialized": distributed.is_initialized(),
        "global_ids": [d.id for d in jax.devices()], "local_ids": [d.id for d in distributed.local_devices()],
        "jax_process_index": jax.process_index(), "sum": float(total(x)), "expected": float(full.sum()),
    }
    distributed.initialize(a.address, a.n, a.pid, **kwargs)  # the same again: nothing happens
    try:
        distributed.initialize(a.address, a.n, a.pid, **dict(kwargs, local_device_count=a.devices + 1))
        result["different_args"] = "accepted"
    except distributed.DistributedError as e:
        result["different_args"] = str(e)
    # Both ways of waiting: the coordination service's barrier, and the public collective.
    result["private_client"] = distributed.coordination_client() is not None
    distributed.barrier("twice", timeout_s=30)
    distributed.barrier("twice", timeout_s=30)
    os.environ["FX2XLA_PUBLIC_DISTRIBUTED"] = "1"
    result["public_client"] = distributed.coordination_client() is not None
    distributed.barrier("public", timeout_s=30)
    result["public_share"] = distributed.ProcessShare(me, None)("greeting", "from process 0" if me == 0 else None)
    del os.environ["FX2XLA_PUBLIC_DISTRIBUTED"]
    # One write: the other process and Gloo's C++ logging may share this stdout (under torchrun).
    os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())


if __name__ == "__main__":
    main()
