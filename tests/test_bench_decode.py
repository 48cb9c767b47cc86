"""bench/decode.py runs on the CPU with `--split` (a 1-layer, 64-wide LLaMA, batch 1, 4 new
tokens; and `--helpers --split-sleep` at batch 2): every contender's generated ids equal eager's
and its logits are within float32 tolerance of eager's (max |err| ≤ 1e-4 for logits of scale ~1); the split timed fx2xla's graph
and its launch once per decode step of every timed call (3 steps: the prompt's call is eager),
the graph holds the launch and the rest of the token lies outside it; and XLA's weight read counts the model's parameters' bytes, with positive
times hot and from memory."""
import math

import torch

from fx2xla.testing import llama
from tests.conftest import run_bench


def test_decode_bench_split_runs_on_cpu(tmp_path):
    r, out = run_bench("decode.py", ["--batches", "1", "--new-tokens", "4", "--rounds", "1", "--layers", "1",
                                     "--hidden", "64", "--split"], tmp_path / "d.json")
    b = r["batches"]["1"]
    assert all(b["ids_match_eager"].values())
    assert max(b["max_abs_logit_err_vs_eager"].values()) <= 1e-4
    sp = b["split"]
    assert sp["graph_calls"] == sp["launch_calls"] == 3
    assert 0 < sp["launch_s"] <= sp["graph_s"] < sp["token_s"]
    assert math.isclose(sp["graph_rest_s"], sp["graph_s"] - sp["launch_s"])
    assert math.isclose(sp["outside_graph_s"], sp["token_s"] - sp["graph_s"])
    weights = sum(p.numel() * 4 for p in llama(layers=1, hidden=64).parameters())
    assert sp["weight_read"]["weight_bytes"] == weights
    assert sp["weight_read"]["hot_s"] > 0 and sp["weight_read"]["from_memory_s"] > 0
    assert "1.25x Inductor's tokens/s needs an executable of" in out


def test_decode_bench_helpers_contender(tmp_path):
    """`--helpers --split-sleep` at batch 2 (few-row matmuls): fx2xla with the helper threads and
    fx2xla with split waits slept at once run beside the others, their ids equal eager's, their
    logits are within 1e-4 of eager's, and the run reports each against fx2xla (positive ratios of
    tokens/s, CPU time and step time)."""
    r, out = run_bench("decode.py", ["--batches", "2", "--new-tokens", "4", "--rounds", "1", "--layers", "1",
                                     "--hidden", "64", "--helpers", "--split-sleep"], tmp_path / "d.json")
    b = r["batches"]["2"]
    assert all(b["ids_match_eager"].values())
    assert b["ids_match_eager"]["fx2xla:helpers"] and b["ids_match_eager"]["fx2xla:split-sleep"]
    assert b["max_abs_logit_err_vs_eager"]["fx2xla:helpers"] <= 1e-4
    assert b["max_abs_logit_err_vs_eager"]["fx2xla:split-sleep"] <= 1e-4
    for key in ("helpers_vs_fx2xla_tokens_per_s", "helpers_vs_fx2xla_cpu", "helpers_vs_fx2xla_step",
                "fx2xla_vs_split_sleep_tokens_per_s", "fx2xla_vs_split_sleep_cpu", "fx2xla_vs_split_sleep_step"):
        assert b[key] > 0, key
    assert "fx2xla:helpers ÷ fx2xla tokens/s" in out
    assert "fx2xla ÷ fx2xla:split-sleep tokens/s" in out
