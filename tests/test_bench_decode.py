"""bench/decode.py runs on the CPU with `--split` (a 1-layer, 64-wide LLaMA, batch 1, 4 new
tokens): every contender's generated ids equal eager's and its logits are within float32
tolerance of eager's (max |err| ≤ 1e-4 for logits of scale ~1); the split timed fx2xla's graph
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
