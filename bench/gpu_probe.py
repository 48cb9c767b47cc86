"""Where a tiny CUDA call spends its host time, stage by stage, and which stage blocks the host.

    PJRT_DEVICE=CUDA python3 bench/gpu_probe.py [--out probe.json]

For `x + 1` on 1024 floats: each stage of the per-call path (the stream order, the import, the
execute, the export, the whole call) timed alone (median of 300, µs), and timed once behind a
~0.1 s GPU kernel queued on torch's stream: a stage that takes ~0.1 s there waits for the GPU
(a host sync), which a stream-ordered hand-off must never do.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fx2xla  # noqa: F401  (registers the backend)
from fx2xla.metrics import live_graphs
from fx2xla.runtime import handoff


def median_us(fn, n=300):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def behind_long_kernel_ms(fn):
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    t0 = time.perf_counter()
    fn()
    dt = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return dt


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    x = torch.zeros(1024, device="cuda")
    compiled = torch.compile(lambda x: x + 1, backend="fx2xla")
    compiled(x)
    torch.cuda.synchronize()
    graph = [g for g in live_graphs][-1]
    spec = graph.static
    dev = graph.executor.jax_device
    imp = handoff.make_importer(platform="cuda")
    order = handoff.make_stream_order(platform="cuda")
    export = handoff.make_exporter(platform="cuda")
    public_export = handoff.make_exporter(True, platform="cuda")
    buf = imp(x, dev)
    arr = spec.exe.execute([buf])[0]
    stages = {
        "order": lambda: order(dev, 0),
        "import": lambda: imp(x, dev),
        "import_public": lambda: handoff.make_importer(True, platform="cuda")(x, dev),
        "execute_sharded": lambda: spec.exe.execute_sharded([buf]),
        "execute_public": lambda: spec.exe.execute([buf]),
        "launch(export)": lambda: spec.launch([buf]),
        "export_private": lambda: export(arr),
        "export_public": lambda: public_export(arr),
        "call": lambda: compiled(x),
        "torch_x+1": lambda: x + 1,
    }
    res = {}
    for name, fn in stages.items():
        try:
            res[name] = {"median_us": round(median_us(fn), 2), "behind_long_kernel_ms": round(behind_long_kernel_ms(fn), 3)}
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"{name:18s} {res[name]}", flush=True)
    res["queue_depth"] = queue_depth(graph, spec, dev, imp, order, export, x)
    res["train_step"] = train_step_stages()
    if a.out:
        json.dump(res, open(a.out, "w"), indent=1)


def queue_depth(graph, spec, dev, imp, order, export, x, calls=30):
    """Host ms of each of `calls` calls queued behind a ~0.3 s kernel, per variant of the path:
    a call that takes ~0.3 s waited for the GPU. Variants: execute + export with the input
    imported unordered (no torch event), the same ordered after torch's stream (the hand-off's
    way), the ordered import executed without an export, and the whole graph call."""
    def unordered():
        return export(spec.exe.execute_sharded([imp(x, dev)]).consume_with_handlers([lambda s: s[0]])[0])

    def ordered_export():
        order(dev, 0)
        return export(spec.exe.execute_sharded([imp(x, dev)]).consume_with_handlers([lambda s: s[0]])[0])

    def ordered_no_export():
        order(dev, 0)
        return spec.exe.execute_sharded([imp(x, dev)]).consume_with_handlers([lambda s: s[0]])

    return {name: queued_host_ms(name, fn, calls)
            for name, fn in (("unordered_execute_export", unordered), ("ordered_execute_export", ordered_export),
                             ("ordered_execute_no_export", ordered_no_export),
                             ("graph_call", lambda: graph.executor.run(spec, [x])))}


def queued_host_ms(name, fn, calls=30):
    """Host ms of each of `calls` calls of `fn` queued behind a ~0.3 s kernel (results kept);
    an error ends the list with its message."""
    torch.cuda.synchronize()
    torch.cuda._sleep(600_000_000)
    keep, times = [], []
    try:
        for _ in range(calls):
            t0 = time.perf_counter()
            keep.append(fn())
            times.append(round((time.perf_counter() - t0) * 1e3, 2))
    except Exception as e:  # noqa: BLE001
        times.append(f"{type(e).__name__}: {e}"[:300])
    torch.cuda.synchronize()
    print(name, times, flush=True)
    return times


def train_step_stages():
    """The parts of a bf16 GPT-2 training step (6 layers, batch 8 x 512) timed alone, median of
    10 synced, and each once behind a ~0.1 s kernel: forward, backward, the compiled foreach
    AdamW step (CPU step counters, torch's default), zero_grad."""
    import copy

    import transformers

    config = transformers.GPT2Config(n_layer=6, n_embd=768, n_head=12, vocab_size=32000, n_positions=512,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config).to("cuda", torch.bfloat16).train()
    ids = torch.randint(0, 32000, (8, 512), device="cuda")
    out = {}
    for backend in ("inductor", "fx2xla"):
        model = copy.deepcopy(base)
        fwd = torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        opt_step = torch.compile(opt.step, backend=backend)
        loss = None

        def forward():
            nonlocal loss
            loss = fwd(ids).logits.float().logsumexp(-1).mean()

        parts = {"forward": forward, "backward": lambda: loss.backward(), "opt_step": lambda: opt_step(),
                 "zero_grad": lambda: opt.zero_grad(set_to_none=True)}
        for _ in range(4):  # warm: compiles (the step recompiles on step 2)
            for fn in parts.values():
                fn()
        torch.cuda.synchronize()
        times = {k: [] for k in parts}
        for r in range(11):
            for k, fn in parts.items():
                if r == 10:  # behind a long kernel: a part that takes ~0.1 s waits for the GPU
                    times[k + "_behind_long_kernel_ms"] = round(behind_long_kernel_ms(fn), 3)
                    continue
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        out[backend] = {k: (round(statistics.median(v) * 1e3, 3) if isinstance(v, list) else v)
                        for k, v in times.items()}
        print(backend, out[backend], flush=True)
    return out


if __name__ == "__main__":
    main()
