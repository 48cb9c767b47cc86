"""Host offloading in a training step: device memory and step time, with and without, against
eager and Inductor, measured in one run (memory: one fresh process per contender).

    PJRT_DEVICE=CUDA python3 bench/offload.py                       # GPU: 24-layer LLaMA, bf16
    .venv/bin/python bench/offload.py --device cpu --layers 2 --hidden 64 --batch 2 --seq 16 \\
        --vocab 128 --dtype float32 --rounds 3                      # CPU smoke run (no memory saved there)

Contenders: eager; Inductor (`torch.compile` of the model and of `opt.step`); fx2xla with no
offloading, with `offload="activations"`, `"optimizer"`, and both. One step = forward,
cross-entropy, backward, `AdamW(foreach=True).step()` (compiled with the same backend and
options), `zero_grad`. Models come from bench/gpu.py's configs (random weights, dropout 0).

Per contender:
- first step (synced), and the losses of the first three steps against eager's (relative);
- the three figures of bench/gpu.py: synced wall, queued wall, kernel time (torch.profiler,
  CUDA only), medians of interleaved rounds;
- memory, in a fresh process that runs three steps: torch's peak (`max_memory_allocated`: the
  memory torch's allocator holds, fx2xla's outputs excluded) and XLA's peak on the device
  (`peak_bytes_in_use` of jax's device memory stats: XLA's allocator, whose peak jax cannot
  reset, hence one process each), and what XLA holds after the steps. On the CPU client both
  are absent: memory kinds are compiled in, but host and device are the same RAM.
Raw numbers go to bench/results/offload.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu  # noqa: E402  (model configs, batches, the three figures)
from harness import fmt_time, write_json  # noqa: E402

CONTENDERS = {  # name -> (backend, fx2xla's offload option)
    "eager": (None, None),
    "inductor": ("inductor", None),
    "fx2xla": ("fx2xla", None),
    "fx2xla_activations": ("fx2xla", "activations"),
    "fx2xla_optimizer": ("fx2xla", "optimizer"),
    "fx2xla_both": ("fx2xla", ["activations", "optimizer"]),
}
CHECKED_STEPS = 3


def make_step(model, backend, offload, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if backend is None:
        forward, opt_step = model, opt.step
    else:
        options = {"offload": offload} if offload else None
        forward = torch.compile(model, backend=backend, options=options)
        opt_step = torch.compile(opt.step, backend=backend, options=options)

    def step():
        loss = gpu.loss_fn(forward(x), y)
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build(a, device, dtype):
    cfg = gpu.model_config(a.model, a)
    model = gpu.build_model(cfg).train().to(device, dtype)
    x, y = gpu.make_batch(cfg, device, dtype)
    return cfg, model, x, y


def memory_of(name: str, a) -> dict:
    """Three steps of one contender in this (fresh) process, and the memory they took."""
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    _, model, x, y = build(a, device, dtype)
    backend, offload = CONTENDERS[name]
    step = make_step(model, backend, offload, x, y)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(CHECKED_STEPS):
        loss = step()
    float(loss)
    out: dict = {"torch_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    if backend == "fx2xla":
        import fx2xla

        mem = fx2xla.metrics()["device_memory"]
        out["xla_device_memory"] = mem
        out["offloaded_bytes"] = fx2xla.metrics().get("offloaded_bytes")
    return out


def measure_memory(a) -> dict:
    """memory_of each contender, each in a fresh process."""
    res = {}
    for name in a.contenders:
        argv = [sys.executable, os.path.abspath(__file__), "--memory-of", name, *a.passthrough]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            res[name] = {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["exit %d" % proc.returncode]}
            gpu.log(f"  memory of {name}: FAILED: {res[name]['error']}")
            continue
        res[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        gpu.log(f"  memory of {name}: {res[name]}")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="llama", choices=("gpt2", "llama"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=None, help="default: bench/gpu.py's (LLaMA 1024, GPT-2 768)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {','.join(CONTENDERS)}")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--queued", type=int, default=5)
    p.add_argument("--profiled", type=int, default=3)
    p.add_argument("--phase-budget", type=float, default=60.0, help="seconds of timed rounds")
    p.add_argument("--no-memory", action="store_true", help="skip the per-contender memory processes")
    p.add_argument("--memory-of", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "offload.json"))
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    a.deep_layers = a.layers
    a.passthrough = [v for v in argv if v not in ("--no-memory",)]
    if a.memory_of is not None:
        print(json.dumps(memory_of(a.memory_of, a)))
        return 0
    a.contenders = [c for c in CONTENDERS if c in a.contenders.split(",")]
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    sync = gpu.make_sync(device)
    cfg, base, x, y = build(a, device, dtype)
    results: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "config": cfg,
                     "dtype": a.dtype, "environment": gpu.environment(device), "contenders": {}, "losses": {}}
    import copy

    steps, errors = {}, {}
    for name in a.contenders:
        backend, offload = CONTENDERS[name]
        step = make_step(copy.deepcopy(base), backend, offload, x, y)
        t0 = time.perf_counter()
        try:
            losses = [float(step())]
            results["contenders"][name] = {"first_s": time.perf_counter() - t0}
            losses += [float(step()) for _ in range(CHECKED_STEPS - 1)]
        except Exception as e:  # noqa: BLE001  (report and go on without it)
            errors[name] = gpu.short(e)
            results["contenders"][name] = {"error": gpu.short(e)}
            gpu.log(f"  {name} FAILED: {gpu.short(e)}")
            continue
        results["losses"][name] = losses
        steps[name] = step
        gpu.log(f"  {name}: first step {fmt_time(results['contenders'][name]['first_s']).strip()}, losses {losses}")
    eager = results["losses"].get("eager")
    if eager:
        results["loss_rel_diff_vs_eager"] = {n: max(abs(v - e) / abs(e) for v, e in zip(ls, eager))
                                             for n, ls in results["losses"].items()}
    for name, figs in gpu.figures(steps, sync, a, device, errors).items():
        results["contenders"][name].update(figs)
    if not a.no_memory:
        results["memory"] = measure_memory(a)
    write_json(a.out, results)
    print(f"\n{'contender':20s} {'first':>10s} {'synced':>10s} {'queued':>10s} {'kernel':>10s} {'torch peak':>12s} "
          f"{'XLA peak':>12s} {'loss rel':>9s}")
    for name in a.contenders:
        c, m = results["contenders"].get(name, {}), results.get("memory", {}).get(name, {})
        xla = (m.get("xla_device_memory") or {}).get("peak_bytes_in_use")
        mib = lambda b: f"{b / 2**20:10.1f}Mi" if b else f"{'n/a':>12s}"  # noqa: E731
        rel = results.get("loss_rel_diff_vs_eager", {}).get(name)
        print(f"{name:20s} {gpu.fmt_opt(c.get('first_s')):>10s} {gpu.fmt_opt(c.get('synced_s')):>10s} "
              f"{gpu.fmt_opt(c.get('queued_s')):>10s} {gpu.fmt_opt(c.get('kernel_s')):>10s} "
              f"{mib(m.get('torch_peak_bytes'))} {mib(xla)} {'n/a' if rel is None else f'{rel:9.1e}'}")
    print(f"\nraw numbers: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
