"""Where a CUDA call waits for the GPU on the host, per PJRT client setting.

    PJRT_DEVICE=CUDA python3 bench/gpu_waits.py --out waits.json [--variants default,no_cmdbuf,tfrt]

A stream-ordered call returns before the GPU has run it. This finds the calls that do not, and
where they wait. Each variant runs in its own process (client settings are read when jax's
client starts):
- default: jax's GPU client as fx2xla starts it;
- no_cmdbuf: XLA_FLAGS=--xla_gpu_enable_command_buffer= (no CUDA graphs);
- tfrt: XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT=1 (XLA's asynchronous-dispatch GPU client).

In each: 30 tiny calls (`x + 1`) queued behind a ~0.6 s kernel, as the variants of
gpu_probe.queue_depth (host ms per call: a call that takes ~600 ms waited for the GPU); then
the parts of a small bf16 GPT-2 training step (forward, backward, the compiled foreach AdamW step
with CPU step counters and with `capturable=True`), each timed synced and once behind a ~0.2 s
kernel. Where a part waits, two witnesses say where: the Python stack of the main thread while
it waits (faulthandler, which reads it without the GIL) and the host-side CUDA calls longer
than 2 ms (torch.profiler, which records the driver calls XLA makes too).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {
    "default": {},
    "no_cmdbuf": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="},
    "tfrt": {"XLA_PYTHON_CLIENT_USE_TFRT_GPU_CLIENT": "1"},
}


def stack_while_waiting(fn, after_s: float):
    """Runs `fn`; if it is still running `after_s` seconds in, every thread's Python stack then
    (faulthandler's text, innermost frames first), else None."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback_later(after_s, file=f)
        try:
            fn()
        finally:
            faulthandler.cancel_dump_traceback_later()
        f.seek(0)
        text = f.read()
    return text[:4000] or None


def long_host_calls(prof, min_us=2000.0):
    """The host-side events over `min_us` (CUDA runtime and driver calls, operators), longest
    first, without the profiler's own step ranges."""
    rows = []
    for e in prof.events():
        us = e.time_range.elapsed_us()
        if us >= min_us and e.device_type.name == "CPU" and not e.name.startswith("ProfilerStep"):
            rows.append((round(us / 1e3, 2), e.name, e.thread))
    rows.sort(reverse=True)
    return [{"ms": ms, "name": n, "thread": t} for ms, n, t in rows[:12]]


def behind(torch, fn, sleep_cycles: int, dump_after_s: float):
    """`fn` run once behind a long kernel on torch's stream: host ms, the waiting stack, the
    long host calls."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(sleep_cycles)
        t0 = time.perf_counter()
        stack = stack_while_waiting(fn, dump_after_s)
        host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    return {"host_ms": round(host_ms, 2), "stack": stack, "long_host_calls": long_host_calls(prof)}


def tiny(torch, out):
    import fx2xla  # noqa: F401
    from fx2xla.metrics import live_graphs
    from fx2xla.runtime import handoff

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_probe import queue_depth

    x = torch.zeros(1024, device="cuda")
    compiled = torch.compile(lambda x: x + 1, backend="fx2xla")
    compiled(x)
    torch.cuda.synchronize()
    graph = list(live_graphs)[-1]
    spec, dev = graph.static, graph.executor.jax_device
    imp = handoff.make_importer(platform="cuda")
    order = handoff.make_stream_order(platform="cuda")
    export = handoff.make_exporter(platform="cuda")
    depth = queue_depth(graph, spec, dev, imp, order, export, x)
    depth.update(queue_experiments(torch, spec, dev, imp, order, export, x))
    out["queue_ms"] = {k: v for k, v in depth.items()}
    out["queue_first_wait"] = {k: next((i for i, t in enumerate(v) if isinstance(t, float) and t > 100), None)
                               for k, v in depth.items()}
    keep = []
    out["queued_calls_behind"] = behind(torch, lambda: keep.extend(compiled(x) for _ in range(30)),
                                        600_000_000, 0.2)
    ys = [compiled(x) for _ in range(3)]
    torch.cuda.synchronize()
    out["tiny_values_ok"] = bool(all(float(y.sum()) == 1024.0 for y in ys + keep))


def queue_experiments(torch, spec, dev, imp, order, export, x, calls=30):
    """Host ms per call, 30 calls behind a ~0.3 s kernel, for variants that tell which part of
    the ordered hand-off makes the host wait: the input imported once and reused (no import per
    call), twenty imports per call, the results dropped at once, and four external-ready streams
    in turn (jax hands them out round-robin)."""
    from gpu_probe import queued_host_ms
    from jax._src.lib import _jax

    def run(fn):
        return fn().consume_with_handlers([lambda s: s[0]])[0]

    once = imp(x, dev)

    raw_import = _jax.dlpack_managed_tensor_to_buffer
    streams = [dev.get_stream_for_external_ready_events() for _ in range(4)]
    ext = [torch.cuda.ExternalStream(s, device=x.device) for s in streams]
    ev = [torch.cuda.Event() for _ in streams]
    turn = [0]

    def rotating():
        i = turn[0] = (turn[0] + 1) % 4
        ev[i].record(torch.cuda.current_stream())
        ext[i].wait_event(ev[i])
        buf = raw_import(torch.utils.dlpack.to_dlpack(x), dev, streams[i], None, None)
        return export(run(lambda: spec.exe.execute_sharded([buf])))

    variants = {
        "reused_input_ordered_export": lambda: (order(dev, 0), export(run(lambda: spec.exe.execute_sharded([once]))))[1],
        "twenty_imports_ordered_export": lambda: (order(dev, 0), [imp(x, dev) for _ in range(19)],
                                                  export(run(lambda: spec.exe.execute_sharded([imp(x, dev)]))))[2],
        "ordered_export_dropped": lambda: (order(dev, 0), export(run(lambda: spec.exe.execute_sharded([imp(x, dev)]))))
        and None,
        "four_streams_ordered_export": rotating,
    }
    return {name: queued_host_ms(name, fn, calls) for name, fn in variants.items()}


def train(torch, out, layers=2):
    import copy

    import transformers

    import fx2xla  # noqa: F401

    config = transformers.GPT2Config(n_layer=layers, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, 8192, (4, 256), device="cuda")
    for capturable in (False, True):
        model = copy.deepcopy(base)
        fwd = torch.compile(model, backend="fx2xla")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True, capturable=capturable)
        opt_step = torch.compile(opt.step, backend="fx2xla")
        state = {}

        def forward():
            state["loss"] = fwd(ids).logits.float().logsumexp(-1).mean()

        parts = (("forward", forward), ("backward", lambda: state["loss"].backward()),
                 ("opt_step", lambda: opt_step()), ("zero_grad", lambda: opt.zero_grad(set_to_none=True)))
        for _ in range(3):  # compiles (the step recompiles on step 2)
            for _, fn in parts:
                fn()
        times = {n: [] for n, _ in parts}
        for _ in range(5):
            for n, fn in parts:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times[n].append(time.perf_counter() - t0)
        res = out.setdefault("train", {}).setdefault("capturable" if capturable else "cpu_steps", {})
        for n, fn in parts:  # one more step, each part behind a long kernel
            res[n] = {"synced_ms": round(statistics.median(times[n]) * 1e3, 3),
                      "behind_0.2s_kernel": behind(torch, fn, 200_000_000, 0.05)}
            print("capturable" if capturable else "cpu_steps", n, res[n]["synced_ms"],
                  res[n]["behind_0.2s_kernel"]["host_ms"], flush=True)


def child(variant: str, out_path: str) -> None:
    import torch

    out: dict = {"variant": variant, "env": VARIANTS[variant]}
    try:
        import jax

        import fx2xla  # noqa: F401
        from fx2xla.runtime.client import device_of

        d = device_of(torch.device("cuda", 0)).jax_device
        out["client"] = {"platform_version": d.client.platform_version, "jax": jax.__version__,
                         "torch": torch.__version__, "device": str(d)}
    except Exception as e:  # noqa: BLE001
        out["client_error"] = f"{type(e).__name__}: {e}"[:500]
    for name, fn in (("tiny", tiny), ("train", train)):
        t0 = time.perf_counter()
        try:
            fn(torch, out)
        except Exception as e:  # noqa: BLE001
            import traceback

            out[f"{name}_error"] = (f"{type(e).__name__}: {e}"[:600], traceback.format_exc()[-1500:])
        out[f"{name}_s"] = round(time.perf_counter() - t0, 1)
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
        print(f"[{variant}] {name} done in {out[name + '_s']} s", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default="gpu_waits.json")
    p.add_argument("--child-timeout", type=float, default=150.0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.out)
    results = []
    for v in a.variants.split(","):
        path = f"{a.out}.{v}.part"
        env = {**os.environ, **VARIANTS[v]}
        if "XLA_FLAGS" in VARIANTS[v] and os.environ.get("XLA_FLAGS"):
            env["XLA_FLAGS"] = os.environ["XLA_FLAGS"] + " " + VARIANTS[v]["XLA_FLAGS"]
        t0 = time.perf_counter()
        try:
            rc = subprocess.run([sys.executable, __file__, "--child", v, "--out", path], env=env,
                                timeout=a.child_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        try:
            with open(path) as f:
                r = json.load(f)
            os.remove(path)
        except (OSError, ValueError):
            r = {"variant": v}
        r["rc"], r["seconds"] = rc, round(time.perf_counter() - t0, 1)
        results.append(r)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
        print(json.dumps({k: r.get(k) for k in ("variant", "rc", "seconds", "queue_first_wait")}), flush=True)


if __name__ == "__main__":
    main()
