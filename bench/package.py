"""Steady-state latency of a loaded package against eager, Inductor and torch.compile(fx2xla).

    .venv/bin/python bench/package.py [--models mlp,cnn,resnet,gpt2,llama] [--rounds 9]

Per model (fx2xla.testing.model_cases, float32, random weights): the model exported with
fx2xla.export and loaded with fx2xla.load ("package"), the same with
`transposed_linear_weights=False` ("package:as-is": nn.Linear weights as torch holds them), the
same with `linear_weight_lhs=False` ("package:weight-rhs": matmuls of 4-64 rows as x . W^T), the
same package loaded with FX2XLA_TORCH_KERNELS=0 ("package:xla-kernels": the plain executable,
XLA's convolutions, where "package" runs the one with torch's), torch.compile with fx2xla,
Inductor, and eager, called on the same inputs, interleaved in rounds (bench/harness.py);
medians per call and ratios. Checked: each contender's output against eager's (float32, 1e-4
relative to the largest magnitude).

Writes bench/results/package.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import fmt_time, interleaved_medians, write_json  # noqa: E402

import fx2xla  # noqa: E402
from fx2xla.testing import model_cases  # noqa: E402


def run_model(case, rounds: int, folder: str) -> dict:
    torch.manual_seed(0)
    model = case.build().eval()
    args = case.make_inputs()
    torch._dynamo.reset()
    package = fx2xla.export(model, args, os.path.join(folder, case.name))
    contenders = {
        "eager": model,
        "inductor": torch.compile(model),
        "fx2xla": torch.compile(model, backend="fx2xla"),
        "package": fx2xla.load(package),
        "package:as-is": fx2xla.load(fx2xla.export(model, args, os.path.join(folder, case.name + "-as-is"),
                                                   transposed_linear_weights=False)),
        "package:weight-rhs": fx2xla.load(fx2xla.export(model, args, os.path.join(folder, case.name + "-rhs"),
                                                        linear_weight_lhs=False)),
        "package:xla-kernels": xla_kernels_load(package),
    }
    errors = {}
    with torch.no_grad():
        expected = model(*args)
        scale = float(expected.abs().max())
        for name, fn in contenders.items():
            errors[name] = float((fn(*args) - expected).abs().max()) / max(scale, 1e-30)
        med = interleaved_medians(contenders, args, rounds=rounds, calls_per_round=5)
    return {"median_s": med, "max_rel_err": errors,
            "ratios": {"package/inductor": med["package"] / med["inductor"],
                       "package/eager": med["package"] / med["eager"],
                       "package/fx2xla": med["package"] / med["fx2xla"],
                       "package/package:as-is": med["package"] / med["package:as-is"],
                       "package/package:weight-rhs": med["package"] / med["package:weight-rhs"],
                       "package/package:xla-kernels": med["package"] / med["package:xla-kernels"]}}


def xla_kernels_load(path: str):
    """The package at `path` loaded as where the kernel library does not run."""
    saved = os.environ.get("FX2XLA_TORCH_KERNELS")
    os.environ["FX2XLA_TORCH_KERNELS"] = "0"
    try:
        return fx2xla.load(path)
    finally:
        if saved is None:
            del os.environ["FX2XLA_TORCH_KERNELS"]
        else:
            os.environ["FX2XLA_TORCH_KERNELS"] = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mlp,cnn,resnet,gpt2,llama")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "package.json"))
    a = p.parse_args()
    wanted = a.models.split(",")
    cases = [c for c in model_cases() if c.name in wanted]
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "models": {}}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':8s} {'eager':>10s} {'inductor':>10s} {'fx2xla':>10s} {'package':>10s} {'pkg:as-is':>10s}"
          f" {'pkg/ind':>8s} {'pkg/eager':>9s} {'pkg/fx':>7s} {'pkg/as-is':>9s} {'pkg/rhs':>8s} {'pkg/xla-k':>9s}"
          f" {'max rel err':>11s}")
    with tempfile.TemporaryDirectory() as folder:
        for case in cases:
            r = run_model(case, a.rounds, folder)
            results["models"][case.name] = r
            m, q = r["median_s"], r["ratios"]
            ok = all(e <= 1e-4 for e in r["max_rel_err"].values())
            print(f"{case.name:8s} {fmt_time(m['eager']):>10s} {fmt_time(m['inductor']):>10s} {fmt_time(m['fx2xla']):>10s}"
                  f" {fmt_time(m['package']):>10s} {fmt_time(m['package:as-is']):>10s} {q['package/inductor']:8.2f}"
                  f" {q['package/eager']:9.2f} {q['package/fx2xla']:7.2f} {q['package/package:as-is']:9.2f}"
                  f" {q['package/package:weight-rhs']:8.2f} {q['package/package:xla-kernels']:9.2f}"
                  f" {max(r['max_rel_err'].values()):11.2e}{'' if ok else '  MISMATCH'}")
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
