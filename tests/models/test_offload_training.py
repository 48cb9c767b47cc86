"""Host offloading in compiled training (fx2xla/offload.py): a 4-layer LLaMA (fx2xla.testing,
random weights, hidden 64) trained 3 AdamW steps with each `offload` option, against eager and
against fx2xla without offloading.

Tolerances: losses vs eager at rtol 1e-4, atol 1e-5 (float32; measured: 1.4e-6), the one-step
tolerance of tests/models/test_training.py; parameters and moments after the steps at its
"trajectory" tolerance (rtol 1e-3, atol 1e-4; measured: 3e-5), with its allowance for Adam's
sign flips on rounding-noise gradients. Against fx2xla without offloading, its layers folded
into a loop or not as the case's: bit for bit (the memory kinds change where values wait, never
the arithmetic).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fx2xla
from fx2xla import offload
from fx2xla.metrics import counters, live_graphs
from fx2xla.testing import LogitsOnly, llama, token_ids

from tests.models.test_training import TOL as TRAINING_TOL, assert_same_params, sign_flip_bound

VOCAB, BATCH, SEQ, LAYERS, STEPS = 256, 2, 32, 4, 3
TOL = TRAINING_TOL[torch.float32]["step"]  # rtol 1e-4, atol 1e-5
TRAJECTORY = TRAINING_TOL[torch.float32]["trajectory"]  # rtol 1e-3, atol 1e-4
HOST = 'mhlo.memory_kind = "pinned_host"'
CASES = {
    "none": {},
    "folded": {"scan_min_layers": 4},  # one loop of 4 layers, no offloading
    "activations": {"offload": "activations"},  # 4 layers: below scan_min_layers, unrolled
    "activations-folded": {"offload": "activations", "scan_min_layers": 4},
    "optimizer": {"offload": "optimizer"},
}
# Each case against fx2xla without offloading, the same layers folded or not: folding changes
# the arithmetic (a loop body's matmuls read one layer's slice of the stacked weights; unrolled,
# the forward's 64-row matmuls take the weight on the left, option linear_weight_lhs).
BASE = {"none": "none", "folded": "folded", "activations": "none", "activations-folded": "folded",
        "optimizer": "none"}


def build():
    torch.manual_seed(0)
    model = LogitsOnly(llama(layers=LAYERS, hidden=64, heads=4, kv_heads=2, vocab=VOCAB, positions=64))
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model.train()


def train(model, options):
    """STEPS AdamW steps (compiled with `options`, or eager when None): losses, optimizer, graphs."""
    ids = token_ids(BATCH, SEQ, VOCAB, seed=5)
    target = ids.roll(-1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True)
    compiled = options is not None
    forward = torch.compile(model, backend="fx2xla", options=options) if compiled else model
    step = torch.compile(opt.step, backend="fx2xla", options=options) if compiled else opt.step
    before = {id(g) for g in live_graphs}
    folds = counters.scan_folds
    losses = []
    for _ in range(STEPS):
        loss = F.cross_entropy(forward(ids).reshape(-1, VOCAB), target.reshape(-1))
        loss.backward()
        step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    graphs = {g.name.rsplit("_", 1)[-1]: g for g in live_graphs if id(g) not in before}
    return torch.stack(losses), opt, graphs, counters.scan_folds - folds


@pytest.fixture(scope="module")
def runs():
    torch._dynamo.reset()
    eager_model = build()
    out = {"eager": (eager_model, *train(eager_model, None))}
    for name, options in CASES.items():
        torch._dynamo.reset()
        model = build()
        out[name] = (model, *train(model, options))
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_losses_and_parameters_match_eager(runs, case):
    eager_model, eager_losses = runs["eager"][:2]
    model, losses, _, graphs, _ = runs[case]
    assert {"forward", "backward", "inference"} <= set(graphs)  # compiled, not eager behind our back
    torch.testing.assert_close(losses, eager_losses, **TOL)
    assert_same_params(model, eager_model, flip_bound=sign_flip_bound("adamw", STEPS))
    base_model, base_losses = runs[BASE[case]][:2]
    assert torch.equal(losses, base_losses)
    for p, q in zip(model.parameters(), base_model.parameters()):
        assert torch.equal(p, q)


def _host_results(graph) -> list:
    return [r for r in graph.plan.results if r.memory_kind == "pinned_host"]


def _signature(graph) -> tuple[str, str]:
    line = next(l for l in graph.static.lowered.module_text.splitlines() if "func.func public @main" in l)
    args, _, results = line.partition(") -> (")
    return args, results


@pytest.mark.parametrize("case", ["activations", "activations-folded"])
def test_forward_marks_saved_activations_with_the_host_kind(runs, case):
    _, _, _, graphs, folds = runs[case]
    fw, bw = graphs["forward"], graphs["backward"]
    assert folds == (1 if case.endswith("folded") else 0)
    saved = _host_results(fw)
    assert saved
    # Every result after the user's (the loss logits) is a saved activation, all in host memory,
    # except values the plan returns without a copy (inputs, weights stacked in torch).
    assert fw.plan.results[0].memory_kind is None
    assert len(saved) == len(fw.plan.results) - 1
    _, results = _signature(fw)
    assert results.count(HOST) == len(saved)
    args, _ = _signature(bw)
    assert args.count(HOST) == len(saved)
    assert sum(p.memory_kind == "pinned_host" for p in bw.plan.inputs) == len(saved)
    if case.endswith("folded"):  # the scan's stacked residuals: one leading dim per layer
        stacked = [r for r in saved if r.node.meta["val"].dim() > 1 and r.node.meta["val"].shape[0] == LAYERS]
        assert len(stacked) >= 10
        assert any(r.node.meta["val"].shape[1:] == (BATCH, SEQ, 688) for r in stacked)  # the MLP's activations


@pytest.mark.parametrize("case", ["activations", "activations-folded"])
def test_memory_kinds_in_the_compiled_executables(runs, case):
    fw = runs[case][3]["forward"]
    base = runs["none" if case == "activations" else "activations-folded"][3]["forward"]
    on = offload.memory_by_kind(fw)
    assert on["results"]["pinned_host"] == fw.offload_per_call[0] > 0
    if case == "activations":  # the same graph without offloading: those bytes left device memory
        off = offload.memory_by_kind(base)
        assert on["results"]["device"] == off["results"]["device"] - on["results"]["pinned_host"]
        # XLA:CPU's memory analysis counts host buffers with the device's (host_* fields 0).
        if on["xla"]["host_output_size_in_bytes"] == 0:
            assert on["xla"]["output_size_in_bytes"] == off["xla"]["output_size_in_bytes"]
        else:
            assert on["xla"]["host_output_size_in_bytes"] == on["results"]["pinned_host"]
    assert offload.memory_by_kind(runs[case][3]["backward"])["arguments"]["pinned_host"] == on["results"]["pinned_host"]


def test_optimizer_moments_live_in_host_memory(runs):
    model, _, opt, graphs, _ = runs["optimizer"]
    step = graphs["inference"]
    params = list(model.parameters())
    moments = 2 * len(params)
    assert sum(p.memory_kind == "pinned_host" for p in step.plan.inputs) == moments
    assert len(_host_results(step)) == moments
    assert not _host_results(graphs["forward"]) and not any(p.memory_kind for p in graphs["backward"].plan.inputs)
    args, results = _signature(step)
    assert args.count(HOST) == moments and results.count(HOST) == moments
    assert step.offload_per_call == (2 * sum(p.numel() for p in params) * 4,) * 2
    eager_opt = runs["eager"][2]
    eager_params = list(runs["eager"][0].parameters())
    for p, q in zip(params, eager_params):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], eager_opt.state[q][key], **TRAJECTORY)
