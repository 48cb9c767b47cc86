"""FlexAttention per call: eager's dense path, Inductor's generated kernel and fx2xla, in one run.

    .venv/bin/python bench/flex_attention.py                                 # CPU: inference
    PJRT_DEVICE=CUDA python3 bench/flex_attention.py --dtype bfloat16        # GPU: inference and training
    .venv/bin/python bench/flex_attention.py --seqs 128 --heads 2 --rounds 3 --phase-budget 2   # smoke run

One phase per (mask, sequence length, inference/training): `flex_attention(q, k, v,
score_mod=soft cap 30 * tanh(s / 30), block_mask=...)` on q [batch, heads, seq, dim] and k, v with
`--kv-heads` heads (grouped-query attention), the block mask built once by `create_block_mask`
(masks: causal, a sliding window of 256 keys, causal within documents of 512 tokens read from a
captured tensor). Contenders: eager (torch's unfused dense path, as flex_attention runs without
torch.compile), Inductor (`torch.compile(fn)`) and fx2xla, each a `torch.compile(fn,
fullgraph=True)` of the same function. Training (CUDA only: torch refuses flex_attention's
backward on the CPU for every backend) times the compiled forward and loss
`out.float().square().mean()`, then its backward to q, k and v outside the compiled function, as
a training loop runs it.

Per contender: the first call, and bench/gpu.py's three figures (synced wall, queued wall,
kernel time on CUDA), medians of interleaved rounds, with ratios fx2xla / eager and fx2xla /
Inductor; fx2xla's and Inductor's largest difference from eager's output (inference) or
gradients (training), and every contender's from a float64 truth (eager's dense path on float64
copies of q, k and v, where the phase has at most 2^27 scores), which says which side of a
difference from eager is off. Raw numbers go to --out (bench/results/flex_attention.json).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu  # noqa: E402  (the three figures, first calls, ratios, printing)
from harness import write_json  # noqa: E402

WINDOW, DOCUMENT = 256, 512


def softcap(score, b, h, q, kv):
    return 30 * torch.tanh(score / 30)


def make_mask(name: str, seq: int, device):
    if name == "causal":
        def mask(b, h, q, kv):
            return q >= kv
    elif name == "window":
        def mask(b, h, q, kv):
            return (q >= kv) & (q - kv < WINDOW)
    elif name == "document":
        doc = torch.arange(seq, device=device) // DOCUMENT

        def mask(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)
    else:
        raise ValueError(f"unknown mask {name!r}")
    return create_block_mask(mask, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device=device)


def make_fn(block_mask, gqa: bool, train: bool):
    """The function each contender compiles: flex_attention, or (training) its loss, whose
    backward runs outside the compiled function, as a training loop's does (Dynamo does not
    trace `.backward()`)."""
    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=softcap, block_mask=block_mask, enable_gqa=gqa)

    def loss(q, k, v):
        return fn(q, k, v).float().square().mean()
    return loss if train else fn


def make_call(compiled, q, k, v, train: bool):
    """One timed call: the forward, and in training the backward to q, k and v (the loss is
    returned, for the synchronization)."""
    if not train:
        return lambda: compiled(q, k, v)

    def step():
        for t in (q, k, v):
            t.grad = None
        value = compiled(q, k, v)
        value.backward()
        return value.detach()
    return step


def lift_cpu_refusal() -> None:
    """Let flex_attention's backward run on the CPU: torch refuses it there for every backend
    (the check `_validate_device`, torch 2.5-2.13), though eager's dense math and the compiled
    backends compute it. A bench option, for CPU training figures; never done by fx2xla."""
    import torch.nn.attention.flex_attention as flex_module
    if not hasattr(flex_module, "_validate_device"):
        raise SystemExit("--cpu-training: this torch has no flex_attention._validate_device to lift")
    flex_module._validate_device = lambda *args, **kwargs: None


# Scores in a phase's float64 truth at most (1 GiB of them): larger phases go without.
TRUTH_MAX_SCORES = 1 << 27


def float64_truth(fn, q, k, v, train: bool):
    """eager's dense path on float64 copies of q, k and v: its output, or in training the
    gradients of the loss to q, k and v."""
    q64, k64, v64 = (t.detach().double().requires_grad_(train) for t in (q, k, v))
    out = fn(q64, k64, v64)
    if not train:
        return [out.detach()]
    out.backward()
    return [t.grad.detach() for t in (q64, k64, v64)]


def max_rel_err(result, ref) -> float:
    """The largest |result - ref| over the tensors, relative to the largest |ref| (in float64)."""
    err = max(float((x.double() - y.double()).abs().max()) for x, y in zip(result, ref))
    scale = max(float(y.double().abs().max()) for y in ref)
    return err / scale if scale else err


def phase(mask_name: str, seq: int, train: bool, a, device, dtype, sync) -> dict:
    # Each phase compiles afresh: its first calls are true first calls, and the phases' masks
    # (new mask_mod functions, new shapes) do not pile up recompilations of one `fn` past
    # Dynamo's recompile limit.
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (a.batch, a.heads, seq, a.dim), (a.batch, a.kv_heads, seq, a.dim)
    q, k, v = (torch.randn(s, generator=gen).to(device, dtype).requires_grad_(train)
               for s in (shape_q, shape_kv, shape_kv))
    block_mask = make_mask(mask_name, seq, device)
    fn = make_fn(block_mask, a.heads != a.kv_heads, train)
    res: dict = {"mask": mask_name, "seq": seq, "train": train, "sparsity_percent": block_mask.sparsity(),
                 "contenders": {}}
    errors: dict = {}
    fns, ref, truth = {}, None, None
    if a.batch * a.heads * seq * seq <= TRUTH_MAX_SCORES:
        truth = float64_truth(fn, q, k, v, train)

    def grads():
        return [t.grad.detach().clone() for t in (q, k, v)]

    with gpu.cold_caches():
        for c in a.contenders:
            call_fn = fn if c == "eager" else torch.compile(fn, backend=gpu.BACKENDS[c], fullgraph=True)
            call = make_call(call_fn, q, k, v, train)
            out = gpu.first_call(c, call, sync, res, errors)
            if out is None:
                continue
            result = grads() if train else [out.detach().clone()]  # a copy: nothing later can write it
            if truth is not None:
                res[f"{c}_max_rel_err_f64"] = max_rel_err(result, truth)
                gpu.log(f"  {c} vs float64: max|err| relative to max|truth| {res[f'{c}_max_rel_err_f64']:.2e}")
            if c == "eager":
                ref = result
            elif ref is not None:
                err = max(gpu.max_abs(x, y)[0] for x, y in zip(result, ref))
                res[f"{c}_max_abs_err"], res[f"{c}_max_rel_err"] = err, max_rel_err(result, ref)
                gpu.log(f"  {c} vs eager: max|err| {err:.2e} (relative to max|eager| {res[f'{c}_max_rel_err']:.2e})")
            if gpu.warm(c, call, sync, res, errors):
                fns[c] = call
        gpu.steady_state(res, fns, sync, a, device, errors)
    gpu.add_ratios(res)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--masks", default="causal,window,document")
    p.add_argument("--seqs", default="1024,4096", help="comma list of sequence lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: heads / 4 (at least 1)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--modes", default=None, help="infer,train (default: both on CUDA, infer on the CPU)")
    p.add_argument("--contenders", default="eager,inductor,fx2xla")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--queued", type=int, default=5)
    p.add_argument("--profiled", type=int, default=3)
    p.add_argument("--phase-budget", type=float, default=30.0, help="seconds of timed rounds per phase")
    p.add_argument("--cpu-training", action="store_true",
                   help="allow training phases on the CPU by lifting torch's refusal of flex_attention's backward "
                        "there (torch.nn.attention.flex_attention._validate_device), for every contender")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "flex_attention.json"))
    a = p.parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    a.kv_heads = a.kv_heads or max(1, a.heads // 4)
    a.contenders = [c for c in ("eager", "inductor", "fx2xla") if c in a.contenders.split(",")]
    modes = (a.modes or ("infer,train" if device.type == "cuda" else "infer")).split(",")
    if device.type == "cpu" and "train" in modes:
        if not a.cpu_training:
            p.error("training phases need CUDA: torch refuses flex_attention's backward on the CPU "
                    "(--cpu-training lifts that refusal)")
        lift_cpu_refusal()
    sync = gpu.make_sync(device)
    results: dict = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "dtype": str(dtype),
                     "batch": a.batch, "heads": a.heads, "kv_heads": a.kv_heads, "dim": a.dim,
                     "environment": gpu.environment(device), "phases": {}}
    t0 = time.perf_counter()
    for mode in modes:
        for seq in (int(s) for s in a.seqs.split(",")):
            for mask in a.masks.split(","):
                key = f"{mode} {mask} {seq}"
                gpu.log(f"{key}: batch {a.batch}, heads {a.heads}/{a.kv_heads}, dim {a.dim}, {dtype}")
                try:
                    res = phase(mask, seq, mode == "train", a, device, dtype, sync)
                except Exception as e:  # noqa: BLE001  (report the phase and go on)
                    res = {"error": gpu.short(e)}
                results["phases"][key] = res
                gpu.print_phase(key, res)
                write_json(a.out, results)
    results["seconds"] = time.perf_counter() - t0
    write_json(a.out, results)
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
