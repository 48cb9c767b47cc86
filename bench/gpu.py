"""Issue 13, "Faster than Inductor on a GPU": eager, Inductor and fx2xla, measured in one process.

    PJRT_DEVICE=CUDA python3 bench/gpu.py                      # H100: bf16 first; stops starting phases at 420 s
    PJRT_DEVICE=CUDA python3 bench/gpu.py --dtypes float32     # the fp32 half, in a second run
    .venv/bin/python bench/gpu.py --device cpu --layers 1 --hidden 64 --deep-layers 2 --batch 2 \
        --seq 16 --vocab 128 --rounds 5 --queued 2 --deadline 0     # CPU smoke run, every path (~10 min)

Models (random weights from configs, nothing downloaded; transformers' default attention, SDPA;
dropout 0 so that the contenders' losses can be compared): GPT-2, LLaMA (hidden / 64 heads, half
as many kv heads: 16 and 8 at 1024; MLP width 11/4 x hidden), BERT (BertModel, last hidden state), an MLP (hidden -> 4 hidden ->
hidden on batch x seq rows) and a deep GPT-2 (`--deep-layers`, 24). Defaults are the H100
configs: 6 layers, hidden 768 (GPT-2, BERT) or 1024 (LLaMA, MLP), vocab 32000, batch 8 x 512.
Models are built on the CPU with a fixed seed, then `.to(device, dtype)`; inputs live on the device.

Phases (`--phases`), each with every contender (`--contenders`: eager, Inductor =
`torch.compile(model)`, fx2xla = `torch.compile(model, backend="fx2xla")`):
- tiny: `x*2+1` on 4 elements on the device, per call;
- inference: the model in eval mode under torch.no_grad (one model shared by the contenders);
- train: one step = forward, cross-entropy (logits upcast to fp32; BERT and the MLP against
  targets over their output features), backward, `AdamW(foreach=True).step()` compiled with the
  same backend, `zero_grad(set_to_none=True)`; each contender trains its own deep copy.
Per contender and phase:
- first call / first step, synced. Caches are cold: TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR
  and FX2XLA_CACHE_DIR are fresh temp folders, set before torch is imported, and again for every
  phase (Inductor's fresh_cache, a new FX2XLA_CACHE_DIR, fx2xla's in-memory executables
  cleared). XLA's in-process autotuning results cannot be cleared: a later phase with the same
  GEMM shapes may find them (for strictly cold figures, run one phase per process). The tiny
  phase runs first and absorbs process start-up (jax's client, Inductor's imports);
- (1) synced: wall time per call with a sync after every call (`torch.cuda.synchronize()` on
  CUDA; on the CPU one output element is read), median of interleaved rounds
  (harness.interleaved_medians, balanced orders);
- (2) queued: `--queued` N calls back to back, one sync at the end, / N; median of rounds;
- (3) kernel: GPU time per call from torch.profiler (ProfilerActivity.CUDA): the summed durations
  of the CUDA device events (kernels, memcpy, memset; user annotations left out) of
  `--profiled` K calls / K. None on the CPU (no device kernels to profile);
- host overhead = queued - kernel, and its ratio to kernel.
Ratios are fx2xla / eager and fx2xla / Inductor (and Inductor / eager) of the medians of one run.
Checks: fx2xla's (and Inductor's) max |error| vs eager on the inference output, first-step loss
differences, and the graphs fx2xla compiled while timing (must be 0: steady state recompiles).

Time: compiles dominate on a GPU (GPU.md: fp32 first calls 30-130 s). The timed rounds of each
phase stop after `--phase-budget` seconds (at least 5 rounds); no phase starts after
`--deadline` seconds from process start, nor when the longest phase so far would end past it
(on an H100 the default run covers about the bf16 half). Skipped phases are listed with the command that runs them. The JSON (default
bench/results/gpu.json: versions, device, config, every raw median) is rewritten after each
phase, so a run cut short keeps what it measured (its "in_progress" names the phase that was
running when the process died). Printed: a block per phase, a summary table
and the issue's targets as PASS/FAIL lines (transformer models): inference latency (synced)
<= 0.9 x Inductor's (6 and 24 layers), training step <= Inductor's, first call <= Inductor's
cold first call (first step likewise), tiny-graph call <= Inductor's, host overhead <= 10% of
kernel time at `--layers` layers.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

PROCESS_START = time.perf_counter()
TMP_ROOT = None  # the folder of every cache folder this run makes, removed at the end

if __name__ == "__main__":
    # Cold compiler caches for honest first calls; set before torch is imported. (Only when run
    # as a script: a test importing this module keeps its own settings.)
    TMP_ROOT = tempfile.mkdtemp(prefix="bench-gpu-caches-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-", dir=TMP_ROOT)
    os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton")
    os.environ["FX2XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="fx2xla-cold-", dir=TMP_ROOT)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import fmt_time, interleaved_medians, materialise, write_json  # noqa: E402
import train  # noqa: E402  (make_step)

import fx2xla  # noqa: E402

MODELS = ("gpt2", "llama", "bert", "mlp", "gpt2_deep")
TRANSFORMERS = ("gpt2", "llama", "bert", "gpt2_deep")  # the models the targets are about
CONTENDERS = ("eager", "inductor", "fx2xla")
BACKENDS = {"eager": None, "inductor": "inductor", "fx2xla": "fx2xla"}
WARMUP = 3  # calls (steps) after the first, before timing: the compiled opt.step recompiles on step 2
TINY_REPEAT = 200  # tiny graph: synced calls per timed unit (and queued calls, in blocks of N)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - PROCESS_START:6.0f}s] {msg}", flush=True)


def short(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


# -- models ----------------------------------------------------------------------------------

def model_config(name: str, a) -> dict:
    hidden = a.hidden or (1024 if name in ("llama", "mlp") else 768)
    cfg = {"model": name, "hidden": hidden, "batch": a.batch, "seq": a.seq}
    if name == "mlp":
        return cfg | {"rows": a.batch * a.seq, "mlp_width": 4 * hidden}
    cfg |= {"layers": a.deep_layers if name == "gpt2_deep" else a.layers, "vocab": a.vocab}
    if name == "llama":
        heads = max(2, hidden // 64)
        cfg |= {"heads": heads, "kv_heads": heads // 2, "intermediate": 11 * hidden // 4}
    else:
        cfg |= {"heads": max(1, hidden // 64), "intermediate": 4 * hidden}
    if hidden % cfg["heads"]:
        raise ValueError(f"{name}: hidden {hidden} is not a multiple of {cfg['heads']} heads")
    return cfg


def build_model(cfg: dict) -> torch.nn.Module:
    """The model of `cfg` on the CPU in fp32, seeded (random weights, dropout 0)."""
    from fx2xla.testing import LogitsOnly, mlp

    torch.manual_seed(0)
    name = cfg["model"]
    if name == "mlp":
        return mlp(cfg["hidden"], cfg["mlp_width"], cfg["hidden"])
    import transformers

    transformers.logging.set_verbosity_error()
    h, positions = cfg["hidden"], max(cfg["seq"], 128)
    if name in ("gpt2", "gpt2_deep"):
        c = transformers.GPT2Config(n_layer=cfg["layers"], n_embd=h, n_head=cfg["heads"], n_inner=cfg["intermediate"],
                                    vocab_size=cfg["vocab"], n_positions=positions, resid_pdrop=0.0,
                                    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return LogitsOnly(transformers.GPT2LMHeadModel(c))
    if name == "llama":
        c = transformers.LlamaConfig(num_hidden_layers=cfg["layers"], hidden_size=h, num_attention_heads=cfg["heads"],
                                     num_key_value_heads=cfg["kv_heads"], intermediate_size=cfg["intermediate"],
                                     vocab_size=cfg["vocab"], max_position_embeddings=positions,
                                     attention_dropout=0.0, bos_token_id=0, eos_token_id=0)
        return LogitsOnly(transformers.LlamaForCausalLM(c))
    if name == "bert":
        c = transformers.BertConfig(num_hidden_layers=cfg["layers"], hidden_size=h, num_attention_heads=cfg["heads"],
                                    intermediate_size=cfg["intermediate"], vocab_size=cfg["vocab"],
                                    max_position_embeddings=positions, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0)
        return LogitsOnly(transformers.BertModel(c, add_pooling_layer=False))
    raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def make_batch(cfg: dict, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, training target) on `device`: token ids and next tokens for the LMs; for BERT and
    the MLP, targets over their output features."""
    from fx2xla.testing import token_ids

    g = torch.Generator().manual_seed(0)
    if cfg["model"] == "mlp":
        x = torch.randn(cfg["rows"], cfg["hidden"], generator=g).to(dtype)
        y = torch.randint(0, cfg["hidden"], (cfg["rows"],), generator=g)
    else:
        x = token_ids(cfg["batch"], cfg["seq"], cfg["vocab"])
        y = x % cfg["hidden"] if cfg["model"] == "bert" else x.roll(-1, dims=1)
    return x.to(device), y.to(device)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))


def tiny(x):
    return x * 2 + 1


# -- measuring -------------------------------------------------------------------------------

def make_sync(device: torch.device) -> Callable[[Any], None]:
    """Waits until the work behind `out` is done: a device-wide sync on CUDA (it covers XLA's
    streams as well as torch's); on the CPU, reading one element of each output tensor."""
    if device.type == "cuda":
        def sync(out=None):
            torch.cuda.synchronize(device)
    else:
        def sync(out=None):
            materialise(out)
    return sync


class ContenderFailed(Exception):
    def __init__(self, name: str, error: BaseException):
        super().__init__(f"{name}: {short(error)}")
        self.name, self.error = name, error


def guarded(name: str, fn: Callable) -> Callable:
    def call(*args):
        try:
            return fn(*args)
        except ContenderFailed:
            raise
        except Exception as e:  # noqa: BLE001
            raise ContenderFailed(name, e) from e
    return call


def robust_medians(units: dict[str, Callable], errors: dict, **kw) -> dict[str, float]:
    """interleaved_medians over `units`; a unit that raises is reported in `errors`, dropped,
    and the rounds start again without it."""
    live = {n: guarded(n, f) for n, f in units.items() if n not in errors}
    while live:
        try:
            return interleaved_medians(live, (), **kw)
        except ContenderFailed as e:
            errors[e.name] = short(e.error)
            log(f"  {e.name} failed while timing: {short(e.error)}")
            live.pop(e.name)
    return {}


def _is_cuda_event(e) -> bool:
    dt = getattr(e, "device_type", None)
    if dt is None or getattr(e, "is_user_annotation", False):
        return False
    name = getattr(dt, "name", None) or str(dt)
    return str(name).rsplit(".", 1)[-1].upper() == "CUDA"


def _attr(e, names: tuple[str, ...]) -> float | None:
    for n in names:
        try:
            v = getattr(e, n, None)
        except Exception:  # noqa: BLE001  (a property that does not apply to this event)
            v = None
        if v is not None:
            return float(v)
    return None


def _interval_us(e) -> tuple[float, float] | None:
    tr = getattr(e, "time_range", None)
    try:
        start, end = float(tr.start), float(tr.end)
    except Exception:  # noqa: BLE001
        return None
    return (start, end) if end >= start else None


def _event_us(e) -> float:
    span = _interval_us(e)
    if span is not None:
        return span[1] - span[0]
    v = _attr(e, ("self_device_time_total", "device_time_total", "self_cuda_time_total", "cuda_time_total"))
    return v or 0.0


def _busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of `spans` (GPU busy time when kernels overlap across streams)."""
    total, end = 0.0, -math.inf
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def kernel_time(prof, calls: int) -> dict | None:
    """GPU time per call in a finished torch.profiler profile of `calls` calls: {"kernel_s": the
    summed durations of its CUDA device events / calls, "events_per_call", "busy_s": the union of
    their intervals / calls (None without intervals), "source"}; None when the profile holds no
    CUDA device events (a CPU run, or CUPTI saw nothing).
    Reads `prof.events()` (durations from each event's time_range, else from its
    self_device_time_total / device_time_total / cuda_time_total); falls back to
    `prof.key_averages()` (self_device_time_total, else the older cuda_time_total names)."""
    for source in ("events", "key_averages"):
        try:
            events = list(getattr(prof, source)())
        except Exception:  # noqa: BLE001  (missing, or not available on this torch)
            continue
        picked = [e for e in events if _is_cuda_event(e)]
        total = sum(_event_us(e) for e in picked)
        if not picked or total <= 0:
            continue
        count = sum(int(getattr(e, "count", 1) or 1) for e in picked)
        spans = [s for s in map(_interval_us, picked) if s is not None]
        busy = _busy_us(spans) * 1e-6 / calls if len(spans) == len(picked) else None
        return {"kernel_s": total * 1e-6 / calls, "events_per_call": count / calls, "busy_s": busy, "source": source}
    return None


def profile_calls(fn: Callable, sync: Callable, calls: int, device: torch.device) -> dict | None:
    from torch.profiler import ProfilerActivity, profile

    sync(fn())
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = None
        for _ in range(calls):
            out = fn()
        sync(out)
        torch.cuda.synchronize(device)
    return kernel_time(prof, calls)


def figures(fns: dict[str, Callable], sync: Callable, a, device: torch.device, errors: dict,
            synced_repeat: int = 1, queued_repeat: int = 1, profiled: int | None = None) -> dict[str, dict]:
    """The three figures of each contender in `fns` (callables of no arguments)."""
    n, profiled = a.queued, profiled or a.profiled

    def synced_unit(fn):
        def run():
            for _ in range(synced_repeat):
                sync(fn())
        return run

    def queued_unit(fn):
        def run():
            for _ in range(queued_repeat):
                out = None
                for _ in range(n):
                    out = fn()
                sync(out)
        return run

    budget = a.phase_budget / 2
    synced = robust_medians({k: synced_unit(f) for k, f in fns.items()}, errors, rounds=a.rounds, budget_s=budget)
    log(f"  synced: {', '.join(f'{k} {fmt_time(v / synced_repeat).strip()}' for k, v in synced.items())}")
    queued = robust_medians({k: queued_unit(f) for k, f in fns.items()}, errors, rounds=a.rounds, budget_s=budget)
    log(f"  queued x{n}: {', '.join(f'{k} {fmt_time(v / (n * queued_repeat)).strip()}' for k, v in queued.items())}")
    res: dict[str, dict] = {}
    for k in fns:
        if k in errors:
            res[k] = {"error": errors[k]}
            continue
        r = {"synced_s": synced[k] / synced_repeat, "queued_s": queued[k] / (n * queued_repeat),
             "kernel_s": None, "kernel_events_per_call": None, "gpu_busy_s": None,
             "host_overhead_s": None, "host_overhead_ratio": None}
        if device.type == "cuda":
            try:
                k_t = profile_calls(fns[k], sync, profiled, device)
            except Exception as e:  # noqa: BLE001  (the profiler failing must not lose the wall times)
                r["kernel_error"] = short(e)
                log(f"  {k}: profiling failed: {short(e)}")
                k_t = None
            if k_t is not None:
                r.update(kernel_s=k_t["kernel_s"], kernel_events_per_call=k_t["events_per_call"],
                         gpu_busy_s=k_t["busy_s"], kernel_source=k_t["source"])
                r["host_overhead_s"] = r["queued_s"] - r["kernel_s"]
                r["host_overhead_ratio"] = r["host_overhead_s"] / r["kernel_s"]
            elif "kernel_error" not in r:
                r["kernel_error"] = "the profile holds no CUDA device events"
        res[k] = r
    if device.type == "cuda":
        kernels = [f"{k} {fmt_opt(v.get('kernel_s'))}" for k, v in res.items()]
        log(f"  kernel: {', '.join(kernels)}")
    return res


def fmt_opt(s: float | None) -> str:
    return "n/a" if s is None else fmt_time(s).strip()


def add_ratios(res: dict) -> None:
    """fx2xla / eager, fx2xla / inductor and inductor / eager of every figure both sides have."""
    c = res["contenders"]
    ratios = {}
    for num, den in (("fx2xla", "eager"), ("fx2xla", "inductor"), ("inductor", "eager")):
        if num not in c or den not in c:
            continue
        r = {}
        for fig in ("first_s", "synced_s", "queued_s", "kernel_s"):
            x, y = c[num].get(fig), c[den].get(fig)
            r[fig.removesuffix("_s")] = x / y if x is not None and y else None
        ratios[f"{num}/{den}"] = r
    res["ratios"] = ratios


@contextlib.contextmanager
def cold_caches():
    """Fresh Inductor (and Triton) caches, on disk and in memory, and a fresh fx2xla disk cache
    with fx2xla's in-memory executables cleared, for one phase."""
    from fx2xla.runtime import executable_cache

    executable_cache.clear()
    os.environ["FX2XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="fx2xla-cold-", dir=TMP_ROOT)
    fresh = None
    try:
        import torch._inductor.utils as iu

        fresh = getattr(iu, "fresh_cache", None) or getattr(iu, "fresh_inductor_cache", None)
    except Exception:  # noqa: BLE001
        pass
    if fresh is None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-", dir=TMP_ROOT)
        os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton")
        yield
        return
    try:
        ctx = fresh(dir=TMP_ROOT, delete=False)  # kept while the phase's compiled code may still load from it
    except TypeError:
        ctx = fresh()
    with ctx:
        yield


def free_memory(device: torch.device) -> None:
    from fx2xla.runtime import executable_cache

    torch._dynamo.reset()
    executable_cache.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _graph_counters() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters

    m = fx2xla.metrics()
    return m["graphs"], m["fallback_ops"], int(counters["stats"]["unique_graphs"])


def max_abs(out, ref) -> tuple[float, float]:
    if not isinstance(out, torch.Tensor) or not isinstance(ref, torch.Tensor):
        raise TypeError(f"outputs are {type(out).__name__} / {type(ref).__name__}, not tensors")
    err = float((out.float() - ref.float()).abs().max())
    scale = float(ref.float().abs().max())
    return err, err / scale if scale else err


def steady_state(res: dict, fns: dict, sync, a, device, errors, **kw) -> None:
    """Times the contenders that survived their first call, counting the graphs compiled meanwhile."""
    before = _graph_counters()
    res["contenders"].update({k: {**res["contenders"].get(k, {}), **v}
                              for k, v in figures(fns, sync, a, device, errors, **kw).items()})
    after = _graph_counters()
    res["fx2xla_graphs_compiled_while_timing"] = after[0] - before[0] if "fx2xla" in fns else None
    res["dynamo_graphs_compiled_while_timing"] = after[2] - before[2]
    res["fx2xla_fallback_ops_while_timing"] = after[1] - before[1] if "fx2xla" in fns else None


# -- phases ----------------------------------------------------------------------------------

def first_call(name: str, fn: Callable, sync: Callable, res: dict, errors: dict):
    """Times fn's first call into res["contenders"][name]["first_s"]; returns its output, or
    None after reporting a failure (the contender then leaves the phase)."""
    before = _graph_counters()
    try:
        t0 = time.perf_counter()
        out = fn()
        sync(out)
        first = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001  (report and go on without this contender)
        errors[name] = short(e)
        res["contenders"][name] = {"error": short(e), "traceback": traceback.format_exc(limit=-6)}
        log(f"  {name} FAILED on its first call: {short(e)}")
        return None
    after = _graph_counters()
    res["contenders"][name] = {"first_s": first}
    if name == "fx2xla":
        res["fx2xla_graphs_first_call"] = after[0] - before[0]
        res["fx2xla_fallback_ops"] = after[1] - before[1]
    log(f"  {name} first call {fmt_time(first).strip()}")
    return out


def warm(name: str, fn: Callable, sync: Callable, res: dict, errors: dict) -> bool:
    try:
        for _ in range(WARMUP):
            sync(fn())
        return True
    except Exception as e:  # noqa: BLE001
        errors[name] = short(e)
        res["contenders"][name] = {**res["contenders"][name], "error": short(e)}
        log(f"  {name} FAILED while warming up: {short(e)}")
        return False


def phase_tiny(a, device, sync) -> dict:
    x = torch.randn(4, device=device)
    res: dict = {"what": "x*2+1 on 4 elements", "contenders": {}}
    errors: dict = {}
    fns = {}
    with cold_caches():
        for c in a.contenders:
            fn = tiny if c == "eager" else torch.compile(tiny, backend=BACKENDS[c], fullgraph=True)
            call = (lambda f: lambda: f(x))(fn)
            out = first_call(c, call, sync, res, errors)
            if out is None:
                continue
            if c != "eager":
                try:
                    res[f"{c}_max_abs_err"] = max_abs(out, tiny(x))[0]
                except Exception as e:  # noqa: BLE001
                    res[f"{c}_check_error"] = short(e)
            if warm(c, call, sync, res, errors):
                fns[c] = call
        steady_state(res, fns, sync, a, device, errors, synced_repeat=TINY_REPEAT,
                     queued_repeat=max(1, TINY_REPEAT // a.queued), profiled=max(a.profiled, 50))
    add_ratios(res)
    return res


def phase_inference(name: str, dtype: torch.dtype, a, device, sync) -> dict:
    cfg = model_config(name, a)
    model = build_model(cfg).eval().to(device, dtype)
    x, _ = make_batch(cfg, device, dtype)
    res: dict = {"config": cfg, "parameters": sum(p.numel() for p in model.parameters()),
                 "attention": getattr(getattr(getattr(model, "model", None), "config", None), "_attn_implementation", None),
                 "contenders": {}}
    errors: dict = {}
    fns = {}
    with torch.no_grad(), cold_caches():
        t0 = time.perf_counter()
        ref = model(x)
        sync(ref)
        eager_first = time.perf_counter() - t0
        log(f"  eager first call {fmt_time(eager_first).strip()}")
        for c in a.contenders:
            if c == "eager":
                res["contenders"]["eager"] = {"first_s": eager_first}
                if warm(c, lambda: model(x), sync, res, errors):
                    fns["eager"] = lambda: model(x)
                continue
            compiled = torch.compile(model, backend=BACKENDS[c])
            call = (lambda f: lambda: f(x))(compiled)
            out = first_call(c, call, sync, res, errors)
            if out is None:
                continue
            try:
                err, rel = max_abs(out, ref)
                res[f"{c}_max_abs_err"], res[f"{c}_max_rel_err"] = err, rel
                log(f"  {c} vs eager: max|err| {err:.2e} (relative to max|eager| {rel:.2e})")
            except Exception as e:  # noqa: BLE001
                res[f"{c}_check_error"] = short(e)
            del out
            if warm(c, call, sync, res, errors):
                fns[c] = call
        del ref
        steady_state(res, fns, sync, a, device, errors)
    add_ratios(res)
    return res


def make_step(model: torch.nn.Module, backend: str | None, x, y) -> Callable:
    """train.make_step with foreach AdamW and this bench's loss; each step also returns a
    parameter, so a CPU sync (reading one element of each output) waits for the update too."""
    step, _ = train.make_step(model, backend, x, y, foreach=True, loss=loss_fn)
    p0 = next(model.parameters()).detach()
    return lambda: (step(), p0)


def phase_train(name: str, dtype: torch.dtype, a, device, sync) -> dict:
    cfg = model_config(name, a)
    base = build_model(cfg).train().to(device, dtype)
    x, y = make_batch(cfg, device, dtype)
    res: dict = {"config": cfg, "parameters": sum(p.numel() for p in base.parameters()),
                 "step": "forward + cross-entropy + backward + AdamW(foreach=True) step + zero_grad(set_to_none=True)",
                 "contenders": {}, "first_loss": {}}
    errors: dict = {}
    fns = {}
    copies = {c: copy.deepcopy(base) for c in a.contenders}
    del base
    with cold_caches():
        for c in a.contenders:
            try:
                step = make_step(copies.pop(c), BACKENDS[c], x, y)
            except Exception as e:  # noqa: BLE001
                errors[c] = short(e)
                res["contenders"][c] = {"error": short(e)}
                continue
            out = first_call(c, step, sync, res, errors)
            if out is None:
                continue
            res["first_loss"][c] = float(out[0])
            del out
            if warm(c, step, sync, res, errors):
                fns[c] = step
        losses = res["first_loss"]
        for c in ("fx2xla", "inductor"):
            if c in losses and "eager" in losses:
                d = abs(losses[c] - losses["eager"])
                res[f"{c}_first_loss_abs_diff"] = d
                res[f"{c}_first_loss_rel_diff"] = d / abs(losses["eager"]) if losses["eager"] else d
                log(f"  {c} first loss {losses[c]:.6f} vs eager {losses['eager']:.6f} (|diff| {d:.2e})")
        steady_state(res, fns, sync, a, device, errors)
    add_ratios(res)
    return res


# -- report ----------------------------------------------------------------------------------

def describe(cfg: dict | None) -> str:
    if not cfg:
        return ""
    if cfg["model"] == "mlp":
        return f"{cfg['hidden']}-{cfg['mlp_width']}-{cfg['hidden']} on {cfg['rows']} rows"
    heads = f"{cfg['heads']}/{cfg['kv_heads']} heads" if "kv_heads" in cfg else f"{cfg['heads']} heads"
    return f"{cfg['layers']} layers, hidden {cfg['hidden']}, {heads}, vocab {cfg['vocab']}, batch {cfg['batch']}x{cfg['seq']}"


def fmt_ratio(v) -> str:
    return f"{'n/a':>11s}" if v is None else f"{v:11.3f}"


def fmt_t(v) -> str:
    return f"{'n/a':>11s}" if v is None else fmt_time(v)


def print_phase(key: str, res: dict) -> None:
    if "error" in res and "contenders" not in res:
        print(f"\n== {key}: FAILED: {res['error']}", flush=True)
        return
    extra = f" ({describe(res.get('config'))}; {res['parameters'] / 1e6:.1f}M params)" if "parameters" in res else ""
    print(f"\n== {key}{extra}", flush=True)
    print(f"{'':16s} {'first':>11s} {'synced':>11s} {'queued':>11s} {'kernel':>11s} {'host ovh':>11s} {'ovh/kern':>11s}")
    for c, r in res["contenders"].items():
        if "error" in r:
            print(f"{c:16s} FAILED: {r['error']}")
            continue
        print(f"{c:16s} {fmt_t(r.get('first_s'))} {fmt_t(r.get('synced_s'))} {fmt_t(r.get('queued_s'))} "
              f"{fmt_t(r.get('kernel_s'))} {fmt_t(r.get('host_overhead_s'))} {fmt_ratio(r.get('host_overhead_ratio'))}")
    for k, r in res.get("ratios", {}).items():
        print(f"{k:16s} {fmt_ratio(r['first'])} {fmt_ratio(r['synced'])} {fmt_ratio(r['queued'])} {fmt_ratio(r['kernel'])}")
    checks = []
    for c in ("fx2xla", "inductor"):
        if f"{c}_max_abs_err" in res:
            rel = res.get(f"{c}_max_rel_err")
            checks.append(f"{c} max|err| vs eager {res[f'{c}_max_abs_err']:.2e}" + (f" (rel {rel:.2e})" if rel is not None else ""))
        if f"{c}_first_loss_abs_diff" in res:
            checks.append(f"{c} first-loss |diff| vs eager {res[f'{c}_first_loss_abs_diff']:.2e}")
    if res.get("fx2xla_graphs_compiled_while_timing") is not None:
        checks.append(f"fx2xla graphs compiled while timing: {res['fx2xla_graphs_compiled_while_timing']}")
    if res.get("fx2xla_fallback_ops"):
        checks.append(f"fx2xla ops run eagerly (islands): {res['fx2xla_fallback_ops']}")
    if checks:
        print("check: " + "; ".join(checks))
    if any(r.get("kernel_s") is None and "error" not in r for r in res["contenders"].values()):
        reasons = {r.get("kernel_error", "CPU run: no device kernels to profile") for r in res["contenders"].values()
                   if r.get("kernel_s") is None and "error" not in r}
        print("kernel n/a: " + "; ".join(sorted(reasons)))
    if res.get("fx2xla_graphs_compiled_while_timing"):
        print(f"WARNING: fx2xla compiled {res['fx2xla_graphs_compiled_while_timing']} graphs while timing (steady state must be 0)")


def summary(results: dict) -> None:
    rows = [("tiny", "-", results["tiny"])] if "tiny" in results else []
    for kind in ("inference", "train"):
        rows += [(kind, key, r) for key, r in results.get(kind, {}).items()]
    if not rows:
        return
    print("\nsummary: synced wall time per call (step); ratios fx2xla / Inductor of each figure, and fx2xla / eager (synced)")
    print(f"{'phase':9s} {'model/dtype':20s} {'eager':>11s} {'inductor':>11s} {'fx2xla':>11s} {'fx/eager':>9s} "
          f"{'fx/ind':>7s} {'queued':>7s} {'kernel':>7s} {'first':>7s} {'recomp':>6s}")

    def r3(v):
        return f"{'n/a':>7s}" if v is None else f"{v:7.2f}"

    for kind, key, r in rows:
        if "contenders" not in r:
            print(f"{kind:9s} {key:20s} FAILED: {r.get('error', '')[:80]}")
            continue
        c = r["contenders"]

        def s(name):
            return fmt_t(c[name].get("synced_s")) if name in c and "error" not in c[name] else f"{'-':>11s}"

        fe, fi = r.get("ratios", {}).get("fx2xla/eager", {}), r.get("ratios", {}).get("fx2xla/inductor", {})
        rc = r.get("fx2xla_graphs_compiled_while_timing")
        fx_eager = "n/a" if fe.get("synced") is None else f"{fe['synced']:.2f}"
        print(f"{kind:9s} {key:20s} {s('eager')} {s('inductor')} {s('fx2xla')} {fx_eager:>9s} "
              f"{r3(fi.get('synced'))} {r3(fi.get('queued'))} {r3(fi.get('kernel'))} {r3(fi.get('first'))} "
              f"{'-' if rc is None else rc:>6}")


def targets(results: dict, a) -> list[dict]:
    """The issue's targets, where Inductor was measured (transformer models only)."""
    out = []

    def check(what, key, ratio, limit, fx):
        if fx is not None and "error" in fx:
            out.append({"target": what, "case": key, "value": None, "limit": limit, "passed": False,
                        "note": f"fx2xla failed: {fx['error']}"})
        elif ratio is not None:
            out.append({"target": what, "case": key, "value": ratio, "limit": limit, "passed": ratio <= limit})

    def ratio(r, fig):
        return r.get("ratios", {}).get("fx2xla/inductor", {}).get(fig)

    def usable(r):
        c = r.get("contenders", {})
        return "inductor" in c and "error" not in c["inductor"] and "fx2xla" in c

    if "tiny" in results and usable(results["tiny"]):
        t = results["tiny"]
        check("tiny-graph call (synced) <= Inductor's", "x*2+1", ratio(t, "synced"), 1.0, t["contenders"]["fx2xla"])
    for kind in ("inference", "train"):
        for key, r in results.get(kind, {}).items():
            cfg = r.get("config", {})
            if cfg.get("model") not in TRANSFORMERS or not usable(r):
                continue
            fx, label = r["contenders"]["fx2xla"], f"{key} ({cfg['layers']} layers)"
            if kind == "inference":
                check("inference latency <= 0.9 x Inductor", label, ratio(r, "synced"), 0.9, fx)
                check("first call <= Inductor's cold first call", label, ratio(r, "first"), 1.0, fx)
            else:
                check("training step <= Inductor", label, ratio(r, "synced"), 1.0, fx)
                check("first training step <= Inductor's cold first step", label, ratio(r, "first"), 1.0, fx)
            if cfg.get("layers") == a.layers and fx.get("host_overhead_ratio") is not None:
                out.append({"target": f"host overhead <= 10% of kernel time ({kind})", "case": label,
                            "value": fx["host_overhead_ratio"], "limit": 0.10,
                            "passed": fx["host_overhead_ratio"] <= 0.10})
    return out


def environment(device: torch.device) -> dict:
    import jax
    import jaxlib

    env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "jax": jax.__version__, "jaxlib": getattr(getattr(jaxlib, "version", None), "__version__", None),
           "fx2xla": fx2xla.__version__, "torch_threads": torch.get_num_threads(),
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "PJRT_DEVICE": os.environ.get("PJRT_DEVICE"), "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
           "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
           "device": str(device), "host": platform.node(), "cpu": platform.processor() or platform.machine()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        env["transformers"] = None
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                           capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        env["git_commit"] = None
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    else:
        env["device_name"] = env["cpu"]
    return env


def jax_client(device: torch.device) -> dict:
    """Starts jax's client for `device` now (fx2xla set its memory policy when imported), so that
    no phase's first call pays for it; a missing CUDA plugin is reported here, once."""
    from fx2xla.runtime import get_backend

    platform_name = "cpu" if device.type == "cpu" else ("rocm" if torch.version.hip else "cuda")
    t0 = time.perf_counter()
    try:
        devs = get_backend(platform_name).local_devices()
        return {"platform": platform_name, "start_s": time.perf_counter() - t0,
                "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devs]}
    except Exception as e:  # noqa: BLE001
        return {"platform": platform_name, "error": short(e)}


def rerun_command(a, skipped: list[tuple[str, str, str | None]]) -> str:
    phases = sorted({k for k, _, _ in skipped}, key=["tiny", "inference", "train"].index)
    models = [m for m in a.models if any(n == m for _, n, _ in skipped)]
    dtypes = [d for d in a.dtypes if any(dt == d for _, _, dt in skipped)]
    argv, replaced = list(sys.argv[1:]), ("--phases", "--models", "--dtypes", "--out", "--deadline")
    for flag in replaced:
        while flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
    argv = [x for x in argv if not x.startswith(tuple(f + "=" for f in replaced))]
    root, ext = os.path.splitext(a.out)
    extra = (["--phases", ",".join(phases)] + (["--models", ",".join(models)] if models else [])
             + (["--dtypes", ",".join(dtypes)] if dtypes else []) + ["--out", f"{root}-rest{ext}"])
    env = [f"PJRT_DEVICE={os.environ['PJRT_DEVICE']}"] if os.environ.get("PJRT_DEVICE") else []
    return " ".join(env + ["python3", "bench/gpu.py"] + argv + extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {','.join(MODELS)}")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma list: bfloat16,float32 (run in this order)")
    p.add_argument("--phases", default="tiny,inference,train", help="comma list of tiny,inference,train")
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="comma list of eager,inductor,fx2xla")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--deep-layers", type=int, default=24, help="layers of gpt2_deep")
    p.add_argument("--hidden", type=int, default=None, help="every model's width (default 768; LLaMA and MLP 1024)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per figure (at least 5 are run)")
    p.add_argument("--queued", type=int, default=20, help="N calls queued before one sync")
    p.add_argument("--profiled", type=int, default=5, help="K profiled calls for the kernel time (tiny: 50)")
    p.add_argument("--phase-budget", type=float, default=20.0, help="seconds of timed rounds per phase")
    p.add_argument("--deadline", type=float, default=420.0,
                   help="no phase starts after this many seconds from process start (0: no deadline)")
    p.add_argument("--keep-caches", action="store_true", help=f"keep the cache folders (under {tempfile.gettempdir()})")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu.json"))
    a = p.parse_args(argv)
    a.models, a.dtypes = a.models.split(","), a.dtypes.split(",")
    a.phases, a.contenders = a.phases.split(","), a.contenders.split(",")
    for flag, values, known in (("--models", a.models, MODELS), ("--phases", a.phases, ("tiny", "inference", "train")),
                                ("--contenders", a.contenders, CONTENDERS), ("--dtypes", a.dtypes, ("bfloat16", "float32", "float16"))):
        bad = [v for v in values if v not in known]
        if bad:
            p.error(f"{flag}: unknown {', '.join(bad)} (known: {', '.join(known)})")
    a.contenders = [c for c in CONTENDERS if c in a.contenders]  # a fixed order: eager, inductor, fx2xla
    for m in a.models:
        try:
            model_config(m, a)
        except ValueError as e:
            p.error(str(e))

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device")
    pjrt = os.environ.get("PJRT_DEVICE", "").strip().upper()
    if device.type == "cpu" and pjrt not in ("", "CPU"):
        log(f"WARNING: --device cpu with PJRT_DEVICE={pjrt}: fx2xla would run CPU tensors on {pjrt}")
    if device.type == "cuda" and pjrt in ("", "CPU"):
        log(f"note: PJRT_DEVICE={pjrt or 'unset'}; " + ("fx2xla runs on the device of its inputs (cuda)" if not pjrt
                                                     else "fx2xla will run on the CPU client: set PJRT_DEVICE=CUDA"))
    sync = make_sync(device)
    results: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "environment": environment(device),
                     "config": {k: v for k, v in vars(a).items()},
                     "cold_caches": {"inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                                     "fx2xla": os.environ.get("FX2XLA_CACHE_DIR"),
                                     "note": "fresh per phase; XLA's in-process autotuning results persist across phases"},
                     "figures": {"synced_s": "wall per call, sync after each call, median of interleaved rounds",
                                 "queued_s": "wall per call, N calls then one sync, median of rounds",
                                 "kernel_s": "GPU time of CUDA device events per call (torch.profiler); None on CPU",
                                 "host_overhead_s": "queued_s - kernel_s"},
                     "skipped": []}
    env = results["environment"]
    if "fx2xla" in a.contenders:
        results["jax_client"] = jax_client(device)
        if "error" in results["jax_client"]:
            log(f"WARNING: jax's {results['jax_client']['platform']} client did not start: "
                f"{results['jax_client']['error']} (fx2xla will fail; the others still run)")
    log(f"torch {env['torch']} (CUDA {env['torch_cuda']}), jax {env['jax']}, transformers {env['transformers']}, "
        f"device {env['device_name']}, PJRT_DEVICE={env['PJRT_DEVICE']}, jax client {results.get('jax_client')}")
    log(f"cold caches: Inductor {os.environ.get('TORCHINDUCTOR_CACHE_DIR')}, fx2xla {os.environ.get('FX2XLA_CACHE_DIR')}")

    plan: list[tuple[str, str, str | None]] = [("tiny", "tiny", None)] if "tiny" in a.phases else []
    for dt in a.dtypes:
        for kind in ("inference", "train"):
            if kind in a.phases:
                plan += [(kind, m, dt) for m in a.models]
    longest, skipped = 0.0, []
    for kind, name, dt in plan:
        key = "" if kind == "tiny" else f"{name}/{dt}"
        label = f"{kind} {key}".strip()
        elapsed = time.perf_counter() - PROCESS_START
        if a.deadline and elapsed + longest > a.deadline:
            skipped.append((kind, name, dt))
            results["skipped"].append(label)
            log(f"skip {label}: {elapsed:.0f} s gone, the longest phase took {longest:.0f} s, deadline {a.deadline:.0f} s")
            continue
        log(f"{label} ...")
        results["in_progress"] = label  # what a process killed mid-phase (timeout, abort) was doing
        write_json(a.out, results)
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            if kind == "tiny":
                r = phase_tiny(a, device, sync)
            elif kind == "inference":
                r = phase_inference(name, getattr(torch, dt), a, device, sync)
            else:
                r = phase_train(name, getattr(torch, dt), a, device, sync)
        except Exception as e:  # noqa: BLE001  (report and go on: one failing model must not hide the rest)
            r = {"error": short(e), "traceback": traceback.format_exc(limit=-8)}
            log(f"{label} FAILED: {short(e)}")
        r["wall_s"] = time.perf_counter() - t0
        r["load_average_1min"] = os.getloadavg()[0]  # above the core count, other processes skew the figures
        if device.type == "cuda":
            r["torch_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        if "fx2xla" in a.contenders:
            try:
                r["xla_device_memory"] = fx2xla.metrics()["device_memory"]
            except Exception:  # noqa: BLE001
                pass
        free_memory(device)
        longest = max(longest, r["wall_s"])
        results.pop("in_progress", None)
        if kind == "tiny":
            results["tiny"] = r
        else:
            results.setdefault(kind, {})[key] = r
        print_phase(label, r)
        results["targets"] = targets(results, a)
        write_json(a.out, results)
        log(f"{label} done in {r['wall_s']:.1f} s")

    summary(results)
    results["targets"] = targets(results, a)
    if results["targets"]:
        print("\ntargets of issue 13 (fx2xla / Inductor, where both were measured):")
        for t in results["targets"]:
            verdict = "PASS" if t["passed"] else "FAIL"
            value = f"{t['value']:.3f}" if t["value"] is not None else t.get("note", "")
            print(f"  {verdict}  {t['target']:52s} {t['case']:32s} {value} (limit {t['limit']})")
    if device.type != "cuda":
        print("\nkernel time and host overhead: n/a on the CPU (torch.profiler's CUDA activity needs a GPU)")
    if skipped:
        print(f"\nskipped for the deadline ({a.deadline:.0f} s): {', '.join(results['skipped'])}")
        print(f"run them (and any done phase of the same models and dtypes) with:\n  {rerun_command(a, skipped)}")
    results["total_s"] = time.perf_counter() - PROCESS_START
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out} (total {results['total_s']:.0f} s)", flush=True)
    if TMP_ROOT and not a.keep_caches:
        shutil.rmtree(TMP_ROOT, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
