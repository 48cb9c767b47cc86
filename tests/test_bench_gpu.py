"""bench/gpu.py (issue 13's GPU benchmark) runs end to end on the CPU with a tiny configuration
and writes every figure; its CUDA-only paths (the profiler's kernel time, host overhead, the
targets) are checked with fake profiler results, so that they work the first time on a GPU."""
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu.py"
TINY = ["--device", "cpu", "--layers", "1", "--hidden", "64", "--batch", "2", "--seq", "16", "--vocab", "64",
        "--rounds", "3", "--queued", "2", "--dtypes", "float32", "--phase-budget", "5", "--deadline", "0"]


def _load():
    spec = importlib.util.spec_from_file_location("fx2xla_bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # as a module: it leaves the cache folders of this process alone
    return module


@pytest.fixture(scope="module")
def gpu():
    return _load()


def _run(tmp_path, *args, timeout=600):
    out = tmp_path / "gpu.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "XLA_FLAGS")}
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, *args, "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout


def _positive(x):
    return isinstance(x, float) and math.isfinite(x) and x > 0


def _check_phase(phase, contenders):
    assert set(phase["contenders"]) == set(contenders), phase["contenders"]
    for name, c in phase["contenders"].items():
        assert "error" not in c, (name, c)
        assert _positive(c["first_s"]) and _positive(c["synced_s"]) and _positive(c["queued_s"]), (name, c)
        # On the CPU there are no device kernels: the kernel time is None (not 0), and so is
        # everything derived from it.
        assert "kernel_s" in c and c["kernel_s"] is None, (name, c)
        assert c["host_overhead_s"] is None and c["host_overhead_ratio"] is None
    expected = {"fx2xla/eager"} | ({"fx2xla/inductor", "inductor/eager"} if "inductor" in contenders else set())
    assert set(phase["ratios"]) == expected
    for ratio in phase["ratios"].values():
        assert all(_positive(ratio[f]) for f in ("first", "synced", "queued")), ratio
        assert ratio["kernel"] is None
    assert phase["fx2xla_graphs_compiled_while_timing"] == 0


def test_cpu_run_eager_and_fx2xla(tmp_path):
    """tiny graph, MLP inference and training, eager and fx2xla (no Inductor: its CPU compiles
    take ~20 s each). About 15 s."""
    res, stdout = _run(tmp_path, "--models", "mlp", "--contenders", "eager,fx2xla")
    assert res["environment"]["device"] == "cpu" and res["environment"]["torch"] == torch.__version__
    assert res["skipped"] == [] and res["targets"] == []  # no Inductor: no target can be judged
    assert "in_progress" not in res  # every phase finished
    _check_phase(res["tiny"], ["eager", "fx2xla"])
    assert res["tiny"]["fx2xla_max_abs_err"] == 0
    inference = res["inference"]["mlp/float32"]
    _check_phase(inference, ["eager", "fx2xla"])
    assert inference["fx2xla_max_abs_err"] <= 1e-4
    train = res["train"]["mlp/float32"]
    _check_phase(train, ["eager", "fx2xla"])
    assert train["fx2xla_first_loss_abs_diff"] <= 1e-4 * abs(train["first_loss"]["eager"])
    assert "summary:" in stdout and "kernel time and host overhead: n/a on the CPU" in stdout


@pytest.mark.slow
def test_cpu_run_with_inductor(tmp_path):
    """Every contender on a 1-layer GPT-2, inference and training: the targets are judged. ~3 min."""
    res, stdout = _run(tmp_path, "--models", "gpt2")
    for phase in (res["tiny"], res["inference"]["gpt2/float32"], res["train"]["gpt2/float32"]):
        _check_phase(phase, ["eager", "inductor", "fx2xla"])
    assert res["inference"]["gpt2/float32"]["fx2xla_max_abs_err"] <= 1e-4
    targets = {(t["target"], t["case"]) for t in res["targets"]}
    assert ("tiny-graph call (synced) <= Inductor's", "x*2+1") in targets
    assert ("inference latency <= 0.9 x Inductor", "gpt2/float32 (1 layers)") in targets
    assert ("training step <= Inductor", "gpt2/float32 (1 layers)") in targets
    assert all(t["target"].startswith("host overhead") is False for t in res["targets"])  # CPU: no kernel time
    assert "targets of issue 13" in stdout


# -- the kernel-time extraction, with profiler results as torch.profiler builds them -----------

def _event(name, start, end, device_type=DeviceType.CUDA, **kw):
    return FunctionEvent(id=0, name=name, thread=7, start_us=start, end_us=end, use_device="cuda", stack=[],
                         device_type=device_type, **kw)


class _Prof:
    """What bench/gpu.py reads of a finished torch.profiler.profile: events() and key_averages()."""

    def __init__(self, events, broken_events=False):
        self._events, self._broken = events, broken_events

    def events(self):
        if self._broken:
            raise RuntimeError("events() is not available")
        return EventList(self._events)

    def key_averages(self):
        events = EventList(self._events, use_device="cuda")
        events._build_tree()  # as the profiler does before it hands the list out
        return events.key_averages()


def _kernels():
    mm = _event("aten::mm", 0, 60, device_type=DeviceType.CPU)
    mm.append_kernel("gemm_fusion_dot", 0, 10)  # a CPU op carries its kernels' time: counted once, as kernels
    return [
        _event("gemm_fusion_dot", 0, 10), _event("wrapped_convert", 20, 50),  # call 1
        _event("gemm_fusion_dot", 100, 110), _event("Memcpy DtoD", 120, 150),  # call 2
        mm,
        _event("## forward ##", 0, 150, is_user_annotation=True),  # a GPU user annotation spans kernels
    ]


def test_kernel_time_from_events(gpu):
    k = gpu.kernel_time(_Prof(_kernels()), calls=2)
    assert k["source"] == "events"
    assert k["kernel_s"] == pytest.approx(80e-6 / 2)
    assert k["events_per_call"] == 2 and k["busy_s"] == pytest.approx(80e-6 / 2)


def test_kernel_time_overlapping_streams(gpu):
    k = gpu.kernel_time(_Prof([_event("a", 0, 10), _event("b", 5, 15)]), calls=1)
    assert k["kernel_s"] == pytest.approx(20e-6)  # summed device time
    assert k["busy_s"] == pytest.approx(15e-6)  # the union: the GPU was busy 15 us


def test_kernel_time_falls_back_to_key_averages(gpu):
    k = gpu.kernel_time(_Prof(_kernels(), broken_events=True), calls=2)
    assert k["source"] == "key_averages"
    assert k["kernel_s"] == pytest.approx(80e-6 / 2) and k["events_per_call"] == 2
    assert k["busy_s"] is None


def test_kernel_time_older_attribute_names(gpu):
    """An averages entry with only the older cuda_time_total, and a device type given as text."""
    avg = SimpleNamespace(device_type="DeviceType.CUDA", cuda_time_total=30.0, count=3)
    cpu = SimpleNamespace(device_type="DeviceType.CPU", cuda_time_total=99.0, count=1)
    prof = SimpleNamespace(key_averages=lambda: [avg, cpu])  # no events() at all
    k = gpu.kernel_time(prof, calls=3)
    assert k["kernel_s"] == pytest.approx(10e-6) and k["events_per_call"] == 1


def test_kernel_time_none_without_device_events(gpu):
    assert gpu.kernel_time(_Prof([_event("aten::add", 0, 5, device_type=DeviceType.CPU)]), calls=1) is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(4).add(1)
    assert gpu.kernel_time(prof, calls=1) is None


def test_cuda_figures_host_overhead_and_targets(gpu, monkeypatch, capsys):
    """The CUDA branch of figures() (profiler faked), the report and the targets with GPU-like data."""
    kernel = {"eager": 2e-3, "inductor": 1e-3, "fx2xla": 1e-3}
    monkeypatch.setattr(gpu, "profile_calls",
                        lambda fn, sync, calls, device: {"kernel_s": kernel[fn()], "events_per_call": 4.0,
                                                         "busy_s": None, "source": "events"})
    a = SimpleNamespace(queued=2, profiled=3, rounds=5, phase_budget=1.0)
    fns = {name: (lambda n=name: n) for name in kernel}
    res = gpu.figures(fns, lambda out=None: None, a, torch.device("cuda"), errors={})
    for name, r in res.items():
        assert r["kernel_s"] == kernel[name]
        assert r["host_overhead_s"] == pytest.approx(r["queued_s"] - kernel[name])
        assert r["host_overhead_ratio"] == pytest.approx(r["host_overhead_s"] / kernel[name])

    def phase(layers, fx_synced, fx_first, overhead):
        c = {"eager": {"first_s": 1.0, "synced_s": 4e-3, "queued_s": 3e-3, "kernel_s": 2e-3},
             "inductor": {"first_s": 10.0, "synced_s": 2e-3, "queued_s": 1.1e-3, "kernel_s": 1e-3},
             "fx2xla": {"first_s": fx_first, "synced_s": fx_synced, "queued_s": 1e-3 * (1 + overhead), "kernel_s": 1e-3,
                        "host_overhead_s": 1e-3 * overhead, "host_overhead_ratio": overhead}}
        for v in c.values():
            v.setdefault("host_overhead_s", v["queued_s"] - v["kernel_s"])
            v.setdefault("host_overhead_ratio", v["host_overhead_s"] / v["kernel_s"])
        r = {"config": {"model": "gpt2", "layers": layers, "hidden": 768, "heads": 12, "vocab": 32000, "batch": 8,
                        "seq": 512}, "parameters": 1e6, "contenders": c, "fx2xla_graphs_compiled_while_timing": 0,
             "fx2xla_max_abs_err": 1e-2}
        gpu.add_ratios(r)
        return r

    results = {"inference": {"gpt2/bfloat16": phase(6, 1.7e-3, 5.0, 0.05),
                             "gpt2_deep/bfloat16": phase(24, 1.9e-3, 20.0, 0.5)},
               "train": {"gpt2/bfloat16": {"config": {"model": "gpt2", "layers": 6},
                                           "contenders": {"inductor": {"synced_s": 1.0}, "fx2xla": {"error": "boom"}}}}}
    targets = {(t["target"], t["case"]): t for t in gpu.targets(results, SimpleNamespace(layers=6))}
    assert targets[("inference latency <= 0.9 x Inductor", "gpt2/bfloat16 (6 layers)")]["passed"]  # 0.85
    assert not targets[("inference latency <= 0.9 x Inductor", "gpt2_deep/bfloat16 (24 layers)")]["passed"]  # 0.95
    assert not targets[("first call <= Inductor's cold first call", "gpt2_deep/bfloat16 (24 layers)")]["passed"]
    assert targets[("host overhead <= 10% of kernel time (inference)", "gpt2/bfloat16 (6 layers)")]["passed"]
    assert ("host overhead <= 10% of kernel time (inference)", "gpt2_deep/bfloat16 (24 layers)") not in targets
    failed = targets[("training step <= Inductor", "gpt2/bfloat16 (6 layers)")]
    assert failed["passed"] is False and "boom" in failed["note"]
    for kind in ("inference", "train"):
        for key, r in results[kind].items():
            gpu.print_phase(f"{kind} {key}", r)
    gpu.summary(results)
    printed = capsys.readouterr().out
    assert "host ovh" in printed and "summary:" in printed and "FAILED: boom" in printed
