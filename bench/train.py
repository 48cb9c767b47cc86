"""Training step time of eager, Inductor and fx2xla, measured in one run.

    .venv/bin/python bench/train.py [--models mlp,cnn,gpt2,gpt2_nodropout] [--rounds 15] [--phases]

One step = forward + loss + backward + AdamW step + zero_grad. Each contender trains its own
copy of the model (same seed, same batch): eager; Inductor (`torch.compile` default backend
for the model and for `opt.step`); fx2xla (the same with backend="fx2xla"). Steps are
interleaved in rounds; the table shows median step times and ratios (fx2xla ÷ eager,
fx2xla ÷ Inductor) and each compiler's first step (compiles forward, backward and optimizer
step; Inductor with a fresh, cold TORCHINDUCTOR_CACHE_DIR, fx2xla with a cold disk cache),
for the CNN also fx2xla with options={"torch_kernels": False} (XLA's own convolutions: the
column `tk` is fx2xla ÷ that) and the same fx2xla step with torch's kernels on whole batches
(fx2xla.torch_kernels.batch_slicing(False); the column `sl` is fx2xla ÷ that) and with
options={"channels_last": False} (batch norm, ReLU and pooling on NCHW values: `cl` is fx2xla ÷
that), for every model fx2xla with XLA's own matmuls, not torch's gemm (options={"torch_kernels": every
kind but "matmul"}: the column `mm` is fx2xla ÷ that), with float32 matmuls of 4-64 rows against
nn.Linear's weight computed as x . W^T instead of (W . x^T)^T (options={"linear_weight_lhs": False}:
the column `wl`), and with the optimizer's updates in XLA's
loops, not in one compiled loop per parameter (every kind but "elementwise": the column `ew`), and
the same fx2xla step with the main thread serving torch's kernels (fx2xla.torch_kernels.
serving(True), opt-in: the handlers' work whole on torch's team; the column `sv` is that ÷ fx2xla)
and with each executable choosing from its first main-thread calls whether to serve
(serving("auto"); its trials run before the timed rounds; `au` is that ÷ fx2xla, with how many
executables chose serving),
|dloss1| = |fx2xla - eager| first-step loss (rounding only without dropout; with dropout the
random bits differ), and the 1-minute load average after timing (above the core count, other
processes are skewing the figures). With `--phases`, eager, Inductor and fx2xla also run steps
timed phase by phase (forward, loss, backward, optimizer step, zero_grad: fresh copies, rounds
interleaved), with the minor page faults of the process during each backward: medians per phase;
and how many parts fx2xla's handlers split their work into in those steps, and how many of those
another thread ran (`torch_kernels.split_parts`).
Eager, Inductor, fx2xla and fx2xla without the weight on the left (`wl`) are also timed back to
back, as a training loop runs them (harness.back_to_back_medians: in each round one untimed
step each, then five in a row, timed). There the parameters, gradients and moments stay in the
caches from the step before, where each single interleaved step finds eight to eleven other contenders'.
Raw numbers go to bench/results/train.json.
"""
from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import sys
import tempfile
import time

if __name__ == "__main__":
    # Cold compiler caches for honest first-step figures; set before torch is imported. (Only
    # when run as a script: benches importing `make_step` keep their own cache settings.)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
    os.environ["FX2XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="fx2xla-cold-")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from harness import (back_to_back_medians, fmt_time, interleaved_medians, served, timed_call, unsliced,  # noqa: E402
                     write_json)

import fx2xla  # noqa: E402
from fx2xla.plan_executor import SERVE_TRIAL_ROUNDS  # noqa: E402
from fx2xla.testing import LogitsOnly, SmallCNN, gpt2, mlp, token_ids  # noqa: E402


def _mlp_case():
    model = mlp()  # 1024 -> 4096 -> 1024
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1024, generator=g), torch.randint(0, 1024, (32,), generator=g)
    return model, x, y


def _gpt2_case(dropout: bool):
    model = LogitsOnly(gpt2(layers=4, hidden=256))  # GPT-2's default dropout: 0.1
    if not dropout:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    ids = token_ids(4, 128)
    return model, ids, ids.roll(-1, dims=1)


def _cnn_case():
    model = SmallCNN()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 64, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    return model, x, y


CASES = {
    "mlp": ("MLP 1024-4096-1024, batch 32", _mlp_case),
    "cnn": ("SmallCNN (3 conv + batch norm blocks), batch 32 x 3 x 64 x 64", _cnn_case),
    "gpt2": ("GPT-2 4 layers, hidden 256, batch 4 x seq 128, dropout 0.1", lambda: _gpt2_case(True)),
    "gpt2_nodropout": ("the same GPT-2 with dropout 0", lambda: _gpt2_case(False)),
}


def loss_fn(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def _compiled_parts(model, backend: str | None, foreach: bool | None, lr: float, options: dict | None = None,
                    optimizer_options: dict | None = None):
    """(AdamW over the model's parameters, the forward, the optimizer step): both compiled with
    `backend` (and its options), or eager's own where backend is None."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=foreach)
    if backend is None:
        return opt, model, opt.step
    return (opt, torch.compile(model, backend=backend, options=options),
            torch.compile(opt.step, backend=backend, options=optimizer_options))


def make_step(model, backend: str | None, x, y, foreach: bool | None = None, loss=loss_fn, lr: float = 1e-4,
              options: dict | None = None, optimizer_options: dict | None = None):
    """A training step closure for one contender (backend None: eager). foreach None is
    torch's default, which on CPU is the single-tensor AdamW. `options`: the backend's, for the
    model; `optimizer_options`: for the optimizer step."""
    opt, forward, opt_step = _compiled_parts(model, backend, foreach, lr, options, optimizer_options)

    def step():
        value = loss(forward(x), y)
        value.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)
        return value.detach()

    return step, opt


PHASES = ("forward", "loss", "backward", "optimizer", "zero_grad")


def make_phased_step(model, backend: str | None, x, y, foreach: bool | None = None, loss=loss_fn, lr: float = 1e-4):
    """make_step's step, timed phase by phase: `step(times)` appends each phase's seconds, and
    the process's minor page faults during the backward, to the lists in `times`."""
    opt, forward, opt_step = _compiled_parts(model, backend, foreach, lr)
    clock = time.perf_counter

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    def step(times: dict):
        t0 = clock()
        out = forward(x)
        t1 = clock()
        value = loss(out, y)
        t2 = clock()
        f2 = faults()
        value.backward()
        f3 = faults()
        t3 = clock()
        opt_step()
        t4 = clock()
        opt.zero_grad(set_to_none=True)
        t5 = clock()
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            times.setdefault(phase, []).append(seconds)
        times.setdefault("backward_faults", []).append(f3 - f2)

    return step


# Contenders also timed back to back (harness.back_to_back_medians), and steps per timed run.
BACK_TO_BACK = ("eager", "inductor", "fx2xla", "fx2xla_weight_rhs")
BACK_TO_BACK_STEPS = 5


def phase_medians(model, x, y, foreach: bool | None, rounds: int, steps_per_round: int = 5) -> dict:
    """Per contender (eager, Inductor, fx2xla), the median of each phase's seconds and of the
    backward's page faults, over `rounds` interleaved rounds of `steps_per_round` steps (each
    contender's order rotated per round), after three untimed steps each."""
    names = ("eager", "inductor", "fx2xla")
    steps = {}
    for name, backend in zip(names, (None, "inductor", "fx2xla")):
        torch.manual_seed(1)
        steps[name] = make_phased_step(copy.deepcopy(model), backend, x, y, foreach)
        for _ in range(3):
            steps[name]({})
    times: dict = {name: {} for name in names}
    parts = {"parts": 0, "elsewhere": 0}  # fx2xla's splits: parts, and those another thread ran
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:
            before = fx2xla.torch_kernels.split_parts()
            for _ in range(steps_per_round):
                steps[name](times[name])
            if name == "fx2xla":
                after = fx2xla.torch_kernels.split_parts()
                for k in parts:
                    parts[k] += after[k] - before[k]
    res = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    res["fx2xla_split_parts"] = parts
    return res


def bench_case(name: str, rounds: int, foreach: bool | None = None, phases: bool = False) -> dict:
    torch.manual_seed(0)
    model, x, y = CASES[name][1]()
    model.train()
    torch._dynamo.reset()
    # Each contender compiles the step of an optimizer of its own, and Dynamo guards `opt.step` on
    # the optimizer object: one cache entry per contender. Past Dynamo's default limit (8), the
    # CNN's last contenders (those of --phases) ran their optimizer eagerly.
    torch._dynamo.config.recompile_limit = 64
    steps = {}
    res: dict = {"description": CASES[name][0],
                 "parameters": sum(p.numel() for p in model.parameters()),
                 "foreach": None}
    # A contender that differs from "fx2xla" only by an environment variable passes options all
    # the same (the default "fallback"): with none, Dynamo would find the graphs "fx2xla" compiled
    # for the model's class, guarded on the parameters' shapes only, and time those again.
    contenders = [("eager", None, None, {}), ("inductor", "inductor", None, {}), ("fx2xla", "fx2xla", None, {}),
                  # written inputs (parameters, moments) in fresh buffers each step, not in place
                  ("fx2xla_not_in_place", "fx2xla", {"fallback": "eager"}, {"FX2XLA_INPLACE": "0"})]
    # matmuls in XLA's dots, not torch's gemm (every other kernel kind kept)
    contenders.append(("fx2xla_xla_matmuls", "fx2xla",
                       {"torch_kernels": [k for k in fx2xla.torch_kernels.KINDS if k != "matmul"]}, {}))
    # matmuls of 4-64 rows as x . W^T (torch's gemm or XLA's dot), not with the weight on the left
    contenders.append(("fx2xla_weight_rhs", "fx2xla", {"linear_weight_lhs": False}, {}))
    # elementwise regions (the optimizer's updates) in XLA's loops, one per result
    contenders.append(("fx2xla_xla_loops", "fx2xla",
                       {"torch_kernels": [k for k in fx2xla.torch_kernels.KINDS if k != "elementwise"]}, {}))
    if name == "cnn":
        contenders.append(("fx2xla_xla_kernels", "fx2xla", {"torch_kernels": False}, {}))
        # batch norm, ReLU and pooling on NCHW values, transposed around each convolution
        contenders.append(("fx2xla_not_channels_last", "fx2xla", {"channels_last": False}, {}))
    for contender, backend, options, env in contenders:
        torch.manual_seed(1)  # the same dropout seed for each first step (bits differ per compiler)
        steps[contender], opt = make_step(copy.deepcopy(model), backend, x, y, foreach, options=options,
                                          optimizer_options=options)
        first = {}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # read when the first step plans its graphs
        try:
            res[f"{contender}_first_step_s"] = timed_call(lambda: first.setdefault("loss", steps[contender]()), ())
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        res[f"{contender}_first_loss"] = float(first["loss"])
        res["foreach"] = opt.defaults.get("foreach")
    before = fx2xla.metrics()
    res["load_average_1min_before"] = os.getloadavg()[0]  # other processes skew every contender
    # the same fx2xla step with the main thread serving the handlers' work on torch's team
    steps["fx2xla_served"] = served(steps["fx2xla"])
    # the same step with each executable's serving chosen by its first main-thread calls
    steps["fx2xla_auto"] = served(steps["fx2xla"], "auto")
    trial = fx2xla.metrics()
    for _ in range(2 * (SERVE_TRIAL_ROUNDS + 1)):  # the trials end before the timed rounds
        steps["fx2xla_auto"]()
    chose = fx2xla.metrics()
    res["serving_chosen"] = chose["serving_chosen"] - trial["serving_chosen"]
    res["serving_declined"] = chose["serving_declined"] - trial["serving_declined"]
    if name == "cnn":  # the same fx2xla step with torch's kernels on whole batches
        steps["fx2xla_unsliced"] = unsliced(steps["fx2xla"])
    med = interleaved_medians(steps, (), rounds=rounds, budget_s=120)
    # A training loop runs one model's steps back to back, its parameters, gradients and moments
    # still in the caches from the step before; a single step after eight to eleven other contenders' finds
    # them in memory.
    b2b = back_to_back_medians({k: steps[k] for k in BACK_TO_BACK}, (), rounds=rounds, calls=BACK_TO_BACK_STEPS,
                               budget_s=120)
    res["load_average_1min_after"] = os.getloadavg()[0]
    after = fx2xla.metrics()
    res.update({f"{k}_s": v for k, v in med.items()})
    res["fx2xla_vs_eager"] = med["fx2xla"] / med["eager"]
    res["fx2xla_vs_inductor"] = med["fx2xla"] / med["inductor"]
    res["inductor_vs_eager"] = med["inductor"] / med["eager"]
    res["first_step_vs_inductor"] = res["fx2xla_first_step_s"] / res["inductor_first_step_s"]
    res["first_loss_abs_diff_vs_eager"] = abs(res["fx2xla_first_loss"] - res["eager_first_loss"])
    res["in_place_ratio"] = med["fx2xla"] / med["fx2xla_not_in_place"]
    res["torch_matmuls_ratio"] = med["fx2xla"] / med["fx2xla_xla_matmuls"]
    res["region_loops_ratio"] = med["fx2xla"] / med["fx2xla_xla_loops"]
    res["weight_lhs_ratio"] = med["fx2xla"] / med["fx2xla_weight_rhs"]
    res.update({f"{k}_back_to_back_s": v for k, v in b2b.items()})
    res["back_to_back_fx2xla_vs_eager"] = b2b["fx2xla"] / b2b["eager"]
    res["back_to_back_fx2xla_vs_inductor"] = b2b["fx2xla"] / b2b["inductor"]
    res["back_to_back_weight_lhs_ratio"] = b2b["fx2xla"] / b2b["fx2xla_weight_rhs"]
    res["serving_ratio"] = med["fx2xla_served"] / med["fx2xla"]
    res["serving_auto_ratio"] = med["fx2xla_auto"] / med["fx2xla"]
    res["fx2xla_auto_vs_inductor"] = med["fx2xla_auto"] / med["inductor"]
    if "fx2xla_xla_kernels" in med:
        res["torch_kernels_ratio"] = med["fx2xla"] / med["fx2xla_xla_kernels"]
    if "fx2xla_unsliced" in med:
        res["batch_slicing_ratio"] = med["fx2xla"] / med["fx2xla_unsliced"]
    if "fx2xla_not_channels_last" in med:
        res["channels_last_ratio"] = med["fx2xla"] / med["fx2xla_not_channels_last"]
    # Steady state must not recompile or fall back to eager: report it if it does.
    res["fx2xla_graphs_compiled_while_timing"] = after["graphs"] - before["graphs"]
    res["fx2xla_fallback_ops"] = after["fallback_ops"]
    if phases:
        res["phases"] = phase_medians(model, x, y, foreach, rounds)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,gpt2,gpt2_nodropout", help=f"comma list of {','.join(CASES)}")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--foreach", action="store_true", help="AdamW(foreach=True) (CPU default: single-tensor)")
    p.add_argument("--phases", action="store_true",
                   help="also time eager, Inductor and fx2xla steps phase by phase (forward, loss, backward, ...)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "train.json"))
    a = p.parse_args()
    results: dict = {"torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                     "step": "forward + cross-entropy + backward + AdamW step + zero_grad", "models": {}}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cold caches: "
          f"Inductor {os.environ['TORCHINDUCTOR_CACHE_DIR']}, fx2xla {os.environ['FX2XLA_CACHE_DIR']}")
    print(f"\nmedian step time ({results['step']}), {a.rounds} interleaved rounds")
    print(f"{'model':15s} {'eager':>11s} {'inductor':>11s} {'fx2xla':>11s} {'fx/eager':>9s} {'fx/ind':>7s} "
          f"{'ind/eager':>9s} {'1st eager':>11s} {'1st ind':>11s} {'1st fx2xla':>11s} {'|dloss1|':>9s} {'load':>5s}")
    for name in a.models.split(","):
        try:
            r = bench_case(name, a.rounds, True if a.foreach else None, phases=a.phases)
        except Exception as e:  # report and go on: one failing model must not hide the rest
            print(f"{name:15s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
            results["models"][name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        results["models"][name] = r
        print(f"{name:15s} {fmt_time(r['eager_s'])} {fmt_time(r['inductor_s'])} {fmt_time(r['fx2xla_s'])} "
              f"{r['fx2xla_vs_eager']:9.2f} {r['fx2xla_vs_inductor']:7.2f} {r['inductor_vs_eager']:9.2f} "
              f"{fmt_time(r['eager_first_step_s'])} {fmt_time(r['inductor_first_step_s'])} "
              f"{fmt_time(r['fx2xla_first_step_s'])} {r['first_loss_abs_diff_vs_eager']:9.2e} "
              f"{r['load_average_1min_after']:5.1f}")
        print(f"{'':15s} back to back (a training loop's steps, {BACK_TO_BACK_STEPS} in a row): eager "
              f"{fmt_time(r['eager_back_to_back_s'])}, Inductor {fmt_time(r['inductor_back_to_back_s'])}, fx2xla "
              f"{fmt_time(r['fx2xla_back_to_back_s'])}: fx2xla ÷ eager {r['back_to_back_fx2xla_vs_eager']:.2f}, "
              f"÷ Inductor {r['back_to_back_fx2xla_vs_inductor']:.2f}; wl {r['back_to_back_weight_lhs_ratio']:.2f}")
        print(f"{'':15s} ip (fx2xla ÷ fx2xla writing parameters and moments to new buffers): {r['in_place_ratio']:.2f}")
        print(f"{'':15s} mm (fx2xla ÷ fx2xla with XLA's own matmuls): {r['torch_matmuls_ratio']:.2f}")
        print(f"{'':15s} ew (fx2xla ÷ fx2xla with the optimizer's updates in XLA's loops): "
              f"{r['region_loops_ratio']:.2f}")
        print(f"{'':15s} wl (fx2xla ÷ fx2xla computing matmuls of 4-64 rows as x . W^T): "
              f"{r['weight_lhs_ratio']:.2f}")
        print(f"{'':15s} sv (fx2xla serving torch's kernels from the main thread ÷ fx2xla): "
              f"{r['serving_ratio']:.2f}")
        print(f"{'':15s} au (fx2xla choosing per executable whether to serve ÷ fx2xla): "
              f"{r['serving_auto_ratio']:.2f} ({r['fx2xla_auto_vs_inductor']:.2f}x Inductor; "
              f"{r['serving_chosen']} executables serve, {r['serving_declined']} do not)")
        if "torch_kernels_ratio" in r:
            print(f"{'':15s} tk (fx2xla ÷ fx2xla with XLA's own convolutions): {r['torch_kernels_ratio']:.2f}")
        if "batch_slicing_ratio" in r:
            print(f"{'':15s} sl (fx2xla ÷ fx2xla with torch's kernels on whole batches): {r['batch_slicing_ratio']:.2f}")
        if "channels_last_ratio" in r:
            print(f"{'':15s} cl (fx2xla ÷ fx2xla transposing around each convolution): {r['channels_last_ratio']:.2f}")
        phases = dict(r.get("phases", {}))
        split = phases.pop("fx2xla_split_parts", None)
        for contender, med in phases.items():
            print(f"{'':15s} phases, {contender:8s}: " + ", ".join(f"{k} {med[k] * 1e3:.2f} ms" for k in PHASES)
                  + f"; backward page faults {med['backward_faults']:.0f}")
        if split:
            print(f"{'':15s} fx2xla's splits in those steps: {split['parts']} parts, {split['elsewhere']} run "
                  "by a thread other than the handler's caller")
        if r["fx2xla_graphs_compiled_while_timing"] or r["fx2xla_fallback_ops"]:
            print(f"{'':15s} note: fx2xla compiled {r['fx2xla_graphs_compiled_while_timing']} graphs while timing; "
                  f"{r['fx2xla_fallback_ops']} ops fell back to eager")
    print("\n" + "\n".join(f"  {k}: {CASES[k][0]}" for k in a.models.split(",") if k in CASES))
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
