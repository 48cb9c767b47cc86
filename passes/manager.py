"""The pass manager: named graph passes run in order, each timed, switchable and dumped.

A pass is `fn(gm, example_inputs, options) -> PassResult`. Passes run on Dynamo's graph,
before AOTAutograd (so a rewrite there, e.g. scan-folding, is differentiated by AOTAutograd
like user code). Each pass has an option of its own name (`options={"scan_folding": False}`)
and `FX2XLA_DUMP_DIR` receives the graph after every pass that changed it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

log = logging.getLogger("fx2xla.passes")


@dataclass
class PassResult:
    gm: torch.fx.GraphModule
    changed: bool
    # One line per decision worth knowing (what was folded, or why not), for logs and metrics.
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GraphPass:
    name: str
    fn: Callable[..., PassResult]
    default: bool  # on unless options[name] says otherwise
    help: str
    options: dict = field(default_factory=dict)  # its own options: name -> (default, help)


PASSES: list[GraphPass] = []


def register_pass(name: str, *, default: bool, help: str, options: dict | None = None):
    def deco(fn):
        PASSES.append(GraphPass(name, fn, default, help, dict(options or {})))
        return fn

    return deco


@dataclass
class PassRecord:
    name: str
    seconds: float
    changed: bool
    notes: list[str]


def run_passes(gm: torch.fx.GraphModule, example_inputs, options: dict, graph_name: str = "graph",
               observe=None):
    """Run every enabled pass over `gm` in registration order; return (gm, records).
    `observe(record, gm)`, if given, sees each pass's record and the graph it left (the backend
    counts and dumps there: passes know nothing of the frontend)."""
    records: list[PassRecord] = []
    for p in PASSES:
        if not options.get(p.name, p.default):
            continue
        t0 = time.perf_counter()
        result = p.fn(gm, example_inputs, options)
        seconds = time.perf_counter() - t0
        for note in result.notes:
            log.debug("%s: %s: %s", graph_name, p.name, note)
        records.append(PassRecord(p.name, seconds, result.changed, result.notes))
        if result.changed:
            gm = result.gm
        if observe is not None:
            observe(records[-1], gm)
    return gm, records


def pass_options() -> dict:
    """name -> (default, help) of every registered pass and of its own options, for the
    backend's option table."""
    out = {}
    for p in PASSES:
        out[p.name] = (p.default, p.help)
        out.update(p.options)
    return out
