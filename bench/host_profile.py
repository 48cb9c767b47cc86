"""Where a training step's host time goes: a small GPT-2 whose kernels take almost nothing, so a
step is mostly host work (what a GPU step's host overhead is made of), timed and then profiled
with cProfile.

    .venv/bin/python bench/host_profile.py [--backend fx2xla] [--layers 6] [--steps 20] [--top 25]
    PJRT_DEVICE=CUDA python3 bench/host_profile.py --device cuda

One step = forward + logsumexp loss + backward + compiled AdamW(foreach=True) step + zero_grad.
Prints the median step time (30 steps after 4 warm ones), the number of executable results
handed back per step, and cProfile's functions by own time over `--steps` steps.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from fx2xla.testing import LogitsOnly, gpt2, token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="fx2xla")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=a.layers, hidden=a.hidden, heads=4, vocab=1000, positions=64)).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    model = model.to(a.device)
    ids = token_ids(2, 16).to(a.device)
    fwd = torch.compile(model, backend=a.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    opt_step = torch.compile(opt.step, backend=a.backend)
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)

    def step():
        loss = fwd(ids).float().logsumexp(-1).mean()
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    sync()
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    print(f"{a.backend} on {a.device}: median step {statistics.median(times) * 1e3:.2f} ms")
    if a.backend == "fx2xla":
        from fx2xla.metrics import live_graphs

        results = sum(len(g.plan.results) for g in live_graphs)
        print(f"executable results handed back per step: {results} "
              f"(written inputs: {sum(len(g.plan.mutations) for g in live_graphs)})")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(a.steps):
        step()
    sync()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(a.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
