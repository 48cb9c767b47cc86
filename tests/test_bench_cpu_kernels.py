"""bench/cpu_kernels.py runs on the CPU with torch.compile's contenders: for the MLP's first GEMM
and the 3 -> 32 convolution in float32, Inductor and fx2xla sit beside torch eager and XLA's
default kernel, every contender's result matched torch's in the run (float32 rtol / atol 1e-4),
each has a positive median and GFLOP/s that are the case's FLOPs over it, and fx2xla's kernel
column names the route its executable took: the kernel library's convolution handler where the
library is built, an XLA kernel otherwise."""
import math

from fx2xla import torch_kernels
from tests.conftest import run_bench


def test_cpu_kernels_bench_runs_with_compiled_contenders(tmp_path):
    r, printed = run_bench("cpu_kernels.py", ["--cases", "gemm_up,conv_3_32", "--dtypes", "float32", "--settings",
                                              "default", "--rounds", "2", "--target-ms", "2", "--gap-ms", "1"],
                           tmp_path / "cpu_kernels.json")
    gemm = r["cases"]["gemm_up/float32"]["contenders"]
    conv = r["cases"]["conv_3_32/float32"]["contenders"]
    assert set(gemm) == {"torch", "xla:default", "inductor", "fx2xla"}
    assert set(conv) == {f"{c}/{layout}" for c in ("torch", "xla:default", "inductor", "fx2xla")
                         for layout in ("nchw", "nhwc")}
    for case, contenders in (("gemm_up/float32", gemm), ("conv_3_32/float32", conv)):
        flops = r["cases"][case]["flops"]
        for name, c in contenders.items():
            assert c["numerics_ok"], (case, name, c["max_abs_err"])
            assert math.isfinite(c["median_s"]) and c["median_s"] > 0, (case, name)
            assert math.isclose(c["gflops"], flops / c["median_s"] / 1e9), (case, name)
            base = contenders["torch" if c["layout"] == "rowmajor" else f"torch/{c['layout']}"]
            assert math.isclose(c["vs_torch_same_layout"], c["median_s"] / base["median_s"]), (case, name)
    assert gemm["inductor"]["kernel"] == "inductor"
    assert gemm["fx2xla"]["kernel"].startswith("fx2xla:") and gemm["fx2xla"]["kernel"] != "fx2xla:?"
    for layout in ("nchw", "nhwc"):
        route = conv[f"fx2xla/{layout}"]["kernel"]
        if torch_kernels.available("convolution"):
            assert "torch_convolution" in route, route
        else:
            assert route.startswith("fx2xla:") and "torch_" not in route, route
    assert "fx2xla:" in printed and "inductor" in printed
