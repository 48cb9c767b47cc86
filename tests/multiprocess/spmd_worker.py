"""fx2xla over a mesh that spans processes, run by test_spmd_processes.py:
`spmd_worker.py OUT --address HOST:PORT --n N --pid K` (or under torchrun, no address), or
`spmd_worker.py OUT --single` (one process with every device: the reference).

Saves to OUT.K (torch.save) what each case returned: a DP forward with whole outputs, the same
graph with outputs kept sharded (this process's block, and the gathered whole), an input built
from each process's own rows, and 5 AdamW steps under DP and under FSDP."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROWS = 32


def model_and_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    return model, torch.randn(ROWS, 16), torch.randn(ROWS, 16)


def forward_cases(me: int, n: int) -> dict:
    import fx2xla

    model, x, _ = model_and_data()
    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    fx2xla.shard_module(model, mesh, {"0.weight": ("model", None), "0.bias": ("model",), "2.weight": (None, "model")})
    fx2xla.mark_sharding(x, mesh, ("data", None))
    hidden = torch.compile(lambda x: F.gelu(model[0](x)), backend="fx2xla", options={"outputs": "sharded"})
    with torch.no_grad():
        out = {"whole": torch.compile(model, backend="fx2xla")(x)}
        h = hidden(x)
        rows = ROWS // n
        out["sharded_type"] = type(h).__name__
        out["local"] = h.local_tensor()  # this process's rows (every column: "model" is within it)
        out["local_rows"] = (me * rows, (me + 1) * rows)
        out["gathered"] = h.full_tensor()
        # A mesh whose devices alternate between the processes: a process's rows are not one block.
        import jax

        devices = jax.devices()
        mixed = fx2xla.Mesh([devices[k // 2 + (k % 2) * (len(devices) // 2)] for k in range(len(devices))], ("rows",))
        y = torch.randn(ROWS, 4)
        fx2xla.mark_sharding(y, mixed, ("rows", None))
        alternate = torch.compile(lambda y: y * 2, backend="fx2xla", options={"outputs": "sharded"})(y)
        try:
            alternate.local_tensor()
            out["mixed_local"] = "no error"
        except fx2xla.ShardingError as e:
            out["mixed_local"] = str(e)
        out["mixed_whole"] = alternate.full_tensor() - y * 2
        own = fx2xla.ShardedTensor.from_local(x[me * rows:(me + 1) * rows], mesh, ("data", None))
        out["from_local_shape"] = tuple(own.shape)
        out["from_local"] = torch.compile(model, backend="fx2xla")(own)
    return out


def train_case(plan: str, steps: int = 5) -> dict:
    import fx2xla

    model, x, y = model_and_data()
    mesh = fx2xla.Mesh((8,), (plan,))
    if plan == "fsdp":
        fx2xla.fsdp(model, mesh, axis="fsdp")
    fx2xla.mark_sharding(x, mesh, (plan, None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    forward, step = torch.compile(model, backend="fx2xla"), torch.compile(opt.step, backend="fx2xla")
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": [p.detach().clone() for p in model.parameters()]}


def train_until_killed(me: int, victim: int, after: int) -> None:
    """FSDP steps in a loop; process `victim` SIGKILLs itself in the middle of step `after`
    (after the forward, before its backward's collectives)."""
    import os
    import signal

    import fx2xla

    model, x, y = model_and_data()
    mesh = fx2xla.Mesh((8,), ("fsdp",))
    fx2xla.fsdp(model, mesh, axis="fsdp")
    fx2xla.mark_sharding(x, mesh, ("fsdp", None))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    forward, step = torch.compile(model, backend="fx2xla"), torch.compile(opt.step, backend="fx2xla")
    for i in range(10_000):
        loss = F.mse_loss(forward(x), y)
        if me == victim and i == after:
            print(f"process {me}: killing itself in step {i}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)


def auto_cases() -> dict:
    """sharding="auto" twice: process 0's solution reaches the others through jax's
    coordination service, then (public mode) through a broadcast collective."""
    import os

    import fx2xla
    from fx2xla.metrics import live_graphs

    out = {}
    for mode, budget in (("private", 400_000), ("public", 300_000)):
        if mode == "public":
            os.environ["FX2XLA_PUBLIC_DISTRIBUTED"] = "1"
        torch._dynamo.reset()
        model, x, _ = model_and_data()
        before = {id(g) for g in live_graphs}
        with torch.no_grad():
            y = torch.compile(model, backend="fx2xla", options={
                "sharding": "auto", "mesh": fx2xla.Mesh((8,), ("x",)), "memory_budget": budget})(x)
        (g,) = [g for g in live_graphs if id(g) not in before]
        out[mode] = {"output": y, "cached": g.auto_sharding.cached,
                     "specs": [p.sharding for p in g.plan.inputs]}
        os.environ.pop("FX2XLA_PUBLIC_DISTRIBUTED", None)
    return out


def run(me: int, n: int) -> dict:
    torch._dynamo.reset()
    results = {"forward": forward_cases(me, n), "auto": auto_cases()}
    for plan in ("data", "fsdp"):
        torch._dynamo.reset()
        results[plan] = train_case(plan)
    return results


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--address")
    p.add_argument("--n", type=int)
    p.add_argument("--pid", type=int)
    p.add_argument("--single", action="store_true")
    p.add_argument("--kill-after", type=int, help="train until process 1 kills itself in this step")
    a = p.parse_args()
    if a.single:
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
        me, n = 0, 1
    else:
        from fx2xla import distributed

        distributed.initialize(a.address, a.n, a.pid, local_device_count=4, init_timeout_s=60,
                               heartbeat_timeout_s=60, collective_timeout_s=60)
        me, n = distributed.process_index(), distributed.process_count()
    if a.kill_after is not None:
        train_until_killed(me, 1, a.kill_after)
        raise SystemExit("trained on after the peer was killed")
    torch.save(run(me, n), f"{a.out}.{me}")
    if not a.single:
        distributed.shutdown()


if __name__ == "__main__":
    main()
