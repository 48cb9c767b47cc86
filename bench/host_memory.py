"""glibc's malloc thresholds (runtime/host_memory.py), on and off, in alternating processes.

    .venv/bin/python bench/host_memory.py [--models cnn,llama,mlp_train] [--pairs 2] [--rounds 9] [--no-pad]

The setting is process-wide and is made once, so each measurement is a process of its own:
for every model, `--pairs` pairs of child processes, one with fx2xla's setting and one with
FX2XLA_MALLOC_TUNING=0 (glibc's own thresholds), run one after the other; with `--no-pad`, a
third (`no_pad`) with fx2xla's two thresholds given in the environment (which fx2xla then
leaves to the user) and no top pad, which tells the pad's part. Each child times
eager, Inductor and fx2xla called back to back (`back_to_back_medians`) and then counts, per
call, the minor page faults and the system CPU time of a loop of calls of each. Inference
models run under `torch.no_grad()`; `linear` is one nn.Linear with a 4 MiB result (1024 x 256
-> 1024); `mlp_train` is bench/train.py's MLP training step
(forward, loss, backward, AdamW). Writes bench/results/host_memory.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = ("linear", "cnn", "llama", "gpt2", "mlp_train")


def _contenders(name: str):
    """{contender: fn} and the args for one model; the compiled ones warmed up."""
    import torch
    import fx2xla  # noqa: F401  (registers the backend)
    from fx2xla.testing import model_cases
    torch.manual_seed(0)
    if name == "mlp_train":
        from train import CASES, make_step
        fns = {}
        for label, backend in (("eager", None), ("inductor", "inductor"), ("fx2xla", "fx2xla")):
            torch.manual_seed(0)
            model, x, y = CASES["mlp"][1]()
            model.train()
            fns[label] = make_step(model, backend, x, y)[0]
        return fns, ()
    if name == "linear":  # one nn.Linear, 1024 x 256 -> 1024: a 4 MiB result per call
        model, args = torch.nn.Linear(256, 1024).eval(), (torch.randn(1024, 256),)
    else:
        case = next(c for c in model_cases() if c.name == name)
        model, args = case.build().eval(), case.make_inputs()
    return {"eager": model, "inductor": torch.compile(model), "fx2xla": torch.compile(model, backend="fx2xla")}, args


def child(name: str, rounds: int) -> dict:
    import torch
    from harness import back_to_back_medians
    from fx2xla.runtime import host_memory
    with torch.no_grad() if name != "mlp_train" else torch.enable_grad():
        fns, args = _contenders(name)
        diff = None
        if name != "mlp_train":  # the compiled results against eager's, on the same inputs
            ref, got = fns["eager"](*args), fns["fx2xla"](*args)
            diff = (got.float() - ref.float()).abs().max().item()
        for fn in fns.values():  # compiles, then lets the heaps grow to their steady size
            start = time.perf_counter()
            for n in range(500):
                fn(*args)
                if n >= 30 and time.perf_counter() - start > 2.0:
                    break
        medians = back_to_back_medians(fns, args, rounds=rounds, calls=5)
        counts = {}
        for label, fn in fns.items():
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            n = 0
            while n < 20 or time.perf_counter() - start < 1.0:
                fn(*args)
                n += 1
            after = resource.getrusage(resource.RUSAGE_SELF)
            counts[label] = {"faults_per_call": (after.ru_minflt - before.ru_minflt) / n,
                             "system_ms_per_call": (after.ru_stime - before.ru_stime) / n * 1e3}
    return {"medians_ms": {k: v * 1e3 for k, v in medians.items()}, "counts": counts,
            "host_malloc": host_memory.status(), "fx2xla_max_abs_diff_vs_eager": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="cnn,llama,mlp_train")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "host_memory.json"))
    p.add_argument("--no-pad", action="store_true",
                   help="also run processes with fx2xla's thresholds but no top pad (setting no_pad)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.rounds)))
        return
    models = [m for m in a.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"unknown models {unknown}; choose from {list(MODELS)}")
    base_env = {k: v for k, v in os.environ.items() if k != "FX2XLA_MALLOC_TUNING"}
    settings = {"set": base_env, "glibc": {**base_env, "FX2XLA_MALLOC_TUNING": "0"}}
    if a.no_pad:
        from fx2xla.runtime import host_memory
        settings["no_pad"] = {**base_env, "MALLOC_MMAP_THRESHOLD_": str(host_memory.MMAP_THRESHOLD),
                              "MALLOC_TRIM_THRESHOLD_": str(host_memory.TRIM_THRESHOLD)}
    results: dict = {"command": " ".join([Path(sys.executable).name] + sys.argv), "models": {}}
    for name in models:
        runs: dict = {s: [] for s in settings}
        for pair in range(a.pairs):
            for setting, env in settings.items():
                out = subprocess.run([sys.executable, __file__, "--child", name, "--rounds", str(a.rounds)],
                                     env=env, capture_output=True, text=True, timeout=1800)
                if out.returncode != 0:
                    raise SystemExit(f"{name} ({setting}) failed:\n{out.stderr[-3000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                runs[setting].append(r)
                m, c = r["medians_ms"], r["counts"]
                print(f"{name:10s} {setting:6s} pair {pair}: fx2xla {m['fx2xla']:.2f} ms, inductor "
                      f"{m['inductor']:.2f}, eager {m['eager']:.2f}; fx2xla / inductor "
                      f"{m['fx2xla'] / m['inductor']:.3f}, / eager {m['fx2xla'] / m['eager']:.3f}; faults per call "
                      + ", ".join(f"{k} {v['faults_per_call']:.0f}" for k, v in c.items())
                      + "; system ms per call "
                      + ", ".join(f"{k} {v['system_ms_per_call']:.2f}" for k, v in c.items()), flush=True)
        # Per setting, the median over its processes of each child's figure.
        figures = {
            "fx2xla_over_inductor": lambda r: r["medians_ms"]["fx2xla"] / r["medians_ms"]["inductor"],
            "fx2xla_over_eager": lambda r: r["medians_ms"]["fx2xla"] / r["medians_ms"]["eager"],
            "fx2xla_faults_per_call": lambda r: r["counts"]["fx2xla"]["faults_per_call"],
            "fx2xla_system_ms_per_call": lambda r: r["counts"]["fx2xla"]["system_ms_per_call"],
        }
        summary = {setting: {k: statistics.median(map(f, rs)) for k, f in figures.items()}
                   for setting, rs in runs.items()}
        results["models"][name] = {"runs": runs, "summary": summary}
        order = list(summary)  # set, glibc[, no_pad]
        per = lambda key, spec: " / ".join(format(summary[k][key], spec) for k in order)  # noqa: E731
        print(f"{name:10s} medians over pairs, {' / '.join(order)}: fx2xla / inductor "
              f"{per('fx2xla_over_inductor', '.3f')}, fx2xla / eager {per('fx2xla_over_eager', '.3f')}, fx2xla faults "
              f"per call {per('fx2xla_faults_per_call', '.0f')}, system ms per call "
              f"{per('fx2xla_system_ms_per_call', '.2f')}", flush=True)
    from harness import write_json
    write_json(a.out, results)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
