"""Auto-sharding against hand plans on 8 virtual CPU devices, at the same memory budget.

    .venv/bin/python bench/autoshard.py [--models mlp,gpt2,llama,gpt2_12] [--mode inference,train]
                                        [--rounds 10] [--out bench/results/autoshard.json]

Hand plans: 1-D mesh of 8: data parallel ("data"), FSDP ("fsdp"), Megatron TP ("model");
2-D mesh 2 x 4: DP x TP ("data", "model"), applied by bench/spmd.py's `apply_plan`.

--mode inference (eval mode, no_grad): each hand plan is compiled and measured:
- its inputs' bytes per device (XLA's memory_analysis: arguments), and its peak per device
  (arguments, outputs not written in place, temporaries);
- the collective bytes per device its optimized HLO holds;
- its median latency.
Then `options={"sharding": "auto", "mesh": <the same mesh>, "memory_budget": <the hand plan's
peak>}` compiles the unannotated model, and the same figures are taken, with the solver's
predictions (collective bytes, peak) and solve time, and the largest |auto - eager| output
difference.

--mode train: each contender trains its own deep copy of the model (train mode, every
dropout's p set to 0) for 3 steps (the first compiles) with the model and
`AdamW(foreach=True, lr=1e-3).step` compiled by fx2xla; loss: MSE against a random target
(MLP), cross-entropy on the next token (`ids.roll(-1, dims=1)`, language models). A step is
forward + loss + backward + opt.step + zero_grad. From the graphs a contender created
(names ending "forward", "backward"; the optimizer step's are grouped as "optimizer"):
- collective bytes per device in the optimized HLO: forward + backward, and the optimizer's;
- `peak_per_device` of the step: the forward graph's XLA peak (arguments + outputs - aliased
  + temporaries) plus 3 x the parameters' bytes per device (gradients and two AdamW moments;
  a parameter's bytes divided by the number of shards of its sharding): what the budget
  plans. The largest of the step's graphs' own XLA peaks (often the backward's, or the
  optimizer's where replicated parameters are not updated in place) is printed beside it and
  each graph's peak recorded: the budget does not plan those;
- the median step time (hand and auto interleaved, after one untimed warm-up step each);
- the 3 steps' losses against eager (a deep copy trained eagerly on the same inputs).
The hand plan is trained first; auto-sharding then trains a fresh copy of the unannotated model
with `{"sharding": "auto", "mesh": <the hand plan's mesh>, "memory_budget": <the hand plan's
peak_per_device>}` (the optimizer step with plain backend="fx2xla"), and the forward graph's
solution (`g.auto_sharding`) gives the predicted collective bytes, memory, solve time, status.

Collectives are counted in the optimized HLO by fx2xla.sharding.collectives (every element of
a tuple-shaped one, such as a backward's combined gradient all-reduce) two ways: their result
bytes ("collective_bytes"), and the bytes a ring over each one's group sends per device
("collective_moved": an all-reduce 2 (n-1)/n of its result, an all-gather (n-1)/n), which is
what the solver prices and predicts. The comparison with the hand plans is on "moved".

The issue's target: auto's collective bytes within 10% of the best hand plan at that budget,
and never over it. A contender that raises (e.g. InfeasibleBudget) is printed and recorded as
{"error": ...}; the run goes on.

JSON (default bench/results/autoshard.json):
  {"torch", "jax", "modes", "models": {name: {"parameters",
     "inference": {plan: {"mesh", "budget", "hand": {...}, "auto": {...}, "auto_over_budget",
                          "collective_ratio", "moved_ratio"}},
     "train": {plan: {"mesh", "steps", "eager_losses", "budget",
                      "hand": {"losses", "max_abs_loss_diff_vs_eager", "first_step_s", "step_s",
                               "forward_peak_per_device", "parameter_bytes_per_device",
                               "peak_per_device", "largest_graph_peak",
                               "collective_bytes" (forward + backward),
                               "collective_moved", "forward_collective_bytes", "backward_collective_bytes",
                               "optimizer_collective_bytes", "graphs": {graph name: {"kind",
                               "arguments", "outputs", "aliased", "temporaries",
                               "peak_per_device", "collective_bytes", "collective_moved", "collectives"}}},
                      "auto": {the same, plus "predicted_collective_bytes", "solver_memory_bytes",
                               "solver_input_bytes", "solve_s", "status", "variables", "cached"},
                      "auto_over_budget", "collective_ratio", "moved_ratio" (auto / hand, forward + backward)}}}}}
A failed contender's entry is {"error": "..."} (the hand plan's figures are kept when only
auto-sharding failed).
"""
from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import sys
import tempfile
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from harness import fmt_time, interleaved_medians, write_json  # noqa: E402
from spmd import apply_plan  # noqa: E402
from train import make_step  # noqa: E402

from fx2xla.metrics import live_graphs  # noqa: E402
from fx2xla.runtime.executor import optimized_hlo_text, peak_bytes  # noqa: E402
from fx2xla.sharding import collectives  # noqa: E402
from fx2xla.testing import LogitsOnly, gpt2, llama, mlp, token_ids  # noqa: E402

MODELS = {
    "mlp": (lambda: mlp(256, 1024, 256), lambda: torch.randn(64, 256),
            {"0.weight": ("model", None), "0.bias": ("model",), "2.weight": (None, "model")}),
    "gpt2": (lambda: LogitsOnly(gpt2(layers=2, hidden=128)), lambda: token_ids(8, 64),
             {"*.attn.c_attn.weight": (None, "model"), "*.attn.c_attn.bias": ("model",),
              "*.attn.c_proj.weight": ("model", None), "*.mlp.c_fc.weight": (None, "model"),
              "*.mlp.c_fc.bias": ("model",), "*.mlp.c_proj.weight": ("model", None)}),
    "gpt2_12": (lambda: LogitsOnly(gpt2(layers=12, hidden=128)), lambda: token_ids(8, 64), None),  # gpt2's plan
    "llama": (lambda: LogitsOnly(llama(layers=2, hidden=128, heads=8, kv_heads=4)), lambda: token_ids(8, 64),
              {"*.q_proj.weight": ("model", None), "*.k_proj.weight": ("model", None),
               "*.v_proj.weight": ("model", None), "*.o_proj.weight": (None, "model"),
               "*.gate_proj.weight": ("model", None), "*.up_proj.weight": ("model", None),
               "*.down_proj.weight": (None, "model")}),
}
HAND = (("dp", "1-D"), ("fsdp", "1-D"), ("tp", "1-D"), ("dp_x_tp", "2-D"))
MODES = ("inference", "train")
TRAIN_STEPS = 3  # the first compiles


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _first_line(e: BaseException) -> str:
    """The exception's type and first informative line (for BackendCompilerFailed, the line
    after "backend='fx2xla' raised:", which names the inner error)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.rstrip().endswith("raised:")]
    return f"{type(e).__name__}: {(lines or [''])[0][:240]}"


def compiled_figures(model, x, options=None) -> tuple:
    before = {id(g) for g in live_graphs}
    fn = torch.compile(model, backend="fx2xla", options=options)
    with torch.no_grad():
        fn(x)
    (g,) = [g for g in live_graphs if id(g) not in before]
    stats = g.static.exe.get_compiled_memory_stats()
    found = collectives(optimized_hlo_text(g.static.exe))
    coll, moved = sum(c.bytes for c in found), sum(c.moved for c in found)
    return fn, {"arguments_per_device": stats.argument_size_in_bytes, "peak_per_device": peak_bytes(stats),
                "collective_bytes": coll, "collective_moved": moved}, g


def bench_inference(name: str, base, x0, tp, rounds: int) -> dict:
    base = base.eval()
    with torch.no_grad():
        expected = base(x0)
    res: dict = {}
    for plan, kind in HAND:
        torch._dynamo.reset()
        model, x = copy.deepcopy(base), x0.clone()
        mesh = apply_plan(plan, model, x, tp)
        hand_fn, hand, _ = compiled_figures(model, x)
        torch._dynamo.reset()
        auto_model, auto_x = copy.deepcopy(base), x0.clone()
        opts = {"sharding": "auto", "mesh": mesh, "memory_budget": hand["peak_per_device"]}
        try:
            auto_fn, auto, g = compiled_figures(auto_model, auto_x, opts)
        except Exception as e:  # noqa: BLE001  report and go on: one case must not hide the rest
            res[plan] = {"mesh": kind, "hand": hand, "auto": {"error": _error(e)},
                         "budget": hand["peak_per_device"]}
            print(f"  {name:6s} {plan:8s} {kind}: hand {hand['arguments_per_device'] / 1024:8.0f} KiB/dev "
                  f"(peak {hand['peak_per_device'] / 1024:.0f}), {hand['collective_bytes'] / 1024:8.1f} KiB coll "
                  f"| auto FAILED {_first_line(e)}", flush=True)
            continue
        sol = g.auto_sharding
        with torch.no_grad():
            err = float((auto_fn(auto_x) - expected).abs().max())
            med = interleaved_medians({"hand": lambda: hand_fn(x), "auto": lambda: auto_fn(auto_x)}, (),
                                      rounds=rounds, budget_s=30)
        r = {"mesh": kind, "hand": hand | {"latency_s": med["hand"]},
             "auto": auto | {"latency_s": med["auto"], "predicted_collective_bytes": sol.collective_bytes,
                             "solver_memory_bytes": sol.memory_bytes, "solver_input_bytes": sol.input_bytes,
                             "solve_s": sol.seconds, "status": sol.status,
                             "variables": sol.variables, "max_abs_err_vs_eager": err},
             "budget": hand["peak_per_device"]}
        r["auto_over_budget"] = auto["peak_per_device"] > hand["peak_per_device"]
        r["collective_ratio"] = (auto["collective_bytes"] / hand["collective_bytes"]) if hand["collective_bytes"] else None
        r["moved_ratio"] = (auto["collective_moved"] / hand["collective_moved"]) if hand["collective_moved"] else None
        res[plan] = r
        over = " OVER BUDGET" if r["auto_over_budget"] else ""
        print(f"  {name:6s} {plan:8s} {kind}: hand peak {hand['peak_per_device'] / 1024:8.0f} KiB/dev "
              f"(inputs {hand['arguments_per_device'] / 1024:.0f}), {hand['collective_bytes'] / 1024:8.1f} KiB coll "
              f"(moved {hand['collective_moved'] / 1024:.1f}), {fmt_time(med['hand'])} | auto peak "
              f"{auto['peak_per_device'] / 1024:8.0f} KiB/dev{over} (inputs {auto['arguments_per_device'] / 1024:.0f}; "
              f"estimated {sol.memory_bytes / 1024:.0f}), {auto['collective_bytes'] / 1024:8.1f} KiB coll "
              f"(moved {auto['collective_moved'] / 1024:.1f}, predicted {sol.collective_bytes / 1024:.1f}), {fmt_time(med['auto'])}, solve {sol.seconds:5.2f} s "
              f"{sol.status}; |err| {err:.1e}", flush=True)
    return res


# --- training steps -------------------------------------------------------------------------

def train_copy(base):
    """A deep copy in train mode with every dropout off (losses comparable with eager's)."""
    model = copy.deepcopy(base).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def train_loss(x0, out_shape):
    """MSE against a random target for float inputs (the MLP); next-token cross-entropy for
    token ids (the language models)."""
    if x0.is_floating_point():
        return torch.randn(out_shape, generator=torch.Generator().manual_seed(1)), F.mse_loss

    def cross_entropy(out, y):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    return x0.roll(-1, dims=1), cross_entropy


def make_train_step(model, x, y, loss_fn, options=None, compiled: bool = True):
    """forward + loss + backward + AdamW(foreach, lr 1e-3) step + zero_grad (bench/train.py);
    compiled: the model with `options`, the optimizer step with plain fx2xla."""
    return make_step(model, "fx2xla" if compiled else None, x, y, foreach=True, loss=loss_fn, lr=1e-3,
                     options=options)[0]


def graph_kind(g) -> str:
    return "forward" if g.name.endswith("forward") else "backward" if g.name.endswith("backward") else "optimizer"


def parameter_bytes_per_device(model, mesh) -> int:
    """Each parameter's bytes over the shards of its sharding (after compiling: the hand plan's
    annotation or auto-sharding's); unannotated ones are replicated."""
    total = 0
    for p in model.parameters():
        ann = getattr(p, "_fx2xla_sharding", None)
        shards = 1
        if ann is not None:
            sizes = mesh.shape if ann.mesh_id == mesh.id else ann.mesh.shape
            shards = math.prod(sizes[a] for dim in ann.spec for a in dim)
        total += math.ceil(p.numel() * p.element_size() / shards)
    return total


def step_figures(graphs, model, mesh) -> dict:
    per_graph: dict = {}
    coll = {"forward": 0, "backward": 0, "optimizer": 0}
    moved = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    forward = []
    for g in graphs:
        kind = graph_kind(g)
        if g.static is None:  # nothing compiled for it (no executable)
            per_graph[g.name] = {"kind": kind, "compiled": False}
            continue
        stats = g.static.exe.get_compiled_memory_stats()
        peak = peak_bytes(stats)
        ops: dict = {}
        found = collectives(optimized_hlo_text(g.static.exe))
        for c in found:
            n, b = ops.get(c.op, (0, 0))
            ops[c.op] = (n + 1, b + c.bytes)
        cb = sum(b for _, b in ops.values())
        coll[kind] += cb
        moved[kind] += sum(c.moved for c in found)
        per_graph[g.name] = {"kind": kind, "arguments": stats.argument_size_in_bytes,
                             "outputs": stats.output_size_in_bytes, "aliased": stats.alias_size_in_bytes,
                             "temporaries": stats.temp_size_in_bytes, "peak_per_device": peak,
                             "collective_bytes": cb, "collective_moved": sum(c.moved for c in found),
                             "collectives": {k: {"count": n, "bytes": b} for k, (n, b) in ops.items()}}
        if kind == "forward":
            forward.append(g)
    if len(forward) != 1:
        raise RuntimeError(f"expected one forward graph, got {len(forward)}: {sorted(per_graph)}")
    params = parameter_bytes_per_device(model, mesh)
    fwd_peak = per_graph[forward[0].name]["peak_per_device"]
    largest = max(v["peak_per_device"] for v in per_graph.values() if "peak_per_device" in v)
    return {"forward_peak_per_device": fwd_peak, "parameter_bytes_per_device": params,
            "peak_per_device": fwd_peak + 3 * params, "largest_graph_peak": largest,
            "collective_bytes": coll["forward"] + coll["backward"],
            "collective_moved": moved["forward"] + moved["backward"],
            "forward_collective_bytes": coll["forward"], "backward_collective_bytes": coll["backward"],
            "optimizer_collective_bytes": coll["optimizer"], "graphs": per_graph}, forward[0]


def train_contender(model, x, y, loss_fn, mesh, eager_losses, options=None) -> tuple:
    """Trains TRAIN_STEPS steps; returns the step closure, its figures and its forward graph."""
    before = {id(g) for g in live_graphs}
    step = make_train_step(model, x, y, loss_fn, options)
    t0 = time.perf_counter()
    losses = [float(step())]
    first = time.perf_counter() - t0
    losses += [float(step()) for _ in range(TRAIN_STEPS - 1)]
    graphs = [g for g in live_graphs if id(g) not in before]
    figures, fwd = step_figures(graphs, model, mesh)
    figures = {"losses": losses, "max_abs_loss_diff_vs_eager": max(abs(a - b) for a, b in zip(losses, eager_losses)),
               "first_step_s": first} | figures
    return step, figures, fwd


def _train_line(f: dict) -> str:
    return (f"peak {f['peak_per_device'] / 1024:7.0f} KiB/dev (fwd {f['forward_peak_per_device'] / 1024:.0f} "
            f"+ 3 x params {f['parameter_bytes_per_device'] / 1024:.0f}; largest graph "
            f"{f['largest_graph_peak'] / 1024:.0f}), fwd+bwd "
            f"{f['collective_bytes'] / 1024:8.1f} KiB coll (moved {f['collective_moved'] / 1024:.1f}; "
            f"fwd {f['forward_collective_bytes'] / 1024:.1f}), "
            f"opt {f['optimizer_collective_bytes'] / 1024:.1f}")


def bench_train(name: str, base, x0, tp, rounds: int) -> dict:
    train_base = train_copy(base)
    with torch.no_grad():
        out_shape = train_base(x0).shape
    y, loss_fn = train_loss(x0, out_shape)
    eager_step = make_train_step(copy.deepcopy(train_base), x0, y, loss_fn, compiled=False)
    eager_losses = [float(eager_step()) for _ in range(TRAIN_STEPS)]
    res: dict = {}
    for plan, kind in HAND:
        r: dict = {"mesh": kind, "steps": TRAIN_STEPS, "eager_losses": eager_losses}
        res[plan] = r
        torch._dynamo.reset()
        try:
            model, x = copy.deepcopy(train_base), x0.clone()
            mesh = apply_plan(plan, model, x, tp)
            hand_step, hand, _ = train_contender(model, x, y, loss_fn, mesh, eager_losses)
        except Exception as e:  # noqa: BLE001  report and go on: one case must not hide the rest
            r["hand"] = {"error": _error(e)}
            print(f"  {name:6s} {plan:8s} {kind} train: hand FAILED {_first_line(e)}", flush=True)
            continue
        r["hand"] = hand
        budget = r["budget"] = hand["peak_per_device"]
        torch._dynamo.reset()
        try:
            auto_model, auto_x = copy.deepcopy(train_base), x0.clone()
            opts = {"sharding": "auto", "mesh": mesh, "memory_budget": budget}
            auto_step, auto, fwd = train_contender(auto_model, auto_x, y, loss_fn, mesh, eager_losses, opts)
            sol = fwd.auto_sharding
            auto |= {"predicted_collective_bytes": sol.collective_bytes, "solver_memory_bytes": sol.memory_bytes,
                     "solver_input_bytes": getattr(sol, "input_bytes", None), "solve_s": sol.seconds,
                     "status": sol.status, "variables": sol.variables, "cached": sol.cached}
        except Exception as e:  # noqa: BLE001
            r["auto"] = {"error": _error(e)}
            hand_step()  # untimed: compiles again after the reset
            hand["step_s"] = interleaved_medians({"hand": hand_step}, (), rounds=rounds, budget_s=60)["hand"]
            print(f"  {name:6s} {plan:8s} {kind} train: hand {_train_line(hand)}, {fmt_time(hand['step_s'])}, "
                  f"|dloss| {hand['max_abs_loss_diff_vs_eager']:.1e} | auto FAILED {_first_line(e)}", flush=True)
            hand_step = None
            gc.collect()
            continue
        # One untimed step each: the hand plan's graphs were dropped by the reset above and
        # compile again here (from the disk cache).
        hand_step()
        auto_step()
        med = interleaved_medians({"hand": hand_step, "auto": auto_step}, (), rounds=rounds, budget_s=60)
        hand["step_s"], auto["step_s"] = med["hand"], med["auto"]
        r["auto"] = auto
        r["auto_over_budget"] = auto["peak_per_device"] > budget
        r["collective_ratio"] = (auto["collective_bytes"] / hand["collective_bytes"]) if hand["collective_bytes"] else None
        r["moved_ratio"] = (auto["collective_moved"] / hand["collective_moved"]) if hand["collective_moved"] else None
        over = " OVER BUDGET" if r["auto_over_budget"] else ""
        print(f"  {name:6s} {plan:8s} {kind} train: hand {_train_line(hand)}, {fmt_time(med['hand'])}, "
              f"|dloss| {hand['max_abs_loss_diff_vs_eager']:.1e} | auto {_train_line(auto)}{over} "
              f"(predicted {sol.collective_bytes / 1024:7.1f}), {fmt_time(med['auto'])}, solve {sol.seconds:5.2f} s "
              f"{sol.status}; |dloss| {auto['max_abs_loss_diff_vs_eager']:.1e}", flush=True)
        hand_step = auto_step = None
        gc.collect()
    return res


def bench_model(name: str, rounds: int, modes) -> dict:
    build, make_input, tp = MODELS[name]
    tp = MODELS["gpt2"][2] if tp is None else tp
    torch.manual_seed(0)
    base = build().eval()
    x0 = make_input()
    res: dict = {"parameters": sum(p.numel() for p in base.parameters())}
    if "inference" in modes:
        res["inference"] = bench_inference(name, base, x0, tp, rounds)
    if "train" in modes:
        res["train"] = bench_train(name, base, x0, tp, rounds)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--models", default="mlp,gpt2,llama,gpt2_12")
    p.add_argument("--mode", default="inference,train", help=f"comma list of {','.join(MODES)}")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "autoshard.json"))
    a = p.parse_args()
    modes = a.mode.split(",")
    if bad := [m for m in modes if m not in MODES]:
        p.error(f"--mode: unknown {bad}; choose from {','.join(MODES)}")
    # A cold cache: every solve is timed, none is a cached solution.
    os.environ["FX2XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="fx2xla-autoshard-")
    results = {"torch": torch.__version__, "jax": jax.__version__, "modes": modes, "models": {}}
    for name in a.models.split(","):
        results["models"][name] = bench_model(name, a.rounds, modes)
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
