"""LLaMA decoding with a static KV cache: transformers `generate`, eager vs Inductor vs fx2xla.

    .venv/bin/python bench/decode.py [--batches 1,8] [--new-tokens 64] [--rounds 7] [--dtype bfloat16]
        [--max-cache-len N]

The model is fx2xla.testing.llama() (4 layers x 256, 4 heads, 2 KV heads, vocab 1000: the
configuration bench/inference.py uses), random weights. Each contender is its own copy of the
model (the same weights) and decodes greedily with `cache_implementation="static"`, as users of
transformers compile generation: the prompt (16 tokens) runs eagerly, and transformers compiles
the decode step (`CompileConfig(backend=..., fullgraph=True)`; on CPU that needs its
`_compile_all_devices` flag) -- "eager" passes `disable_compile=True`. `min_new_tokens` makes
every call decode exactly `--new-tokens` tokens. `--max-cache-len N` sizes the static cache
for N positions (generate's `max_cache_len`; by default prompt + new tokens): every step's
attention reads all N, as a server's cache sized for its longest request does.

Measured per batch size, in one process: the first call of each (its compiles; Inductor with a
cold TORCHINDUCTOR_CACHE_DIR, fx2xla with a cold FX2XLA_CACHE_DIR), then whole `generate`
calls of the three interleaved in rounds in balanced orders (bench/harness.py), with a short
sleep before each so one contender's spinning thread pool does not take the cores from the
next: medians, tokens/s (batch x new tokens / median), the ratios, and the process CPU time
per call (less sensitive than wall time to other processes on a shared machine), and the
compiled decode step alone (transformers' compiled call, timed around each call: the median
step of each timed `generate`, then the median of those). Checked:
every contender's generated ids against eager's, and fx2xla's and Inductor's logits at every
step against eager's (one untimed call with output_logits=True).

`--no-skinny` adds a fourth contender, "fx2xla:no-skinny": fx2xla without the kernel library's
one-row bf16 matmul (option torch_kernels without "skinny_matmul"), which gives such a matmul to XLA's dot
as two rows instead. `--not-in-place` adds "fx2xla:not-in-place": fx2xla with FX2XLA_INPLACE=0
while it compiles, so each step writes the whole KV cache to a new buffer instead of updating
it where it is (runtime/inplace.py). `--decomposed-attention` adds "fx2xla:decomposed-attention":
fx2xla with options={"attention_op": False}: torch's math decomposition of attention, which
scales the whole K cache and copies K and V once per query head every step. `--linear-as-is` adds
"fx2xla:linear-as-is": fx2xla with options={"transposed_linear_weights": False}, which reads
each nn.Linear weight as torch holds it ([out, in]) instead of a copy laid out [in, out].
`--unmerged` adds "fx2xla:unmerged": fx2xla with options={"merge_linears": False}, one matmul per
nn.Linear instead of one for the q/k/v projections and one for gate and up. `--imported-inputs`
adds "fx2xla:imported-inputs": fx2xla with FX2XLA_STAGE_INPUTS=0 while it compiles, so each step
imports its small fresh inputs (ids, positions, mask) over DLPack instead of copying them into
buffers XLA holds. `--weight-rhs` adds "fx2xla:weight-rhs": fx2xla with
options={"linear_weight_lhs": False}, which computes each matmul of 4-64 rows as x . W^T instead
of (W . x^T)^T (batch 8; batch 1 is one row, the same program either way). `--no-few-rows` adds
"fx2xla:no-few-rows": fx2xla without the kernel library's few-row float32 matmul (option
torch_kernels=["convolution", "skinny_matmul", "attention"]), which computes the 2-8 row
matmuls of a step at batch 2-8 with the weight on the dot's left instead. `--no-decode-attention`
adds "fx2xla:no-decode-attention": fx2xla without the kernel library's float32 decode attention
(option torch_kernels without "decode_attention"), which leaves a step's attention to XLA's dots.
`--helpers` adds "fx2xla:helpers": fx2xla with FX2XLA_HELPER_THREADS=1 while it compiles, so
that a step's few-row matmuls hand their parts to the kernel library's helper threads
(torch_kernels.run_helped) instead of XLA's pool, whose threads must be woken; at batch 1 both run
the same program. `--park-region` adds "fx2xla:park-region": fx2xla parking torch's spinning
OpenMP workers inside a parallel region of their team (torch_kernels.park_signals(False), the
way before parking by signal) for each of its calls; its end waits for a worker's wake-up and
leaves the worker spinning again, so the next step parks it again. `--split-sleep` adds
"fx2xla:split-sleep": fx2xla with the kernel library's split matmuls sleeping at once until the
parts other threads run are done (torch_kernels.split_spin(False)), where by default the caller
polls for up to twice its own parts' time first.

`--split` also takes fx2xla's step apart at each batch size: per step, fx2xla's graph (its
`CompiledGraph` call) and, inside it, the executable's launch through the export of its results;
the rest of a token (`generate`'s Python, Dynamo's guards, transformers' wrappers) is what every
contender pays. It then times XLA reading the model's weights once, as sums of each weight in
one executable: hot (the same weights every call, as a step finds them if they stayed in the
caches) and from memory (four copies in turn). From these it prints the executable time that
1.25x Inductor's tokens/s would need, with everything else in the token as measured.

Writes bench/results/decode.json.
"""
from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import tempfile
import time

# Cold compiler caches for honest first calls; set before torch is imported.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-cold-"))
os.environ["FX2XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="fx2xla-cold-")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from harness import balanced_orders, write_json  # noqa: E402

import fx2xla  # noqa: E402,F401  (registers the backend)
from fx2xla.testing import llama  # noqa: E402

CONTENDERS = ("eager", "inductor", "fx2xla")
# Contenders compiled with an fx2xla switch set to 0 during their first call, when their graphs
# are planned and their executors made.
COMPILE_ENV = {"fx2xla:not-in-place": ("FX2XLA_INPLACE", "0"), "fx2xla:imported-inputs": ("FX2XLA_STAGE_INPUTS", "0"),
               "fx2xla:helpers": ("FX2XLA_HELPER_THREADS", "1")}


def compile_config(backend: str, options: dict | None = None):
    from transformers import CompileConfig

    # mode=None: torch.compile's default for both (transformers' default, "reduce-overhead",
    # asks Inductor for CUDA graphs, which a CPU does not have).
    config = CompileConfig(backend=backend, fullgraph=True, mode=None, options=options)
    config._compile_all_devices = True  # transformers compiles the decode step on CPUs only when asked
    return config


def contenders(args) -> tuple:
    return (CONTENDERS + (("fx2xla:no-skinny",) if args.no_skinny else ())
            + (("fx2xla:not-in-place",) if args.not_in_place else ())
            + (("fx2xla:decomposed-attention",) if args.decomposed_attention else ())
            + (("fx2xla:linear-as-is",) if args.linear_as_is else ())
            + (("fx2xla:unmerged",) if args.unmerged else ())
            + (("fx2xla:imported-inputs",) if args.imported_inputs else ())
            + (("fx2xla:weight-rhs",) if args.weight_rhs else ())
            + (("fx2xla:no-few-rows",) if args.no_few_rows else ())
            + (("fx2xla:no-decode-attention",) if args.no_decode_attention else ())
            + (("fx2xla:helpers",) if args.helpers else ())
            + (("fx2xla:xla-attention",) if args.xla_attention else ())
            + (("fx2xla:park-region",) if args.park_region else ())
            + (("fx2xla:split-sleep",) if args.split_sleep else ()))


# Variants reported as fx2xla ÷ the variant (tokens/s, CPU time, step time), under keys named
# after them: "fx2xla:park-region" gives fx2xla_vs_park_region_*.
AGAINST_FX2XLA = ("fx2xla:imported-inputs", "fx2xla:no-few-rows", "fx2xla:no-decode-attention", "fx2xla:weight-rhs",
                  "fx2xla:xla-attention", "fx2xla:park-region", "fx2xla:split-sleep")


def _slug(name: str) -> str:
    return name.split(":")[1].replace("-", "_")


_step_times: dict = {}  # id(model) -> seconds of each compiled decode step it ran


def _timed_compiled_calls() -> None:
    """Wraps transformers' compiled decode step (`get_compiled_call`) so that each call's wall
    time is recorded per model: the step alone, without generate's Python around it."""
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.get_compiled_call
    if getattr(original, "_timed", False):
        return

    def get_compiled_call(self, compile_config):
        call = original(self, compile_config)
        times = _step_times.setdefault(id(self), [])

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = call(*args, **kwargs)
            times.append(time.perf_counter() - t0)
            return out

        return timed

    get_compiled_call._timed = True
    PreTrainedModel.get_compiled_call = get_compiled_call


def make_generate(model, name: str, ids, new_tokens: int, max_cache_len: int | None = None):
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, cache_implementation="static", pad_token_id=0)
    if max_cache_len:
        kw["max_cache_len"] = max_cache_len
    if name == "eager":
        kw["disable_compile"] = True
    else:
        # Options make Dynamo keep this contender's compiled step apart from fx2xla's.
        without = {"fx2xla:no-skinny": "skinny_matmul", "fx2xla:xla-attention": "attention",
                   "fx2xla:no-few-rows": "few_rows_matmul", "fx2xla:no-decode-attention": "decode_attention"}
        options = ({"torch_kernels": [k for k in fx2xla.torch_kernels.KINDS if k != without[name]]} if name in without
                   else {"fallback": "eager"} if name == "fx2xla:not-in-place"
                   else {"attention_op": False} if name == "fx2xla:decomposed-attention"
                   else {"transposed_linear_weights": False} if name == "fx2xla:linear-as-is"
                   else {"merge_linears": False} if name == "fx2xla:unmerged"
                   else {"linear_weight_lhs": False} if name == "fx2xla:weight-rhs"
                   # the default's value: a backend of its own, so that Dynamo compiles it apart
                   else {"check_indices": True} if name == "fx2xla:imported-inputs"
                   else {"no_recompile": False} if name == "fx2xla:helpers" else None)
        kw["compile_config"] = compile_config(name.split(":")[0], options)

    def generate(**extra):
        with torch.no_grad():
            return model.generate(ids, **kw, **extra)

    if name == "fx2xla:park-region":
        def generate_region(**extra):
            with fx2xla.torch_kernels.park_signals(False):
                return generate(**extra)

        return generate_region
    if name == "fx2xla:split-sleep":
        def generate_sleeping(**extra):
            with fx2xla.torch_kernels.split_spin(False):
                return generate(**extra)

        return generate_sleeping
    return generate


def load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


class StepSplit:
    """Times fx2xla's decode-step graph per call, and its executable's launch (through the
    export of its results) inside it: the graph that ran most in the call `watch` is given."""

    def __init__(self):
        from fx2xla.compiled_graph import CompiledGraph

        self.graph_s: list = []
        self.launch_s: list = []
        self._graph = None
        self._launches: list = []  # (specialization, its own launch)
        original = CompiledGraph.__call__
        split = self

        def call(graph, args):
            t0 = time.perf_counter()
            out = original(graph, args)
            if graph is split._graph:
                split.graph_s.append(time.perf_counter() - t0)
            return out

        self._restore = lambda: setattr(CompiledGraph, "__call__", original)
        CompiledGraph.__call__ = call

    def watch(self, call):
        from fx2xla.metrics import live_graphs

        before = {id(g): g.executor.executions for g in live_graphs if getattr(g, "executor", None)}
        call()
        graph = max((g for g in live_graphs if getattr(g, "executor", None)),
                    key=lambda g: g.executor.executions - before.get(id(g), 0))
        # a static graph's one executable, or a dynamic one's per signature
        specs = [graph.static] if graph.static is not None else list(graph._specializations.values())
        for spec in specs:
            launch = spec.launch

            def timed(bufs, launch=launch):
                t0 = time.perf_counter()
                out = launch(bufs)
                self.launch_s.append(time.perf_counter() - t0)
                return out

            self._launches.append((spec, launch))
            spec.launch = timed
        self._graph = graph

    def close(self):
        for spec, launch in self._launches:
            spec.launch = launch
        self._restore()


def weight_read_s(model, calls: int = 200) -> dict:
    """XLA reading every parameter of `model` once, a sum of each in one executable: the median
    per call hot (one set of weights every call) and from memory (four copies in turn), less
    the median call of the same executable on one-element arrays (its launch)."""
    import jax
    import jax.numpy as jnp

    weights = [p.detach().float().numpy() for p in model.parameters()]
    read = jax.jit(lambda ws: [w.sum() for w in ws])
    sets = [[jax.device_put(w.copy()) for w in weights] for _ in range(4)]
    tiny = [jnp.zeros((1,), jnp.float32) for _ in weights]

    def median(pick) -> float:
        times = []
        for i in range(calls):
            ws = pick(i)
            t0 = time.perf_counter()
            jax.block_until_ready(read(ws))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    median(lambda i: sets[i % 4])  # compiled, and the copies touched once
    launch = median(lambda i: tiny)
    return {"hot_s": median(lambda i: sets[0]) - launch, "from_memory_s": median(lambda i: sets[i % 4]) - launch,
            "launch_s": launch, "weight_bytes": sum(w.nbytes for w in weights)}


def bench_batch(batch: int, args) -> dict:
    # Each batch starts from no compiled code: the previous batches' graphs (and the Dynamo cache
    # entries every call would check first) made later batches slower for fx2xla than run alone.
    torch._dynamo.reset()
    gc.collect()
    torch.manual_seed(0)
    base = llama(layers=args.layers, hidden=args.hidden).eval().to(getattr(torch, args.dtype))
    ids = torch.randint(1, base.config.vocab_size, (batch, args.prompt), generator=torch.Generator().manual_seed(1))
    names = contenders(args)
    models = {name: copy.deepcopy(base) for name in names}
    gens = {name: make_generate(models[name], name, ids, args.new_tokens, args.max_cache_len) for name in names}
    res: dict = {"batch": batch, "dtype": args.dtype, "prompt": args.prompt, "new_tokens": args.new_tokens,
                 "max_cache_len": args.max_cache_len, "first_call_s": {}}
    outs = {}
    for name in names:  # first calls: the compiles (Dynamo, and the backend's)
        env, value = COMPILE_ENV.get(name, (None, None))
        if env:
            os.environ[env] = value
        t0 = time.perf_counter()
        outs[name] = gens[name]()
        res["first_call_s"][name] = time.perf_counter() - t0
        if env:
            os.environ.pop(env, None)
    # Numerics: ids against eager's; every step's logits against eager's.
    res["ids_match_eager"] = {n: bool(torch.equal(outs[n], outs["eager"])) for n in names}
    logits = {n: torch.stack(gens[n](output_logits=True, return_dict_in_generate=True).logits) for n in names}
    res["max_abs_logit_err_vs_eager"] = {n: float((logits[n] - logits["eager"]).abs().max()) for n in names}
    res["logit_scale"] = float(logits["eager"].abs().max())
    try:
        res["fx2xla_metrics"] = {k: v for k, v in fx2xla.metrics().items() if isinstance(v, (int, float))}
    except Exception:  # metrics are informative only
        pass
    for g in gens.values():  # one warm call each
        g()
    split = None
    if args.split:
        split = StepSplit()
        split.watch(gens["fx2xla"])  # the graph that runs most in a call: the decode step's
    orders = [[names[i] for i in row] for row in balanced_orders(len(names))]
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    steps = {n: [] for n in names}  # per timed call: the median of its compiled steps
    graph_steps, launch_steps = [], []  # --split: fx2xla's per timed call, medians of its steps
    for r in range(args.rounds):
        for name in orders[r % len(orders)]:
            time.sleep(args.gap_ms / 1e3)
            step_times = _step_times.setdefault(id(models[name]), [])
            step_times.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            if split is not None and name == "fx2xla":
                g0, l0 = len(split.graph_s), len(split.launch_s)
            gens[name]()
            wall[name].append(time.perf_counter() - t0)
            if split is not None and name == "fx2xla":
                graph_steps.append(statistics.median(split.graph_s[g0:]))
                launch_steps.append(statistics.median(split.launch_s[l0:]))
            if step_times:
                steps[name].append(statistics.median(step_times))
            cpu[name].append(time.process_time() - c0)
    med = {n: statistics.median(v) for n, v in wall.items()}
    cmed = {n: statistics.median(v) for n, v in cpu.items()}
    tokens = batch * args.new_tokens
    res.update(median_s=med, cpu_median_s=cmed, samples_s=wall,
               tokens_per_s={n: tokens / med[n] for n in names},
               cpu_tokens_per_s={n: tokens / cmed[n] for n in names},
               fx2xla_vs_inductor_tokens_per_s=med["inductor"] / med["fx2xla"],
               fx2xla_vs_eager_tokens_per_s=med["eager"] / med["fx2xla"],
               inductor_vs_eager_tokens_per_s=med["eager"] / med["inductor"],
               fx2xla_vs_inductor_cpu=cmed["inductor"] / cmed["fx2xla"], load=load())
    if "fx2xla:not-in-place" in med:
        res["fx2xla_vs_not_in_place_tokens_per_s"] = med["fx2xla:not-in-place"] / med["fx2xla"]
    if "fx2xla:decomposed-attention" in med:
        res["fx2xla_vs_decomposed_attention_tokens_per_s"] = med["fx2xla:decomposed-attention"] / med["fx2xla"]
        res["fx2xla_vs_decomposed_attention_cpu"] = cmed["fx2xla:decomposed-attention"] / cmed["fx2xla"]
    if "fx2xla:no-skinny" in med:
        res["fx2xla_vs_no_skinny_tokens_per_s"] = med["fx2xla:no-skinny"] / med["fx2xla"]
    if "fx2xla:linear-as-is" in med:
        res["fx2xla_vs_linear_as_is_tokens_per_s"] = med["fx2xla:linear-as-is"] / med["fx2xla"]
        res["fx2xla_vs_linear_as_is_cpu"] = cmed["fx2xla:linear-as-is"] / cmed["fx2xla"]
    smed = {n: statistics.median(v) for n, v in steps.items() if v}
    res["step_median_s"] = smed
    if "fx2xla" in smed and "inductor" in smed:
        res["fx2xla_vs_inductor_step"] = smed["fx2xla"] / smed["inductor"]
    if "fx2xla:unmerged" in med:
        res["fx2xla_vs_unmerged_step"] = smed["fx2xla"] / smed["fx2xla:unmerged"]
        res["fx2xla_vs_unmerged_tokens_per_s"] = med["fx2xla:unmerged"] / med["fx2xla"]
        res["fx2xla_vs_unmerged_cpu"] = cmed["fx2xla:unmerged"] / cmed["fx2xla"]
    if "fx2xla:helpers" in med:
        res["helpers_vs_fx2xla_tokens_per_s"] = med["fx2xla"] / med["fx2xla:helpers"]
        res["helpers_vs_fx2xla_cpu"] = cmed["fx2xla"] / cmed["fx2xla:helpers"]
        res["helpers_vs_fx2xla_step"] = smed["fx2xla:helpers"] / smed["fx2xla"]
    for name in AGAINST_FX2XLA:  # fx2xla ÷ each variant: tokens/s and CPU time as ratios of rates, step times
        if name in med:
            slug = _slug(name)
            res[f"fx2xla_vs_{slug}_tokens_per_s"] = med[name] / med["fx2xla"]
            res[f"fx2xla_vs_{slug}_cpu"] = cmed[name] / cmed["fx2xla"]
            res[f"fx2xla_vs_{slug}_step"] = smed["fx2xla"] / smed[name]
    if split is not None:
        split.close()
        res["split"] = step_split(res, med, graph_steps, launch_steps, weight_read_s(models["fx2xla"]), args)
        res["split"].update(graph_calls=len(split.graph_s), launch_calls=len(split.launch_s))
    return res


def step_split(res, med, graph_steps, launch_steps, floor, args) -> dict:
    """--split's figures, in seconds: per new token (the `generate` call's median over its new
    tokens) and, for the graph and its launch, per decode step (see the module docstring)."""
    steps = args.new_tokens  # generate's timed call: the prompt's eager call, then new_tokens - 1 steps
    token = med["fx2xla"] / steps
    graph, launch = statistics.median(graph_steps), statistics.median(launch_steps)
    needed = med["inductor"] / steps / 1.25 - (token - launch)  # the executable 1.25x would need
    return {"token_s": token, "inductor_token_s": med["inductor"] / steps, "graph_s": graph, "launch_s": launch,
            "graph_rest_s": graph - launch, "outside_graph_s": token - graph,
            "step_s": res["step_median_s"].get("fx2xla"), "needed_launch_for_1_25x_s": needed,
            "weight_read": floor}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dtype", default="float32", help="the model's dtype: float32 or bfloat16")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-skinny", action="store_true", help="also time fx2xla without its one-row bf16 matmul kernel")
    p.add_argument("--not-in-place", action="store_true",
                   help="also time fx2xla writing the KV cache to new buffers (FX2XLA_INPLACE=0)")
    p.add_argument("--decomposed-attention", action="store_true",
                   help="also time fx2xla with torch's math decomposition of attention (option attention_op=False)")
    p.add_argument("--linear-as-is", action="store_true",
                   help="also time fx2xla reading nn.Linear weights as torch holds them "
                        "(option transposed_linear_weights=False)")
    p.add_argument("--unmerged", action="store_true",
                   help="also time fx2xla with one matmul per nn.Linear (option merge_linears=False)")
    p.add_argument("--imported-inputs", action="store_true",
                   help="also time fx2xla importing every fresh input over DLPack (FX2XLA_STAGE_INPUTS=0)")
    p.add_argument("--xla-attention", action="store_true",
                   help="also time fx2xla computing attention with XLA's dots instead of torch's flash-attention "
                        "kernel (option torch_kernels without 'attention')")
    p.add_argument("--park-region", action="store_true",
                   help="also time fx2xla parking torch's workers in a parallel region instead of by signal "
                        "(torch_kernels.park_signals(False))")
    p.add_argument("--split-sleep", action="store_true",
                   help="also time fx2xla with split matmuls sleeping at once for their other parts "
                        "(torch_kernels.split_spin(False))")
    p.add_argument("--no-few-rows", action="store_true",
                   help="also time fx2xla without its few-row float32 matmul kernel")
    p.add_argument("--helpers", action="store_true",
                   help="also time fx2xla with the kernel library's helper threads taking the few-row "
                        "matmuls' parts (FX2XLA_HELPER_THREADS=1)")
    p.add_argument("--no-decode-attention", action="store_true",
                   help="also time fx2xla without its float32 decode attention kernel")
    p.add_argument("--weight-rhs", action="store_true",
                   help="also time fx2xla computing matmuls of 4-64 rows as x . W^T (option linear_weight_lhs=False)")
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="the static cache's length (generate's max_cache_len; default: prompt + new tokens)")
    p.add_argument("--split", action="store_true",
                   help="also take fx2xla's decode step apart and time XLA reading the weights (module docstring)")
    p.add_argument("--gap-ms", type=float, default=50.0, help="sleep before each timed call")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "decode.json"))
    a = p.parse_args()
    _timed_compiled_calls()
    torch._dynamo.config.recompile_limit = 64  # a compiled copy of one forward per contender
    results = {"torch": torch.__version__, "dtype": a.dtype, "torch_threads": torch.get_num_threads(),
               "cores": len(os.sched_getaffinity(0)), "load_before": load(), "batches": {}}
    print(f"torch {torch.__version__}, {a.dtype}, {torch.get_num_threads()} threads, {results['cores']} cores usable, "
          f"load {results['load_before']}")
    print(f"\n{'batch':>5s} {'contender':15s} {'first call':>10s} {'median':>9s} {'tok/s':>8s} {'cpu tok/s':>9s} "
          f"{'ids=eager':>9s} {'max|dlogit|':>11s}")
    for b in (int(x) for x in a.batches.split(",")):
        r = bench_batch(b, a)
        results["batches"][str(b)] = r
        for n in contenders(a):
            print(f"{b:5d} {n:15s} {r['first_call_s'][n]:9.2f}s {r['median_s'][n] * 1e3:7.1f}ms "
                  f"{r['tokens_per_s'][n]:8.1f} {r['cpu_tokens_per_s'][n]:9.1f} {str(r['ids_match_eager'][n]):>9s} "
                  f"{r['max_abs_logit_err_vs_eager'][n]:11.2e}")
        print(f"      fx2xla ÷ Inductor tokens/s {r['fx2xla_vs_inductor_tokens_per_s']:.2f} (cpu time: "
              f"{r['fx2xla_vs_inductor_cpu']:.2f}), fx2xla ÷ eager {r['fx2xla_vs_eager_tokens_per_s']:.2f}, "
              f"Inductor ÷ eager {r['inductor_vs_eager_tokens_per_s']:.2f}; logits up to {r['logit_scale']:.2f}; "
              f"load {r['load']}")
        if "fx2xla_vs_no_skinny_tokens_per_s" in r:
            print(f"      fx2xla ÷ fx2xla:no-skinny tokens/s {r['fx2xla_vs_no_skinny_tokens_per_s']:.2f}")
        if "fx2xla_vs_decomposed_attention_tokens_per_s" in r:
            print(f"      fx2xla ÷ fx2xla:decomposed-attention tokens/s {r['fx2xla_vs_decomposed_attention_tokens_per_s']:.2f}"
                  f" (cpu time: {r['fx2xla_vs_decomposed_attention_cpu']:.2f})")
        if "fx2xla_vs_linear_as_is_tokens_per_s" in r:
            print(f"      fx2xla ÷ fx2xla:linear-as-is tokens/s {r['fx2xla_vs_linear_as_is_tokens_per_s']:.2f}"
                  f" (cpu time: {r['fx2xla_vs_linear_as_is_cpu']:.2f})")
        if r["step_median_s"]:
            print("      compiled step alone (median): " + ", ".join(
                f"{n} {t * 1e3:.2f} ms" for n, t in r["step_median_s"].items())
                + (f"; fx2xla ÷ Inductor {r['fx2xla_vs_inductor_step']:.2f}" if "fx2xla_vs_inductor_step" in r else ""))
        if "split" in r:
            sp, w = r["split"], r["split"]["weight_read"]
            print(f"      fx2xla per new token {sp['token_s'] * 1e3:.2f} ms (Inductor {sp['inductor_token_s'] * 1e3:.2f}):"
                  f" outside its graph {sp['outside_graph_s'] * 1e3:.2f}, graph {sp['graph_s'] * 1e3:.2f} ="
                  f" executable launch to export {sp['launch_s'] * 1e3:.2f} + the rest {sp['graph_rest_s'] * 1e3:.2f}")
            print(f"      1.25x Inductor's tokens/s needs an executable of {sp['needed_launch_for_1_25x_s'] * 1e3:.2f} ms;"
                  f" XLA reads the {w['weight_bytes'] / 2**20:.1f} MiB of weights in {w['hot_s'] * 1e3:.2f} ms hot,"
                  f" {w['from_memory_s'] * 1e3:.2f} ms from memory (launch {w['launch_s'] * 1e3:.3f} ms taken off)")
        if "fx2xla_vs_unmerged_tokens_per_s" in r:
            print(f"      fx2xla ÷ fx2xla:unmerged tokens/s {r['fx2xla_vs_unmerged_tokens_per_s']:.2f}"
                  f" (cpu time: {r['fx2xla_vs_unmerged_cpu']:.2f}); step time {r['fx2xla_vs_unmerged_step']:.2f}")
        if "fx2xla_vs_not_in_place_tokens_per_s" in r:
            print(f"      fx2xla ÷ fx2xla:not-in-place tokens/s {r['fx2xla_vs_not_in_place_tokens_per_s']:.2f}")
        if "helpers_vs_fx2xla_tokens_per_s" in r:
            print(f"      fx2xla:helpers ÷ fx2xla tokens/s {r['helpers_vs_fx2xla_tokens_per_s']:.3f}"
                  f" (cpu time: {r['helpers_vs_fx2xla_cpu']:.3f}); step time {r['helpers_vs_fx2xla_step']:.3f}")
        for name in AGAINST_FX2XLA:
            slug = _slug(name)
            if f"fx2xla_vs_{slug}_tokens_per_s" in r:
                print(f"      fx2xla ÷ {name} tokens/s {r[f'fx2xla_vs_{slug}_tokens_per_s']:.3f}"
                      f" (cpu time: {r[f'fx2xla_vs_{slug}_cpu']:.3f}); step time {r[f'fx2xla_vs_{slug}_step']:.3f}")
    results["load_after"] = load()
    write_json(a.out, results)
    print(f"\nraw numbers: {a.out}")


if __name__ == "__main__":
    main()
