"""A transcendental table read over many more elements than it has (a rotary embedding's cos and
sin, [1, seq, dim], multiplied into every batch and head) is computed once into a buffer on the
CPU (lowering/elementwise.py: _broadcast_reader, _materialized), not once per element read inside
each reader's fused loop. Checked against eager (float32: rtol 1e-4, atol 1e-5, conftest's;
bfloat16: rtol 1.6e-2, atol 1e-2), with NaN, infinities and -0.0 in the angles, and in the
optimized HLO: each table is a conditional's operand, and no loop that computes a sine or cosine
writes the readers' shape (without this, XLA:CPU fused both into the reader's loop: the test
fails with BROADCAST_READ_FACTOR set out of reach)."""
from __future__ import annotations

import re

import pytest
import torch

from fx2xla.metrics import live_graphs
from fx2xla.runtime.executor import optimized_hlo_text
from tests.conftest import tolerance


class Rotary(torch.nn.Module):
    """q [B, H, S, D] rotated by angles [1, S, D], as transformers' LLaMA applies it."""

    def forward(self, q, angles):
        cos = (angles.cos() * 1.0).to(q.dtype).unsqueeze(1)
        sin = (angles.sin() * 1.0).to(q.dtype).unsqueeze(1)
        half = q.shape[-1] // 2
        rotated = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
        return q * cos + rotated * sin


class SameSize(torch.nn.Module):
    """cos read by an op of its own size only: left to XLA's fusion."""

    def forward(self, x, y):
        return x.cos() * y


def compiled_run(model, *args):
    before = set(live_graphs)  # held: no id of theirs is reused
    compiled = torch.compile(model, backend="fx2xla", fullgraph=True)
    with torch.no_grad():
        out = compiled(*args)
    [graph] = [g for g in live_graphs if g not in before and g.static is not None]
    return out, optimized_hlo_text(graph.static.exe)


def computations(hlo: str) -> dict[str, tuple[str, str]]:
    """name -> (result type, body) of each computation in HLO text."""
    found = {}
    for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) \((.*?)\) -> (.*?) \{\n(.*?)\n\}", hlo, re.M | re.S):
        found[m.group(1)] = (m.group(3), m.group(4))
    return found


def tables_apart(hlo: str, reader_shape: str) -> bool:
    """No computation that takes a sine or cosine writes the readers' shape (those that take
    one write the table, or the predicate's one element of it)."""
    found = computations(hlo)
    assert found, hlo
    return not any(re.search(r"\b(sine|cosine)\(", body) and reader_shape in result
                   for result, body in found.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rotary_tables_computed_once(dtype):
    torch.manual_seed(0)
    q = torch.randn(4, 4, 128, 64, dtype=dtype)
    angles = torch.rand(1, 128, 64) * 100
    out, hlo = compiled_run(Rotary(), q, angles)
    torch.testing.assert_close(out, Rotary()(q, angles), **tolerance(dtype))
    assert hlo.count(" conditional(") == 2, hlo
    assert tables_apart(hlo, "[4,4,128,64]"), hlo


def test_special_values_pass_through():
    """NaN (the predicate's other branch), infinities and -0.0 among the angles: eager's results,
    NaN where eager has NaN."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 128, 64)
    angles = torch.rand(1, 128, 64) * 10
    angles[0, 0, 0] = float("nan")  # the element the predicate reads
    angles[0, 1, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, 0.0])
    out, hlo = compiled_run(Rotary(), q, angles)
    torch.testing.assert_close(out, Rotary()(q, angles), equal_nan=True, **tolerance(torch.float32))
    assert hlo.count(" conditional(") == 2


def test_same_size_reader_is_fused():
    """cos(x) * y with x and y of one shape: no table, no conditional, eager's result."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    out, hlo = compiled_run(SameSize(), x, y)
    torch.testing.assert_close(out, SameSize()(x, y), **tolerance(torch.float32))
    assert " conditional(" not in hlo
