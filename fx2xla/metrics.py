"""Process-wide counters. Read them with `fx2xla.metrics()`."""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from .runtime import client, executable_cache, executor, host_memory, twins


@dataclass
class Counters:
    graphs: int = 0  # FX graphs handed to the backend (forward, backward, inference)
    specializations: int = 0  # executables requested (one per graph and input signature)
    lower_seconds: float = 0.0  # FX -> StableHLO tracing time
    fallback_ops: int = 0  # op nodes that run eagerly between XLA subgraphs
    pass_seconds: dict = field(default_factory=dict)  # graph pass name -> seconds (passes/)
    scan_folds: int = 0  # runs of repeated layers folded into one loop
    # set_serving("auto") trials ended: executables that serve their main-thread calls / do not
    serving_chosen: int = 0
    serving_declined: int = 0


counters = Counters()
# Compiled graphs count their own executions (an integer add on the call path); summed here.
live_graphs: "weakref.WeakSet" = weakref.WeakSet()
# What freed graphs counted, so that the process-wide sums never go down when a graph is freed.
_RETIRED_KEYS = ("executions", "execute_seconds", "import_seconds", "staged_inputs", "offloaded_bytes",
                 "reloaded_bytes")
_retired = dict.fromkeys(_RETIRED_KEYS, 0)
_retired_lock = threading.Lock()


def _counts(executor, offload_per_call) -> dict:
    n = executor.executions
    return {"executions": n, "execute_seconds": executor.execute_seconds, "import_seconds": executor.import_seconds,
            "staged_inputs": executor.staged_inputs,
            "offloaded_bytes": offload_per_call[0] * n if offload_per_call else 0,
            "reloaded_bytes": offload_per_call[1] * n if offload_per_call else 0}


def _retire(executor, offload_per_call) -> None:
    counts = _counts(executor, offload_per_call)
    with _retired_lock:
        for k, v in counts.items():
            _retired[k] += v


def track(graph) -> None:
    """Adds a compiled graph to `live_graphs`; once it is freed, what its executor counted stays
    in metrics()."""
    live_graphs.add(graph)
    weakref.finalize(graph, _retire, graph.executor, graph.offload_per_call)


def is_compiled_graph(obj) -> bool:
    """Whether `obj` is one of fx2xla's live compiled graphs."""
    try:
        return obj in live_graphs
    except TypeError:  # not weak-referenceable: no graph
        return False


def metrics() -> dict:
    """Counters of this process: graphs, specializations, executable-cache hits and misses
    (memory and disk), XLA compiles and their seconds, lowering seconds, and the memory XLA
    holds on each device fx2xla used (`device_memory`), and the bytes host offloading moved
    (`offloaded_bytes` into host memory, `reloaded_bytes` out of it), and the results kept as
    twins (`twin_records`; `twin_arrays_waiting`: a GPU's dropped results whose memory waits for
    torch's stream, see runtime/twins.py), and what fx2xla set of glibc's malloc thresholds
    (`host_malloc`)."""
    out = dict(counters.__dict__)
    out["pass_seconds"] = dict(counters.pass_seconds)
    # Over every graph compiled in this process, freed ones included: executions, and with
    # FX2XLA_TIME_EXECUTE=1 their seconds and the imports' seconds; inputs copied into staging
    # buffers rather than imported (CPU); host offloading's bytes per device left in host memory
    # and taken from it.
    graphs = list(live_graphs)
    with _retired_lock:
        out.update(_retired)
    for g in graphs:
        for k, v in _counts(g.executor, g.offload_per_call).items():
            out[k] += v
    kept = twins.counts()
    out["twin_records"], out["twin_arrays_waiting"] = kept["records"], kept["waiting"]
    s = executable_cache.stats
    out.update(
        cache_hits=s.hits,
        cache_misses=s.misses,
        cache_evictions=s.evictions,
        compiles=s.compiles,
        compile_seconds=s.compile_seconds,
    )
    d = executor.disk_cache()
    ds = d.stats if d is not None else None
    out.update(
        disk_cache_dir=d.folder if d is not None else None,
        disk_hits=ds.hits if ds else 0,
        disk_misses=ds.misses if ds else 0,
        disk_writes=ds.writes if ds else 0,
        disk_dropped=ds.dropped if ds else 0,
        disk_load_seconds=ds.load_seconds if ds else 0.0,
    )
    # Per device fx2xla ran on: what XLA holds there ({"bytes_in_use", "peak_bytes_in_use",
    # "bytes_limit"}; None where the platform does not say).
    out["device_memory"] = {str(d): client.device_memory(d) for d in sorted(client.used_devices, key=str)}
    # What fx2xla did to glibc's malloc thresholds (runtime/host_memory.py).
    out["host_malloc"] = host_memory.status()
    return out


def metrics_report() -> str:
    """`metrics()` as a readable table."""
    m = metrics()
    width = max(map(len, m))
    lines = ["fx2xla metrics"]
    for k, v in m.items():
        v = f"{v:.3f}" if isinstance(v, float) else str(v)
        lines.append(f"  {k:<{width}}  {v}")
    return "\n".join(lines)
