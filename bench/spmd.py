"""SPMD plans on 8 virtual CPU devices: memory per device, collective bytes, step time, compile.

    .venv/bin/python bench/spmd.py [--models mlp,gpt2] [--rounds 10]

Per model, each plan trains its own copy (same seed, same batch) with `torch.compile(...,
backend="fx2xla")` for the model and for `AdamW(foreach=True).step`:
  one_device  nothing marked: every graph on the first device
  dp          the batch split over 8 devices ("data"), parameters replicated
  fsdp        parameters, gradients, AdamW moments and the batch split over 8 ("fsdp")
  tp          Megatron tensor parallel over 8 ("model"): MLP up-projections by rows, down by
              columns (GPT-2: attention's fused qkv by columns, its output projection by rows)
  dp_x_tp     a 2 x 4 mesh: the batch over "data", Megatron over "model"
For each: every graph's per-device bytes from XLA's memory_analysis (arguments, outputs,
temporaries) summed over forward, backward and optimizer step; the collectives XLA's
partitioner inserted, and their bytes per device, from the optimized HLO; the first step
(compiles, cold disk cache); and the median step time over interleaved rounds. The 8 devices
share this machine's cores, so step times compare communication and bookkeeping, not scaling.
The first steps' losses are checked against eager. Raw numbers: bench/results/spmd.json.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

os.environ["FX2XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="fx2xla-cold-")  # cold first steps

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from harness import fmt_time, interleaved_medians, write_json  # noqa: E402
from train import make_step  # noqa: E402

import fx2xla  # noqa: E402
from fx2xla.metrics import live_graphs  # noqa: E402
from fx2xla.runtime.executor import optimized_hlo_text  # noqa: E402
from fx2xla.sharding import collectives  # noqa: E402
from fx2xla.testing import LogitsOnly, gpt2, token_ids  # noqa: E402

PLANS = ("one_device", "dp", "fsdp", "tp", "dp_x_tp")


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))


def mlp_case():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
    tp = {"0.weight": ("model", None), "0.bias": ("model",), "2.weight": (None, "model")}
    return _mlp, x, y, tp, lambda out, y: F.mse_loss(out, y)


def gpt2_case():
    ids = token_ids(8, 64)
    # transformers' GPT-2 Conv1D keeps weights as [in, out]: column-parallel is dim 1.
    tp = {"*.attn.c_attn.weight": (None, "model"), "*.attn.c_attn.bias": ("model",),
          "*.attn.c_proj.weight": ("model", None), "*.mlp.c_fc.weight": (None, "model"),
          "*.mlp.c_fc.bias": ("model",), "*.mlp.c_proj.weight": ("model", None)}

    def build():
        model = LogitsOnly(gpt2(layers=2, hidden=256))
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        return model

    def loss(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    return build, ids, ids.roll(-1, dims=1), tp, loss


CASES = {"mlp": ("MLP 256-1024-256, batch 64", mlp_case),
         "gpt2": ("GPT-2 2 layers, hidden 256, batch 8 x 64, no dropout", gpt2_case)}


def apply_plan(plan: str, model, x, tp_specs):
    if plan == "one_device":
        return None
    if plan in ("dp", "fsdp"):
        axis = "data" if plan == "dp" else "fsdp"
        mesh = fx2xla.Mesh((8,), (axis,))
        if plan == "fsdp":
            fx2xla.fsdp(model, mesh, axis="fsdp")
        fx2xla.mark_sharding(x, mesh, (axis,) + (None,) * (x.dim() - 1))
        return mesh
    mesh = fx2xla.Mesh((8,), ("model",)) if plan == "tp" else fx2xla.Mesh((2, 4), ("data", "model"))
    fx2xla.shard_module(model, mesh, tp_specs)
    if plan == "dp_x_tp":
        fx2xla.mark_sharding(x, mesh, ("data",) + (None,) * (x.dim() - 1))
    return mesh


def graph_figures(graphs) -> dict:
    mem = {"arguments": 0, "outputs": 0, "temporaries": 0}
    coll: dict = {}
    for g in graphs:
        if g.static is None:
            continue
        stats = g.static.exe.get_compiled_memory_stats()
        mem["arguments"] += stats.argument_size_in_bytes
        mem["outputs"] += stats.output_size_in_bytes
        mem["temporaries"] += stats.temp_size_in_bytes
        for c in collectives(optimized_hlo_text(g.static.exe)):
            n, b = coll.get(c.op, (0, 0))
            coll[c.op] = (n + 1, b + c.bytes)
    return {"memory_per_device": mem, "collectives": {k: {"count": n, "bytes": b} for k, (n, b) in coll.items()},
            "collective_bytes": sum(b for _, b in coll.values())}


def bench_case(name: str, rounds: int) -> dict:
    build, x0, y, tp_specs, loss_fn = CASES[name][1]()
    torch.manual_seed(0)
    base = build()
    eager = copy.deepcopy(base)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-3, foreach=True)
    eager_loss = loss_fn(eager(x0), y)
    eager_loss.backward()
    opt.step()
    res: dict = {"description": CASES[name][0], "parameters": sum(p.numel() for p in base.parameters()),
                 "eager_first_loss": float(eager_loss), "plans": {}}
    steps = {}
    for plan in PLANS:
        torch._dynamo.reset()
        model, x = copy.deepcopy(base), x0.clone()
        try:
            mesh = apply_plan(plan, model, x, tp_specs)
            before = {id(g) for g in live_graphs}
            step, _ = make_step(model, "fx2xla", x, y, foreach=True, loss=loss_fn, lr=1e-3)
            t0 = time.perf_counter()
            loss = float(step())
            first = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001  report and go on: one plan must not hide the rest
            print(f"{name}/{plan}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            res["plans"][plan] = {"error": f"{type(e).__name__}: {e}"}
            continue
        graphs = [g for g in live_graphs if id(g) not in before]
        r = {"mesh": repr(mesh) if mesh else None, "first_step_s": first, "first_loss": loss,
             "first_loss_abs_diff_vs_eager": abs(loss - res["eager_first_loss"]), "graphs": len(graphs),
             **graph_figures(graphs)}
        res["plans"][plan] = r
        steps[plan] = step
        print(f"{name}/{plan}: first step {first:.2f} s, |dloss| {r['first_loss_abs_diff_vs_eager']:.1e}", flush=True)
    med = interleaved_medians(steps, (), rounds=rounds, budget_s=120)
    for plan, s in med.items():
        res["plans"][plan]["step_s"] = s
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,gpt2", help=f"comma list of {','.join(CASES)}")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "spmd.json"))
    a = p.parse_args()
    results: dict = {"torch": torch.__version__, "jax": jax.__version__, "devices": len(jax.devices("cpu")),
                     "models": {}}
    for name in a.models.split(","):
        results["models"][name] = r = bench_case(name, a.rounds)
        print(f"\n{name}: {r['description']}, {r['parameters']:,} parameters")
        print(f"  {'plan':11s} {'args/dev':>10s} {'temps/dev':>10s} {'collectives (per device)':44s} "
              f"{'coll bytes':>11s} {'1st step':>9s} {'step':>11s} {'÷ 1 dev':>8s}")
        one = r["plans"].get("one_device", {}).get("step_s")
        for plan, f in r["plans"].items():
            if "error" in f:
                print(f"  {plan:11s} FAILED")
                continue
            coll = ", ".join(f"{k} x{v['count']}" for k, v in f["collectives"].items()) or "none"
            ratio = f"{f['step_s'] / one:8.2f}" if one and "step_s" in f else "       -"
            print(f"  {plan:11s} {f['memory_per_device']['arguments'] / 1024:8.0f}Ki "
                  f"{f['memory_per_device']['temporaries'] / 1024:8.0f}Ki {coll:44s} "
                  f"{f['collective_bytes'] / 1024:9.1f}Ki {f['first_step_s']:8.2f}s {fmt_time(f.get('step_s', 0))} {ratio}")
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
