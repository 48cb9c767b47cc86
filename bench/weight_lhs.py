"""Matmuls of a few rows on the CPU: the four forms of x . W^T fx2xla can compile, by rows,
against eager and Inductor.

    .venv/bin/python bench/weight_lhs.py [--rows 1,2,4,8,16,32,64,128] [--models memory,cache]
        [--rounds 9] [--out bench/results/weight_lhs.json]

Models (float32, random weights, no_grad): a stack of Linear layers with a ReLU between them,
  memory: 8 layers of 1024 x 1024 (32 MiB of weights: read from memory on every call);
  cache:  4 layers of 256 x 688 and 688 x 256 (5.4 MiB; a LLaMA 4L MLP's shapes, which a CPU
          cache of that size may hold);
  small:  64 x 96 and 96 x 64 (tests/test_bench_weight_lhs.py).
Contenders, each compiled with static shapes for each row count:
  eager, inductor;
  fx2xla: the defaults (at 2-8 rows: the kernel library's few-row matmul, where it is built;
      at 9-64 rows: option linear_weight_lhs, (W . x^T)^T);
  fx2xla:lhs: without the few-row kernel (torch_kernels without "few_rows_matmul"): (W . x^T)^T
      from 4 rows, x . W^T on weights laid out [in, out] at 2-3;
  fx2xla:kn: linear_weight_lhs=False (weights laid out [in, out] where fx2xla's layout choice
      says so, transposed_linear_weights);
  fx2xla:nk: both off (x . W^T with W as torch holds it).
Times are medians of interleaved rounds (bench/harness.py, balanced orders); ratios are of
medians in the same run. Each contender's result is checked against eager's (float32 rtol 1e-4 /
atol 1e-4: sums in other orders over up to 1024 terms, per layer).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from harness import fmt_time, interleaved_medians, write_json  # noqa: E402

import fx2xla  # noqa: E402,F401  (registers the backend)

MODELS = {"memory": [(1024, 1024)] * 8, "cache": [(256, 688), (688, 256)] * 4,
          "small": [(64, 96), (96, 64)]}  # the smoke test's
OPTIONS = {"fx2xla": None, "fx2xla:lhs": {"torch_kernels": ["convolution", "skinny_matmul", "attention"]},
           "fx2xla:kn": {"linear_weight_lhs": False, "torch_kernels": ["convolution", "skinny_matmul", "attention"]},
           "fx2xla:nk": {"linear_weight_lhs": False, "transposed_linear_weights": False,
                         "torch_kernels": ["convolution", "skinny_matmul", "attention"]}}


def stack(shapes) -> torch.nn.Module:
    layers = []
    for k, n in shapes:
        layers += [torch.nn.Linear(k, n), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).eval()


def bench_rows(model, rows: int, k: int, rounds: int) -> dict:
    torch._dynamo.reset()
    x = torch.randn(rows, k)
    contenders = {"eager": model, "inductor": torch.compile(model, dynamic=False)}
    for name, options in OPTIONS.items():
        contenders[name] = torch.compile(model, backend="fx2xla", dynamic=False, options=options)
    with torch.no_grad():
        expected = model(x)
        for name, fn in contenders.items():
            torch.testing.assert_close(fn(x), expected, rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        med = interleaved_medians(contenders, (x,), rounds=rounds, calls_per_round=5, budget_s=60)
    return {"median_s": med,
            "fx2xla_vs_inductor": med["fx2xla"] / med["inductor"], "fx2xla_vs_eager": med["fx2xla"] / med["eager"],
            "fx2xla_vs_lhs": med["fx2xla"] / med["fx2xla:lhs"],
            "fx2xla_vs_kn": med["fx2xla"] / med["fx2xla:kn"], "fx2xla_vs_nk": med["fx2xla"] / med["fx2xla:nk"],
            "kn_vs_nk": med["fx2xla:kn"] / med["fx2xla:nk"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    p.add_argument("--models", default="memory,cache")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "weight_lhs.json"))
    a = p.parse_args()
    torch._dynamo.config.recompile_limit = 64
    results: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "models": {}}
    print(f"{'model':7s} {'rows':>4s} {'eager':>10s} {'inductor':>10s} {'fx2xla':>10s} {'fx2xla:lhs':>10s} "
          f"{'fx2xla:kn':>10s} {'fx2xla:nk':>10s} {'fx/ind':>7s} {'fx/lhs':>6s} {'fx/kn':>6s} {'fx/nk':>6s} "
          f"{'kn/nk':>6s}")
    for name in a.models.split(","):
        shapes = MODELS[name]
        torch.manual_seed(0)
        model = stack(shapes)
        results["models"][name] = {"shapes": shapes, "rows": {}}
        for rows in (int(r) for r in a.rows.split(",")):
            r = bench_rows(model, rows, shapes[0][0], a.rounds)
            results["models"][name]["rows"][str(rows)] = r
            m = r["median_s"]
            print(f"{name:7s} {rows:4d} {fmt_time(m['eager'])} {fmt_time(m['inductor'])} {fmt_time(m['fx2xla'])} "
                  f"{fmt_time(m['fx2xla:lhs'])} {fmt_time(m['fx2xla:kn'])} {fmt_time(m['fx2xla:nk'])} "
                  f"{r['fx2xla_vs_inductor']:7.2f} {r['fx2xla_vs_lhs']:6.2f} {r['fx2xla_vs_kn']:6.2f} "
                  f"{r['fx2xla_vs_nk']:6.2f} {r['kn_vs_nk']:6.2f}", flush=True)
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
