"""XLA:CPU's GEMM and convolution kernels under each of its kernel-selecting compile options,
against torch eager (MKL / oneDNN), in GFLOP/s.

    .venv/bin/python bench/cpu_kernels.py [--cases gemm_up,gemm_down,conv_3_32,conv_32_64]
        [--dtypes float32,bfloat16] [--settings default,eigen,...] [--rounds 15] [--no-compiled]

The cases are fx2xla's benchmark models' hot kernels: the MLP's two GEMMs as nn.Linear computes
them (x @ W.T: 32x1024 @ 1024x4096, then 32x4096 @ 4096x1024) and SmallCNN/ResNet-like 3x3
convolutions (batch 8, 64x64, 3->32 and 32->64 channels, padding 1) in NCHW and NHWC (torch:
channels_last). Every XLA setting compiles its own executable
(`jax.jit(f).lower(...).compile(compiler_options=...)`, i.e. `CompileOptions.env_option_overrides`,
what fx2xla's executor sets); the optimized HLO is searched for the kernel that really ran
(`__ynn_fusion`, `__onednn_fusion`, or a plain dot/convolution: Eigen). All contenders of one
case (torch eager and every setting) alternate in rounds in balanced orders (bench/harness.py);
medians, and each one's ratio to torch eager.

Beside them, torch.compile's two backends on the same op as a module holding the weight as a
parameter (nn.Linear's and nn.Conv2d's case), under no_grad: "inductor" and "fx2xla" (fx2xla's
own route: its kernel column names the kernel library's handler where the executable calls one,
e.g. `torch_convolution`, else the XLA kernel as above). `--no-compiled` leaves them out.

Numerics: every setting's result is compared with torch's. float32: rtol 1e-4, atol 1e-4 (GEMM
and convolutions alike). bfloat16: both sides compute from the same bf16 inputs and round the
result to bf16 once; compared with torch's float32 result on those inputs, with rtol 1.6e-2
(torch's own bf16 tolerance, about 2 bf16 ulps) and atol 1e-2 * max|reference|; torch eager's own
bf16 error is recorded beside it. bf16 on XLA is measured as fx2xla lowers it: GEMMs as
dot(bf16, bf16) -> float32 (`bf16_dot`), convolutions upcast to float32 first (`f32_conv`), and
each also the other way, to see whether XLA:CPU's bf16 kernels would pay.

Writes bench/results/cpu_kernels.json and prints a table.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import balanced_orders, write_json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

_YNN = "xla_cpu_experimental_ynn_fusion_type"
_T = "LIBRARY_FUSION_TYPE_"

# XLA:CPU settings (jaxlib 0.10.2). Its defaults: YNNPACK for dots, convolutions and reduces
# (ynn_fusion_type = INDIVIDUAL_DOT, INDIVIDUAL_CONVOLUTION, REDUCE), XNNPACK on but with no
# fusion kinds, oneDNN off, multi-threaded Eigen.
SETTINGS: dict[str, dict] = {
    "default": {},
    # YNNPACK off: dots and convolutions go to Eigen (multi-threaded on XLA's intra-op pool).
    "eigen": {_YNN: ""},
    "eigen_1thread": {_YNN: "", "xla_cpu_multi_thread_eigen": False},
    # oneDNN's dot fusions (a matmul with the elementwise ops around it); convolutions: Eigen.
    "onednn": {_YNN: "", "xla_cpu_use_onednn": True,
               "xla_cpu_experimental_onednn_fusion_type": f"{_T}DOT,{_T}ELTWISE"},
    # oneDNN for dots, YNNPACK kept for convolutions and reduces.
    "onednn_dot_ynn_conv": {_YNN: f"{_T}INDIVIDUAL_CONVOLUTION,{_T}REDUCE", "xla_cpu_use_onednn": True,
                            "xla_cpu_experimental_onednn_fusion_type": f"{_T}DOT,{_T}ELTWISE"},
    # YNNPACK's fusing dot (dot + elementwise in one YNN subgraph) instead of the lone dot.
    "ynn_dot_fusion": {_YNN: f"{_T}DOT,{_T}ELTWISE,{_T}INDIVIDUAL_CONVOLUTION,{_T}REDUCE"},
    # YNNPACK for dots and reduces, Eigen for convolutions (which beat YNNPACK on 3 input channels).
    "ynn_no_conv": {_YNN: f"{_T}INDIVIDUAL_DOT,{_T}REDUCE"},
    # XNNPACK's dot fusions and graph fusion: accepted by 0.10.2, but no XNN fusion comes out
    # for these ops (checked in the HLO: the kernel column reads "eigen").
    "xnn": {_YNN: "", "xla_cpu_experimental_xnn_fusion_type": f"{_T}DOT,{_T}ELTWISE",
            "xla_cpu_experimental_xnn_graph_fusion_mode": "XNN_GRAPH_FUSION_MODE_GREEDY"},
}
DEFAULT_SETTINGS = "default,eigen,onednn,onednn_dot_ynn_conv,ynn_dot_fusion,xnn"


def _gemm_case(m, k, n):
    """nn.Linear without bias: x[m,k] @ W[n,k].T."""
    def make(dtype, g):
        return (torch.randn(m, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype))

    def torch_fn(x, w):
        return torch.nn.functional.linear(x, w)

    def jax_fn(upcast):
        def f(x, w):
            out_dtype = x.dtype
            if upcast:
                x, w = x.astype(jnp.float32), w.astype(jnp.float32)
            y = lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)
            return y.astype(out_dtype)
        return f

    return dict(kind="gemm", flops=2 * m * k * n, make=make, torch_fn=torch_fn, jax_fn=jax_fn,
                layouts=("rowmajor",), shape=f"{m}x{k} @ ({n}x{k}).T")


def _conv_case(n, cin, cout, hw, k=3):
    def make(dtype, g):
        return (torch.randn(n, cin, hw, hw, generator=g).to(dtype),
                (torch.randn(cout, cin, k, k, generator=g) / (cin * k * k) ** 0.5).to(dtype))

    def torch_fn(x, w):
        return torch.nn.functional.conv2d(x, w, padding=k // 2)

    def jax_fn(upcast, layout):
        dims = ("NCHW", "OIHW", "NCHW") if layout == "nchw" else ("NHWC", "HWIO", "NHWC")

        def f(x, w):
            out_dtype = x.dtype
            if upcast:
                x, w = x.astype(jnp.float32), w.astype(jnp.float32)
            y = lax.conv_general_dilated(x, w, (1, 1), [(k // 2, k // 2)] * 2, dimension_numbers=dims,
                                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
            return y.astype(out_dtype)
        return f

    return dict(kind="conv", flops=2 * n * hw * hw * cout * cin * k * k, make=make, torch_fn=torch_fn,
                jax_fn=jax_fn, layouts=("nchw", "nhwc"), shape=f"[{n},{cin},{hw},{hw}] * [{cout},{cin},{k},{k}] pad {k // 2}")


CASES = {
    "gemm_up": _gemm_case(32, 1024, 4096),
    "gemm_down": _gemm_case(32, 4096, 1024),
    "conv_3_32": _conv_case(8, 3, 32, 64),
    "conv_32_64": _conv_case(8, 32, 64, 64),
}


def kernels_in(hlo: str) -> str:
    """Which kernel did the dot/convolution go to, by the optimized HLO."""
    found = set(re.findall(r'"kind":"__(\w+?)_fusion"', hlo))
    found = {"ynnpack" if f == "ynn" else "onednn" if f == "onednn" else f for f in found}
    dots_outside = bool(re.search(r"^\s*(ROOT )?%\S+ = \S+ (dot|convolution)\(", _entry_and_plain_fusions(hlo), re.M))
    if dots_outside or not found:
        found.add("eigen")
    return "+".join(sorted(found))


def _entry_and_plain_fusions(hlo: str) -> str:
    """The HLO less the computations of library fusions (whose dots run in the library)."""
    called = set(re.findall(r'calls=(%[\w.\-]+), [^\n]*"kind":"__\w+_fusion"', hlo))
    keep, skip = [], False
    for line in hlo.splitlines():
        head = re.match(r"^(%[\w.\-]+) \(", line)
        if head:
            skip = head.group(1) in called
        if not skip:
            keep.append(line)
    return "\n".join(keep)


def to_jax(t: torch.Tensor, layout: str, weight: bool = False):
    """`t` as a jax array; NHWC: activations as NHWC, weights as HWIO."""
    a = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    if layout == "nhwc":
        a = np.ascontiguousarray(a.transpose(2, 3, 1, 0) if weight else a.transpose(0, 2, 3, 1))
    arr = jnp.asarray(a)
    return arr.astype(jnp.bfloat16) if t.dtype == torch.bfloat16 else arr


def from_jax(y, layout: str) -> torch.Tensor:
    a = np.asarray(y.astype(jnp.float32))
    if layout == "nhwc":
        a = a.transpose(0, 3, 1, 2)
    return torch.from_numpy(np.array(a))


def tolerance(dtype: torch.dtype, ref: torch.Tensor) -> tuple[float, float]:
    if dtype == torch.float32:
        return 1e-4, 1e-4
    return 1.6e-2, 1e-2 * float(ref.abs().max())


class _Held(torch.nn.Module):
    """`fn(x, w)` with w held as a parameter, as nn.Linear and nn.Conv2d hold theirs."""

    def __init__(self, fn, w):
        super().__init__()
        self.fn = fn
        self.w = torch.nn.Parameter(w, requires_grad=False)

    def forward(self, x):
        return self.fn(x, self.w)


def fx2xla_route(graphs) -> str:
    """The kernels fx2xla's executables for one op run: the kernel library's handlers they call
    (`torch_convolution`, `torch_matmul`, `few_rows_matmul`, ...), else XLA's kernel as
    kernels_in reads it."""
    from fx2xla import torch_kernels
    from fx2xla.runtime.executor import optimized_hlo_text

    routes = set()
    for g in graphs:
        spec = getattr(g, "static", None)
        if spec is None:
            continue
        hlo = optimized_hlo_text(spec.exe)
        called = [t for t in torch_kernels.TARGETS if f'custom_call_target="{t}"' in hlo]
        if called:
            routes.update(t.removeprefix("fx2xla_") for t in called)
        else:
            routes.add(kernels_in(hlo))
    return "+".join(sorted(routes)) or "?"


def compiled_contenders(case: dict, tx, tw, tag: str) -> tuple[dict, dict]:
    """Inductor and fx2xla on `case`'s op, the weight a parameter: (contenders, meta)."""
    import fx2xla  # noqa: F401  (registers the backend)
    from fx2xla.metrics import live_graphs

    module = _Held(case["torch_fn"], tw).eval()
    contenders, meta = {}, {}
    for backend in ("inductor", "fx2xla"):
        before = set(live_graphs)  # held: no id of theirs is reused
        compiled = torch.compile(module, backend=backend, dynamic=False, fullgraph=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            compiled(tx)
        key = f"{backend}{tag}"
        meta[key] = {"kernel": "inductor" if backend == "inductor" else
                     "fx2xla:" + fx2xla_route([g for g in live_graphs if g not in before]),
                     "compile_s": time.perf_counter() - t0}

        def call(a, b, f=compiled):  # b: the weight, already held by the module
            with torch.no_grad():
                return f(a)
        contenders[key] = (call, (tx, tw))
    return contenders, meta


def run_case(name: str, case: dict, dtype: torch.dtype, settings: list[str], rounds: int, target_s: float,
             gap_s: float = 0.02, compiled: bool = True) -> dict:
    g = torch.Generator().manual_seed(0)
    x, w = case["make"](dtype, g)
    ref = case["torch_fn"](x.float(), w.float())  # float32 on the (rounded) inputs
    if compiled:  # every case compiles the same forward anew: Dynamo's per-code limit counts them all
        torch._dynamo.reset()
    rtol, atol = tolerance(dtype, ref)
    contenders, meta = {}, {}
    layouts = case["layouts"]
    for layout in layouts:
        tag = "" if layout == "rowmajor" else f"/{layout}"
        tx, tw = (x, w) if layout != "nhwc" else (x.contiguous(memory_format=torch.channels_last),
                                                  w.contiguous(memory_format=torch.channels_last))
        contenders[f"torch{tag}"] = (lambda a, b, f=case["torch_fn"]: f(a, b), (tx, tw))
        meta[f"torch{tag}"] = {"kernel": "torch (MKL/oneDNN)", "layout": layout}
        jx, jw = to_jax(x, layout), to_jax(w, layout, weight=True)
        forms = [False] if dtype == torch.float32 else (
            [False, True] if case["kind"] == "gemm" else [True, False])  # fx2xla's form first
        for s in settings:
            for upcast in forms:
                form = "" if dtype == torch.float32 else ("/f32_" if upcast else "/bf16_") + case["kind"]
                key = f"xla:{s}{tag}{form}"
                fn = case["jax_fn"](upcast) if case["kind"] == "gemm" else case["jax_fn"](upcast, layout)
                t0 = time.perf_counter()
                try:
                    exe = jax.jit(fn).lower(jx, jw).compile(compiler_options=SETTINGS[s])
                except Exception as e:  # an option this jaxlib refuses: report, go on
                    meta[key] = {"error": str(e).splitlines()[0][:200]}
                    continue
                compile_s = time.perf_counter() - t0
                got = from_jax(exe(jx, jw), layout)
                err = float((got - ref).abs().max())
                ok = bool(torch.allclose(got, ref, rtol=rtol, atol=atol))
                meta[key] = {"kernel": kernels_in(exe.as_text()), "layout": layout, "compile_s": compile_s,
                             "max_abs_err": err, "numerics_ok": ok, "setting": s,
                             "form": form.lstrip("/") or "f32", "options": SETTINGS[s]}
                contenders[key] = (lambda a, b, e=exe: e(a, b).block_until_ready(), (jx, jw))
        if compiled:
            more, more_meta = compiled_contenders(case, tx, tw, tag)
            for key, (f, args) in more.items():
                got = f(*args).float()
                more_meta[key].update(layout=layout, max_abs_err=float((got - ref).abs().max()),
                                      numerics_ok=bool(torch.allclose(got, ref, rtol=rtol, atol=atol)))
            contenders.update(more)
            meta.update(more_meta)
        teager = case["torch_fn"](tx, tw)
        meta[f"torch{tag}"]["max_abs_err"] = float((teager.float() - ref).abs().max())
        meta[f"torch{tag}"]["numerics_ok"] = bool(torch.allclose(teager.float(), ref, rtol=rtol, atol=atol))
    # Calls per sample: about target_s of torch eager's time, at least 1.
    probe = contenders[next(iter(contenders))]
    probe[0](*probe[1])
    t0 = time.perf_counter()
    probe[0](*probe[1])
    calls = max(1, int(target_s / max(time.perf_counter() - t0, 1e-6)))
    for f, args in contenders.values():  # warm every contender once
        f(*args)
    samples = interleaved_samples(contenders, rounds, calls, gap_s)
    med = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
    out = {"shape": case["shape"], "flops": case["flops"], "dtype": str(dtype).replace("torch.", ""),
           "rtol": rtol, "atol": atol, "calls_per_sample": calls, "contenders": {}}
    for k, t in med.items():
        base = med["torch" + ("" if meta[k]["layout"] == "rowmajor" else f"/{meta[k]['layout']}")]
        out["contenders"][k] = {**meta[k], "median_s": t, "gflops": case["flops"] / t / 1e9,
                                "min_s": min(w for w, _ in samples[k]), "cpu_s": cpu[k],
                                "cpu_gflops_per_core": case["flops"] / cpu[k] / 1e9,
                                "cpu_vs_torch_same_layout": cpu[k] / cpu["torch" + ("" if meta[k]["layout"] == "rowmajor" else f"/{meta[k]['layout']}")],
                                "vs_torch_same_layout": t / base, "vs_torch_nchw": t / med.get("torch", med.get("torch/nchw", base))}
    for k, m in meta.items():
        if "error" in m:
            out["contenders"][k] = m
    return out


def interleaved_samples(contenders: dict, rounds: int, calls: int, gap_s: float) -> dict[str, list[tuple]]:
    """(wall, process CPU) seconds per call, one sample per contender per round; the contenders
    alternate in balanced orders (each first, and right after each other one, equally often),
    with `gap_s` of sleep before each sample: torch's OpenMP workers and XLA's pool spin for a
    while after their work, and would otherwise take the cores from whichever contender runs
    next. The process CPU time counts every thread of this process (XLA runs on its own pool)
    and not the time other processes on a shared machine take from it."""
    names = list(contenders)
    orders = [[names[i] for i in row] for row in balanced_orders(len(names))]
    samples: dict[str, list[tuple]] = {k: [] for k in names}
    for r in range(rounds):
        for name in orders[r % len(orders)]:
            fn, args = contenders[name]
            time.sleep(gap_s)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(calls):
                out = fn(*args)
            if isinstance(out, torch.Tensor):
                out.reshape(-1)[0].item()
            samples[name].append(((time.perf_counter() - t0) / calls, (time.process_time() - c0) / calls))
    return samples


def models_ab(models: list[str], dtypes: list[str], settings: list[str], rounds: int, gap_s: float) -> dict:
    """fx2xla's models (fx2xla.testing.model_cases, bench/inference.py's) compiled by fx2xla once
    per XLA setting (the setting in force as CPU_OPTION_OVERRIDES while the graph compiles; the
    executable caches key on it), against Inductor and eager, all interleaved in the same rounds:
    wall and process-CPU medians, each fx2xla setting ÷ Inductor and ÷ fx2xla's default."""
    import fx2xla  # noqa: F401  (registers the backend)
    from fx2xla.runtime import executor
    from fx2xla.testing import model_cases

    out = {}
    for dt in dtypes:
        dtype = getattr(torch, dt)
        for case in model_cases():
            if case.name not in models:
                continue
            torch.manual_seed(0)
            model = case.build().eval().to(dtype)
            args = tuple(a.to(dtype) if a.is_floating_point() else a for a in case.make_inputs())
            res: dict = {"settings": {}}
            with torch.no_grad():
                torch._dynamo.reset()
                ref = model(*args).float()
                inductor = torch.compile(model, fullgraph=True)
                contenders = {"eager": (model, args), "inductor": (inductor, args)}
                t0 = time.perf_counter()
                inductor(*args)
                res["inductor_first_call_s"] = time.perf_counter() - t0
                saved = executor.CPU_OPTION_OVERRIDES
                for st in settings:
                    compiled = torch.compile(model, backend="fx2xla", fullgraph=True)
                    executor.CPU_OPTION_OVERRIDES = tuple(SETTINGS[st].items())
                    try:
                        t0 = time.perf_counter()
                        got = compiled(*args).float()
                        first = time.perf_counter() - t0
                    except Exception as e:
                        res["settings"][st] = {"error": str(e).splitlines()[0][:200]}
                        continue
                    finally:
                        executor.CPU_OPTION_OVERRIDES = saved
                    res["settings"][st] = {"first_call_s": first, "max_abs_err_vs_eager": float((got - ref).abs().max())}
                    contenders[f"fx2xla:{st}"] = (compiled, args)
                for f, a in contenders.values():
                    f(*a)
                t0 = time.perf_counter()
                model(*args)
                calls = max(1, int(0.02 / max(time.perf_counter() - t0, 1e-6)))
                samples = interleaved_samples(contenders, rounds, calls, gap_s)
            med = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
            cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
            res.update({"median_s": med, "cpu_s": cpu, "calls_per_sample": calls, "load": load()})
            for st in settings:
                k = f"fx2xla:{st}"
                if k in med:
                    res["settings"][st].update(
                        vs_inductor=med[k] / med["inductor"], vs_eager=med[k] / med["eager"],
                        vs_default=med[k] / med.get("fx2xla:default", med[k]),
                        cpu_vs_inductor=cpu[k] / cpu["inductor"], cpu_vs_default=cpu[k] / cpu.get("fx2xla:default", cpu[k]))
            out[f"{case.name}/{dt}"] = res
            print(f"\n{case.name}/{dt}: eager {med['eager'] * 1e3:.2f} ms, inductor {med['inductor'] * 1e3:.2f} ms "
                  f"(load {res['load']})")
            for st, r in res["settings"].items():
                if "error" in r:
                    print(f"  fx2xla:{st:22s} ERROR {r['error']}")
                    continue
                print(f"  fx2xla:{st:22s} {med['fx2xla:' + st] * 1e3:8.2f} ms  ÷inductor {r['vs_inductor']:5.2f}  "
                      f"÷default {r['vs_default']:5.2f}  (cpu-time ÷inductor {r['cpu_vs_inductor']:5.2f}, ÷default "
                      f"{r['cpu_vs_default']:5.2f})  max|err| {r['max_abs_err_vs_eager']:.2e}")
    return out


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--settings", default=DEFAULT_SETTINGS)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--target-ms", type=float, default=20.0, help="time per sample, in torch eager calls")
    p.add_argument("--gap-ms", type=float, default=20.0, help="sleep before each sample (spinning pools settle)")
    p.add_argument("--no-compiled", action="store_true", help="leave out torch.compile's contenders (inductor, fx2xla)")
    p.add_argument("--models", default="", help="also (or with --cases '' only) fx2xla's models per setting, "
                   "e.g. mlp,cnn,gpt2,bert,llama, against Inductor")
    p.add_argument("--model-settings", default="default,ynn_dot_fusion,ynn_no_conv",
                   help="the settings the models are compiled under")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_kernels.json"))
    a = p.parse_args()
    settings = a.settings.split(",")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
    import jaxlib

    results = {"jaxlib": jaxlib.version.__version__, "cores": len(os.sched_getaffinity(0)),
               "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
               "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
               "settings": SETTINGS, "load_before": load(), "cases": {}}
    print(f"torch {torch.__version__} ({results['torch_cpu_capability']}, {torch.get_num_threads()} threads), "
          f"jaxlib {jaxlib.version.__version__}, {results['cores']} cores usable, load {results['load_before']}")
    print(f"\n{'case':22s} {'contender':40s} {'kernel':26s} {'GFLOP/s':>8s} {'GF/cpu-s':>7s} {'median':>10s} {'/torch':>7s} {'cpu/torch':>9s} {'max|err|':>9s} ok")
    for dt in a.dtypes.split(","):
        dtype = getattr(torch, dt)
        for name in filter(None, a.cases.split(",")):
            r = run_case(name, CASES[name], dtype, settings, a.rounds, a.target_ms / 1e3, a.gap_ms / 1e3,
                         compiled=not a.no_compiled)
            r["load_after"] = load()
            results["cases"][f"{name}/{dt}"] = r
            for k, c in r["contenders"].items():
                if "error" in c:
                    print(f"{name + '/' + dt:22s} {k:40s} ERROR {c['error']}")
                    continue
                print(f"{name + '/' + dt:22s} {k:40s} {c['kernel']:26s} {c['gflops']:8.1f} {c['cpu_gflops_per_core']:7.1f} {c['median_s'] * 1e3:8.3f}ms "
                      f"{c['vs_torch_same_layout']:7.2f} {c['cpu_vs_torch_same_layout']:9.2f} {c['max_abs_err']:9.2e} {'ok' if c['numerics_ok'] else 'FAIL'}")
            print(f"{'':22s} (rtol {r['rtol']:.1e}, atol {r['atol']:.1e}; load {r['load_after']})")
    if a.models:
        ms = a.model_settings.split(",")
        unknown = [s for s in ms if s not in SETTINGS]
        if unknown:
            p.error(f"unknown settings {unknown}; known: {list(SETTINGS)}")
        results["models"] = models_ab(a.models.split(","), a.dtypes.split(","), ms, a.rounds, a.gap_ms / 1e3)
    results["load_after"] = load()
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
