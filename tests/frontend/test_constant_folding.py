"""Input-independent values (causal masks, position ids built from shapes) are computed once in
torch when the graph is lowered and reach XLA as literals: fewer kernels to compile, no work per
call. Results must not change: every case compares with eager (exact for ints/bools; float32
1e-6). Random ops, large values and anything reading an input stay computations."""
from __future__ import annotations

import glob
import os
import re

import pytest
import torch

import fx2xla.plan as plan_module


@pytest.fixture
def dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FX2XLA_DUMP_DIR", str(tmp_path))
    return tmp_path


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", fullgraph=True)


def _module(folder) -> str:
    (path,) = glob.glob(os.path.join(folder, "*.stablehlo.mlir"))
    return open(path).read()


def _masked_scores(n):
    def f(x):
        mask = torch.ones(n, n, dtype=torch.bool).tril()  # input-independent
        pos = torch.arange(n).unsqueeze(0) - torch.arange(n).unsqueeze(1)  # int64
        return x.masked_fill(~mask, float("-inf")).softmax(-1) + pos.float() * 1e-3, pos
    return f


def test_small_input_independent_values_become_literals(dump_dir):
    f = _masked_scores(16)
    x = torch.randn(2, 16, 16)
    compiled = _compile(f)
    got, pos = compiled(x)
    want, want_pos = f(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(pos, want_pos) and pos.dtype == torch.int64
    pos.add_(1)  # a literal output is the caller's own tensor: writing it changes no later call
    assert torch.equal(compiled(x)[1], want_pos)
    text = _module(dump_dir)
    assert "stablehlo.iota" not in text, "the mask / position ids were not folded"
    assert re.search(r"stablehlo\.constant dense<.*> : tensor<16x16xi1>", text)


def test_large_values_stay_computations(dump_dir, monkeypatch):
    monkeypatch.setattr(plan_module, "CONSTANT_FOLD_MAX_ELEMENTS", 8)
    f = _masked_scores(16)  # aranges of 16, a mask of 256: all above 8
    x = torch.randn(2, 16, 16)
    got, pos = _compile(f)(x)
    want, want_pos = f(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(pos, want_pos)
    assert "stablehlo.iota" in _module(dump_dir)


def test_random_and_input_dependent_values_are_not_folded():
    def f(x):
        return x + torch.rand(4, 4) + torch.arange(4.0) * x.sum()

    x = torch.zeros(4, 4)
    compiled = _compile(f)
    a, b = compiled(x), compiled(x)
    assert not torch.equal(a, b), "torch.rand was folded into a literal"
    y = torch.ones(4, 4)
    noise = compiled(y) - torch.arange(4.0) * 16 - 1
    assert ((noise >= 0) & (noise < 1)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int32, torch.uint8])
def test_folded_literals_keep_their_dtype(dtype):
    def f(x):
        c = torch.full((3, 5), 7, dtype=dtype).cumsum(0)
        return x + c, c

    x = torch.ones(3, 5, dtype=dtype)
    got, c = _compile(f)(x)
    want, want_c = f(x)
    assert got.dtype == want.dtype and c.dtype == want_c.dtype  # cumsum promotes ints to int64
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(c, want_c, rtol=0, atol=0)


def test_folding_a_gpt2_mask_removes_kernels():
    """GPT-2 builds its causal mask from shapes: folded, the module has fewer ops to compile,
    and the logits still match eager."""
    from fx2xla.testing import LogitsOnly, gpt2, token_ids

    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=2, hidden=64)).eval()
    ids = token_ids(2, 32)
    seen = []
    real = plan_module.constant_values

    def spy(gm):
        out = real(gm)
        seen.append(len(out))
        return out

    with torch.no_grad():
        try:
            plan_module.constant_values = spy
            got = _compile(model)(ids)
        finally:
            plan_module.constant_values = real
        torch.testing.assert_close(got, model(ids), rtol=1e-4, atol=1e-4)
    assert seen and max(seen) >= 5, seen  # arange, indices, compares, the mask expand
