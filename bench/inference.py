"""Inference latency of eager, Inductor and fx2xla, measured in one run.

    .venv/bin/python bench/inference.py [--models tiny,mlp,cnn,resnet,gpt2,bert,llama,gpt2_24l,mixtral,encoder] [--rounds 15]

Prints a table of medians and ratios (÷ eager, ÷ Inductor), the first call of each compiler
(Inductor with a fresh, cold TORCHINDUCTOR_CACHE_DIR), and fx2xla's per-call overhead on a
tiny graph next to eager, Inductor, Dynamo's own floor, a raw PJRT execute of the same
executable and two backends that do no more than jaxlib must (`per_call_overhead`); writes
raw numbers to bench/results/inference.json. The cost of the run-time index checks
(options={"check_indices": True}, the default) is the column `chk`: fx2xla with checks ÷ fx2xla
without, interleaved in the same rounds, and per call on a tiny embedding lookup.
Columns `b2b/e` and `b2b/i`: fx2xla ÷ eager and ÷ Inductor called back to back
(harness.back_to_back_medians: in each round each of the three runs once untimed, then
BACK_TO_BACK_CALLS times in a row), as a loop of requests calls one model; the main columns time
single calls that each follow another contender's, which costs eager and Inductor (kernels on
torch's OpenMP team, whose workers must wake or share the cores) more than fx2xla.
Column `tk`: fx2xla ÷ fx2xla with XLA's own CPU kernels (options={"torch_kernels": False}); `sl`
(models with convolutions): fx2xla ÷ the same executable with torch's kernels on whole batches
(fx2xla.torch_kernels.batch_slicing(False)); `pk` (the same models): fx2xla ÷ the same
executable with torch's convolutions reordering each weight on every call
(fx2xla.torch_kernels.weight_packing(False)); `ip` (the same models): fx2xla ÷ the same
executable with those packed convolutions computed into torch's own tensor and copied into
XLA's buffer (fx2xla.torch_kernels.in_place_writes(False)); `cl` (the same models): fx2xla ÷ fx2xla with
options={"channels_last": False} (batch norm, ReLU and pooling on NCHW values, transposed around
each convolution); `at` (models with attention): fx2xla ÷ fx2xla with options={"attention_op":
False} (torch's math decomposition of attention instead of fx2xla's rule on the one op); `lw`
(float32 models with nn.Linear): fx2xla ÷ fx2xla with options={"transposed_linear_weights":
False} (each weight read as torch holds it, [out, in], instead of a copy laid out [in, out]); `wl`
(the same models): fx2xla ÷ fx2xla with options={"linear_weight_lhs": False} (matmuls of 4-64 rows
as x . W^T instead of (W . x^T)^T; the models at 512 rows compute the same program either way).
`ww` (bf16/float16 models with nn.Linear): fx2xla ÷ fx2xla with
options={"widened_linear_weights": False} (each weight read in its own dtype by XLA:CPU's dot,
which converts it to float32 on every call, instead of a float32 copy made once).
`rc` (bf16/float16 models with convolutions): fx2xla ÷ fx2xla with torch's convolutions computed
the other way (fx2xla.torch_kernels.reduced_convolutions): in the dtype where this CPU widens them
to float32 (no bf16/float16 instructions), widened where it has them.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

# Cold Inductor and fx2xla caches for honest first-call figures; set before torch is imported.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
os.environ["FX2XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="fx2xla-cold-")  # cold first calls

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from harness import (back_to_back_medians, copied_out, fmt_time, interleaved_medians, timed_call, unpacked,  # noqa: E402
                     unsliced, write_json)

import fx2xla  # noqa: E402
from fx2xla.metrics import live_graphs  # noqa: E402
from fx2xla.testing import LogitsOnly, ModelCase, gpt2, mixtral, model_cases, token_ids  # noqa: E402


def cases() -> list[ModelCase]:
    """model_cases(), and, not in the default list, `gpt2_24l`: a 24-layer GPT-2 (hidden 256) at
    batch 1 x 128, whose layer stack fx2xla folds into one loop by default; `mixtral`: a 4-layer
    Mixtral (hidden 256, 8 experts, top 2) at batch 4 x 128, whose experts transformers computes
    with a grouped matmul; `encoder`: torch.nn.TransformerEncoder (6 layers, d_model 256, 8 heads,
    feed-forward 1024, eval) at batch 8 x 128, whose layers take torch's fused inference path
    (`_transformer_encoder_layer_fwd`) in eager and under no_grad, which fx2xla decomposes."""
    return [*model_cases(), ModelCase("gpt2_24l", lambda: LogitsOnly(gpt2(24, 256)), lambda: (token_ids(1, 128),)),
            ModelCase("mixtral", lambda: LogitsOnly(mixtral()), lambda: (token_ids(4, 128),)),
            ModelCase("encoder", nn_encoder, lambda: (torch.randn(8, 128, 256),))]


def nn_encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False).eval()


def tiny(x):
    return x * 2 + 1


def tiny_twins_all(x):  # the same graph, its own code object: compiled with FX2XLA_TWINS=all
    return x * 2 + 1


def tiny_imported(x):  # the same again: compiled with FX2XLA_STAGE_INPUTS=0
    return x * 2 + 1


def tiny_minimal(x):  # and again: compiled with minimal_backend (one code object per backend)
    return x * 2 + 1


def tiny_execute_only(x):  # and again: compiled with execute_only_backend
    return x * 2 + 1


def execute_only_backend(exe, buf):
    """A Dynamo backend whose call only runs the executable on a buffer XLA already holds and
    drops its results, returning its input: less than any backend can do and still compute."""

    def backend(gm, example_inputs):
        args = [buf]
        execute = exe.execute_sharded

        def call(x):
            execute(args)
            return (x,)

        return call

    return backend


def minimal_backend(launch, stage: torch.Tensor, buf):
    """A Dynamo backend doing the least a call through jaxlib can do: copy the input into
    `stage`, a tensor whose memory XLA holds as `buf`, then `launch` the executable on it
    (fx2xla's launcher: jaxlib's C++ result handlers, a DLPack export per result). No plan, no
    checks, no traceback pause, one thread only: a floor for any backend built on jaxlib's
    Python API, with Dynamo's frame and the caches a real call leaves around it."""

    def backend(gm, example_inputs):
        args = [buf]

        def call(x):
            stage.copy_(x)
            return launch(args)

        return call

    return backend


def compiled_with(fn, x, **env):
    """`fn` compiled with fx2xla and called once on `x` while the environment variables `env`
    are set (fx2xla reads them when a graph compiles), then restored."""
    previous = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        compiled = torch.compile(fn, backend="fx2xla", fullgraph=True)
        compiled(x)
    finally:
        for k, v in previous.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    return compiled


def per_call_overhead(rounds: int) -> dict:
    """fx2xla's whole call on a 4-element graph vs eager, Inductor, Dynamo's own floor (a
    backend returning `gm.forward`, and one whose graph computes nothing), fx2xla's compiled
    graph called directly (its whole per-call path, without Dynamo's frame), fx2xla keeping the
    result as a twin (FX2XLA_TWINS=all), fx2xla importing its input over DLPack on every call
    instead of staging it (FX2XLA_STAGE_INPUTS=0), and raw PJRT executes of fx2xla's executable on a resident
    buffer: the public `LoadedExecutable.execute` and fx2xla's launcher (the fast path it uses,
    including the DLPack export of the output), and the DLPack import of the input alone.
    `jaxlib_floor` adds Dynamo's empty call, the import and the raw execute, each timed hot on its
    own. Two backends run them as one call, alternating with Dynamo's code as a real call does:
    `jaxlib_execute_only` runs the executable on a held buffer and drops its results
    (`execute_only_backend`); `jaxlib_minimal` copies the input into a buffer XLA holds and
    launches the executable with fx2xla's launcher (`minimal_backend`), and
    `fx2xla_over_jaxlib_minimal` is what fx2xla's own code adds to it. Medians of interleaved
    rounds, in one run."""
    from fx2xla.runtime import default_device, executable_cache
    from fx2xla.runtime.executor import make_launcher
    from fx2xla.runtime.handoff import import_tensor

    x = torch.randn(4)
    torch._dynamo.reset()
    executable_cache.clear()
    compiled = torch.compile(tiny, backend="fx2xla", fullgraph=True)
    inductor = torch.compile(tiny, fullgraph=True)
    floor = torch.compile(tiny, backend=lambda gm, _: gm.forward, fullgraph=True)
    # Dynamo's own cost: a backend whose graph computes nothing (returns its input).
    empty = torch.compile(tiny, backend=lambda gm, _: (lambda *args: (args[0],)), fullgraph=True)
    before = {id(g) for g in live_graphs}
    compiled(x), inductor(x), floor(x), empty(x)
    graph = next(g for g in live_graphs if id(g) not in before)
    # The default keeps no twin of a CPU inference graph's result; FX2XLA_TWINS=all does (runtime/twins.py).
    twins_all = compiled_with(tiny_twins_all, x, FX2XLA_TWINS="all")
    # The default copies the small input into a buffer XLA holds; FX2XLA_STAGE_INPUTS=0 imports it.
    imported = compiled_with(tiny_imported, x, FX2XLA_STAGE_INPUTS="0")
    exe = next(iter(executable_cache._entries.values()))
    device = default_device().jax_device
    buf = import_tensor(x, device)
    launch = make_launcher(exe)
    stage = torch.empty_like(x)
    minimal = torch.compile(tiny_minimal, backend=minimal_backend(launch, stage, import_tensor(stage, device)),
                            fullgraph=True)
    got, want = minimal(x), tiny(x)
    if not torch.equal(got, want):  # exact: the same executable as fx2xla's
        raise AssertionError(f"jaxlib_minimal: {got} against eager's {want}")
    execute_only = torch.compile(tiny_execute_only, backend=execute_only_backend(exe, buf), fullgraph=True)
    execute_only(x)
    contenders = {"eager": tiny, "inductor": inductor, "dynamo_floor": floor, "dynamo_empty_backend": empty,
                  "fx2xla": compiled, "fx2xla_twins_all": twins_all, "fx2xla_input_imported": imported,
                  "fx2xla_graph_without_dynamo": graph.call_unboxed,
                  "raw_pjrt_execute": lambda _: exe.execute([buf]), "raw_fx2xla_launch": lambda _: launch([buf]),
                  "raw_dlpack_import": lambda t: import_tensor(t, device), "jaxlib_minimal": minimal,
                  "jaxlib_execute_only": execute_only}
    res = {}
    for clock_name, clock in (("wall", time.perf_counter), ("cpu", time.thread_time)):
        med = interleaved_medians(contenders, (x,), rounds=rounds, calls_per_round=2000, clock=clock)
        med["fx2xla_overhead_over_raw"] = med["fx2xla"] - med["raw_pjrt_execute"]
        med["fx2xla_overhead_over_dynamo_floor"] = med["fx2xla"] - med["dynamo_floor"]
        # What any call through jaxlib pays before fx2xla's own code: Dynamo's frame, one input's
        # DLPack import and the execute (the export and the output tensor not counted).
        med["jaxlib_floor"] = med["dynamo_empty_backend"] + med["raw_dlpack_import"] + med["raw_pjrt_execute"]
        med["fx2xla_over_jaxlib_minimal"] = med["fx2xla"] - med["jaxlib_minimal"]
        res[clock_name] = med
    # The index checks' per-call cost: one 8-id embedding lookup, checked and unchecked.
    table, ids = torch.randn(100, 16), torch.randint(0, 100, (8,))

    def lookup(i):
        return torch.nn.functional.embedding(i, table)

    res["embedding_lookup"] = index_check_cost(lookup, (ids,), rounds, calls_per_round=2000)
    return res


def index_check_cost(fn, args: tuple, rounds: int, calls_per_round: int = 1, budget_s: float | None = 30) -> dict:
    """fx2xla with index checks vs without on `fn`, interleaved in balanced orders: `ratio`
    (checked ÷ unchecked medians) and `delta_s` (the difference per call)."""
    torch._dynamo.reset()
    compiled = {"checked": torch.compile(fn, backend="fx2xla", fullgraph=True),
                "unchecked": torch.compile(fn, backend="fx2xla", fullgraph=True, options={"check_indices": False})}
    for c in compiled.values():
        c(*args)
    med = interleaved_medians(compiled, args, rounds=rounds, calls_per_round=calls_per_round, budget_s=budget_s)
    return {"ratio": med["checked"] / med["unchecked"], "delta_s": med["checked"] - med["unchecked"],
            "checked_s": med["checked"], "unchecked_s": med["unchecked"]}


def has_convolutions(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())


def has_linear(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Linear) for m in model.modules())


def has_attention(model: torch.nn.Module) -> bool:
    """A transformers model with attention layers (their class names end in "Attention")."""
    return any(type(m).__name__.endswith("Attention") for m in model.modules())


# Calls per timed run of the back-to-back medians (harness.back_to_back_medians).
BACK_TO_BACK_CALLS = 5


def bench_model(case, rounds: int, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = case.build().eval().to(dtype)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in case.make_inputs())
    res: dict = {}
    with torch.no_grad():
        torch._dynamo.reset()
        ref = model(*args)
        compiled = torch.compile(model, backend="fx2xla", fullgraph=True)
        res["fx2xla_first_call_s"] = timed_call(compiled, args)
        out = compiled(*args)
        res["max_abs_err"] = float((out.float() - ref.float()).abs().max())
        inductor = torch.compile(model, fullgraph=True)
        res["inductor_first_call_s"] = timed_call(inductor, args)
        # fx2xla with XLA's own CPU kernels only (no torch kernels inside the executable).
        xla_kernels = torch.compile(model, backend="fx2xla", fullgraph=True, options={"torch_kernels": False})
        xla_kernels(*args)
        contenders = {"eager": model, "inductor": inductor, "fx2xla": compiled, "fx2xla_xla_kernels": xla_kernels}
        if has_convolutions(model):
            contenders["fx2xla_unsliced"] = unsliced(compiled)
            contenders["fx2xla_unpacked"] = unpacked(compiled)
            contenders["fx2xla_copied_out"] = copied_out(compiled)
            # batch norm, ReLU and pooling on NCHW values, transposed around each convolution
            nchw = torch.compile(model, backend="fx2xla", fullgraph=True, options={"channels_last": False})
            nchw(*args)
            contenders["fx2xla_not_channels_last"] = nchw
            if dtype in (torch.bfloat16, torch.float16):
                # torch's convolutions computed the other way: in the dtype where fx2xla widens
                # them to float32 on this CPU, widened where it computes them in the dtype
                # (options given: a backend of its own, so Dynamo does not hand back `compiled`)
                other = torch.compile(model, backend="fx2xla", fullgraph=True, options={"torch_kernels": True})
                with fx2xla.torch_kernels.reduced_convolutions(dtype not in fx2xla.torch_kernels.convolution_dtypes()):
                    other(*args)  # lowered now, under the setting
                contenders["fx2xla_reduced_other_way"] = other
        if dtype == torch.float32 and has_linear(model):
            # nn.Linear weights read as torch holds them ([out, in]) instead of laid out [in, out]
            as_is = torch.compile(model, backend="fx2xla", fullgraph=True, options={"transposed_linear_weights": False})
            as_is(*args)
            contenders["fx2xla_linear_as_is"] = as_is
            # matmuls of a few rows as x . W^T, not with the weight on the dot's left
            rhs = torch.compile(model, backend="fx2xla", fullgraph=True, options={"linear_weight_lhs": False})
            rhs(*args)
            contenders["fx2xla_weight_rhs"] = rhs
        if dtype in (torch.bfloat16, torch.float16) and has_linear(model):
            # nn.Linear weights read in their own dtype, not through float32 copies
            narrow = torch.compile(model, backend="fx2xla", fullgraph=True, options={"widened_linear_weights": False})
            narrow(*args)
            contenders["fx2xla_not_widened"] = narrow
        if has_attention(model):
            # torch's math decomposition of attention instead of fx2xla's rule on the one op
            decomposed = torch.compile(model, backend="fx2xla", fullgraph=True, options={"attention_op": False})
            decomposed(*args)
            contenders["fx2xla_decomposed_attention"] = decomposed
        med = interleaved_medians(contenders, args, rounds=rounds, budget_s=60)
        b2b = back_to_back_medians({k: contenders[k] for k in ("eager", "inductor", "fx2xla")}, args,
                                   rounds=rounds, calls=BACK_TO_BACK_CALLS, budget_s=60)
        checks = index_check_cost(model, args, rounds)
    res.update({f"{k}_s": v for k, v in med.items()})
    res["fx2xla_vs_eager"] = med["fx2xla"] / med["eager"]
    res["fx2xla_vs_inductor"] = med["fx2xla"] / med["inductor"]
    res["inductor_vs_eager"] = med["inductor"] / med["eager"]
    res["first_call_vs_inductor"] = res["fx2xla_first_call_s"] / res["inductor_first_call_s"]
    res.update({f"{k}_back_to_back_s": v for k, v in b2b.items()})
    res["back_to_back_fx2xla_vs_eager"] = b2b["fx2xla"] / b2b["eager"]
    res["back_to_back_fx2xla_vs_inductor"] = b2b["fx2xla"] / b2b["inductor"]
    res["torch_kernels_ratio"] = med["fx2xla"] / med["fx2xla_xla_kernels"]
    if "fx2xla_unsliced" in med:
        res["batch_slicing_ratio"] = med["fx2xla"] / med["fx2xla_unsliced"]
    if "fx2xla_unpacked" in med:
        res["packed_weights_ratio"] = med["fx2xla"] / med["fx2xla_unpacked"]
    if "fx2xla_copied_out" in med:
        res["in_place_writes_ratio"] = med["fx2xla"] / med["fx2xla_copied_out"]
    if "fx2xla_not_channels_last" in med:
        res["channels_last_ratio"] = med["fx2xla"] / med["fx2xla_not_channels_last"]
    if "fx2xla_reduced_other_way" in med:
        res["reduced_convolutions_ratio"] = med["fx2xla"] / med["fx2xla_reduced_other_way"]
    if "fx2xla_linear_as_is" in med:
        res["linear_layout_ratio"] = med["fx2xla"] / med["fx2xla_linear_as_is"]
    if "fx2xla_weight_rhs" in med:
        res["weight_lhs_ratio"] = med["fx2xla"] / med["fx2xla_weight_rhs"]
    if "fx2xla_not_widened" in med:
        res["widened_weights_ratio"] = med["fx2xla"] / med["fx2xla_not_widened"]
    if "fx2xla_decomposed_attention" in med:
        res["attention_op_ratio"] = med["fx2xla"] / med["fx2xla_decomposed_attention"]
    res["index_checks"] = checks
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,mlp,cnn,resnet,gpt2,bert,llama")
    p.add_argument("--dtypes", default="float32", help="comma list: float32,bfloat16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "inference.json"))
    a = p.parse_args()
    wanted = a.models.split(",")
    results: dict = {"torch_threads": torch.get_num_threads(), "models": {}}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"Inductor cache {os.environ['TORCHINDUCTOR_CACHE_DIR']} (cold)")
    if "tiny" in wanted:
        o = per_call_overhead(a.rounds)
        results["tiny"] = o
        print("\nper-call overhead, 4-element graph x*2+1 (median per call; wall, and this thread's CPU time):")
        for k in o["wall"]:
            print(f"  {k:34s} {fmt_time(o['wall'][k])} {fmt_time(o['cpu'][k])}")
        e = o["embedding_lookup"]
        print(f"  index checks on an 8-id embedding lookup: {e['delta_s'] * 1e6:+.1f} us per call "
              f"({fmt_time(e['checked_s'])} checked vs {fmt_time(e['unchecked_s'])}; ratio {e['ratio']:.3f})")
    header = f"\n{'model':12s} {'eager':>11s} {'inductor':>11s} {'fx2xla':>11s} {'fx/eager':>9s} {'fx/ind':>7s} {'ind/eager':>9s} {'1st fx2xla':>11s} {'1st ind':>10s} {'max|err|':>9s} {'b2b/e':>6s} {'b2b/i':>6s} {'chk':>5s} {'tk':>5s} {'sl':>5s} {'pk':>5s} {'ip':>5s} {'cl':>5s} {'at':>5s} {'lw':>5s} {'wl':>5s} {'ww':>5s} {'rc':>5s}"
    print(header)
    for dt_name in a.dtypes.split(","):
        dtype = getattr(torch, dt_name)
        for case in cases():
            if case.name not in wanted:
                continue
            key = f"{case.name}/{dt_name}"
            try:
                r = bench_model(case, a.rounds, dtype)
            except Exception as e:  # report and go on: one failing model must not hide the rest
                print(f"{key:12s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
                results["models"][key] = {"error": str(e)}
                continue
            results["models"][key] = r
            print(f"{key:12s} {fmt_time(r['eager_s'])} {fmt_time(r['inductor_s'])} {fmt_time(r['fx2xla_s'])} "
                  f"{r['fx2xla_vs_eager']:9.2f} {r['fx2xla_vs_inductor']:7.2f} {r['inductor_vs_eager']:9.2f} "
                  f"{fmt_time(r['fx2xla_first_call_s'])} {fmt_time(r['inductor_first_call_s'])} {r['max_abs_err']:9.2e} "
                  f"{r['back_to_back_fx2xla_vs_eager']:6.2f} {r['back_to_back_fx2xla_vs_inductor']:6.2f} "
                  f"{r['index_checks']['ratio']:5.2f} {r['torch_kernels_ratio']:5.2f} "
                  f"{r.get('batch_slicing_ratio', float('nan')):5.2f} {r.get('packed_weights_ratio', float('nan')):5.2f} "
                  f"{r.get('in_place_writes_ratio', float('nan')):5.2f} "
                  f"{r.get('channels_last_ratio', float('nan')):5.2f} "
                  f"{r.get('attention_op_ratio', float('nan')):5.2f} {r.get('linear_layout_ratio', float('nan')):5.2f} "
                  f"{r.get('weight_lhs_ratio', float('nan')):5.2f} {r.get('widened_weights_ratio', float('nan')):5.2f} "
                  f"{r.get('reduced_convolutions_ratio', float('nan')):5.2f}")
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
