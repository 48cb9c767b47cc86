"""torch's precompile path for fx2xla: `torch.compile(...).aot_compile(...)` then
`save_compiled_function` / `torch.compiler.load_compiled_function`, so a new process skips
Dynamo and AOTAutograd.

    compiled = torch.compile(model, backend="fx2xla", fullgraph=True)
    compiled.forward.aot_compile(((ids,), {})).save_compiled_function("model.aot")
    # in a new process:
    fn = torch.compiler.load_compiled_function(open("model.aot", "rb"))
    logits = fn(model, ids)

What it covers: inference graphs that need none of AOTAutograd's runtime wrappers (no input
mutation, no output aliasing an input, no tensor subclass), the common serving case. The
saved artifact holds the core-ATen graph AOTAutograd produced (with its example values);
loading it lowers that graph again (no tracing) and compiles it, from the disk cache when
the executable is there. Training graphs and graphs that need the wrappers are refused at
`aot_compile` time with an error saying why (fx2xla.export covers more).
"""
from __future__ import annotations

import pickle

from torch._dynamo.aot_compile_types import SerializableCallable

from .compiled_graph import CompiledGraph
from .errors import Fx2XlaError
from .runtime import device_for

_VERSION = 1


def _in_precompile_private() -> bool:
    # aot_compile_fullgraph compiles under these functorch settings, which torch.compile's
    # ordinary path leaves off.
    import torch._functorch.config as config

    return bool(config.bundled_autograd_cache and config.force_autograd_cache)


def _in_precompile_public() -> bool:
    return True  # unknown: every coverable result is serializable (one more call layer, same results)


# Whether the check knows (private) or guesses (public): only a known precompile refuses graphs
# it cannot cover; a guess leaves them to torch.compile's ordinary path.
_in_precompile_private.certain = True
_in_precompile_public.certain = False


def make_in_precompile(public: bool | None = None):
    """`in_precompile() -> bool`: whether the backend runs under torch's aot_compile (reads
    torch's private functorch settings; the public fallback answers yes)."""
    import os

    if public is None:
        public = os.environ.get("FX2XLA_PUBLIC_PRECOMPILE", "") not in ("", "0")
    try:
        import torch._functorch.config as config

        known = hasattr(config, "bundled_autograd_cache") and hasattr(config, "force_autograd_cache")
    except ImportError:
        known = False
    return _in_precompile_private if known and not public else _in_precompile_public


in_precompile = make_in_precompile()


def without_autograd_cache():
    """A context in which AOTAutograd does not put the compile in its cache: aot_compile turns
    that cache on, and it holds Inductor's compiled code only (fx2xla's results are saved by
    PrecompiledGraph instead). torch's private functorch settings; a no-op context without them."""
    import contextlib

    try:
        import torch._functorch.config as config

        return config.patch({"force_autograd_cache": False, "bundled_autograd_cache": False,
                             "strict_autograd_cache": False, "enable_autograd_cache": False})
    except (ImportError, AttributeError, KeyError):
        return contextlib.nullcontext()


class PrecompiledGraph(SerializableCallable):
    """A compiled inference graph that torch's precompile path can save and load."""

    def __init__(self, graph, options: dict):
        self.graph = graph  # a CompiledGraph
        self.options = options
        self._call = graph.call_unboxed

    def __call__(self, *args):
        return self._call(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "PrecompiledGraph") -> bytes:
        from torch.fx._graph_pickler import GraphPickler, Options

        graph = fn.graph
        state = {"version": _VERSION, "name": graph.name, "options": fn.options,
                 "resident": sorted(i for i, p in enumerate(graph.plan.inputs) if p.resident),
                 "graph": GraphPickler.dumps(graph.gm, Options(ops_filter=None))}
        return pickle.dumps(state)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "PrecompiledGraph":
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        state = pickle.loads(data)
        if not isinstance(state, dict) or state.get("version") != _VERSION:
            raise Fx2XlaError(f"fx2xla: a precompiled artifact of version {state.get('version') if isinstance(state, dict) else '?'}; "
                              f"this fx2xla reads version {_VERSION}: precompile again")
        gm = GraphPickler.loads(state["graph"], FakeTensorMode(shape_env=ShapeEnv()))
        gm.recompile()
        fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        options = state["options"]
        device = device_for([v.device for v in fakes if hasattr(v, "device") and not (v.device.type == "cpu" and v.dim() == 0)],
                            options.get("device_index"))
        graph = CompiledGraph(gm, fakes, device, state["name"], resident_inputs=set(state["resident"]),
                              check_indices=bool(options.get("check_indices", True)),
                              torch_kernels=options.get("torch_kernels", True),
                              channels_last=options.get("channels_last", True), relaid_weights=True,
                              linear_weights_kn=options.get("transposed_linear_weights", True),
                              merge_linears=options.get("merge_linears", True),
                              linear_weight_lhs=options.get("linear_weight_lhs", True),
                              widened_linear_weights=options.get("widened_linear_weights", True))
        return cls(graph, options)


def precompiled(graph, options: dict) -> PrecompiledGraph:
    """The serializable result of an inference graph compiled under torch's aot_compile."""
    kept = {k: options[k] for k in ("device_index", "check_indices", "torch_kernels")}
    return PrecompiledGraph(graph, {**kept, "channels_last": options.get("channels_last", True),
                                    "transposed_linear_weights": options.get("transposed_linear_weights", True),
                                    "merge_linears": options.get("merge_linears", True),
                                    "linear_weight_lhs": options.get("linear_weight_lhs", True),
                                    "widened_linear_weights": options.get("widened_linear_weights", True)})


def refused() -> Fx2XlaError:
    return Fx2XlaError(
        "fx2xla: torch's aot_compile (precompile) covers inference graphs that need none of AOTAutograd's "
        "runtime wrappers; this graph has a backward, writes an input, returns an alias of an input, or uses a "
        "tensor subclass. Use fx2xla.export for a package, or torch.compile without aot_compile.")
