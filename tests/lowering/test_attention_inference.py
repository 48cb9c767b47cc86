"""CPU attention in inference graphs stays one op (`_scaled_dot_product_flash_attention_for_cpu`,
decompositions.attention_op_table) and is lowered by its rule, which reads each kv head once for
its group of query heads, also when the model repeats K and V itself (transformers' repeat_kv).

Turned off (`options={"attention_op": False}`), inference graphs get torch's decomposition.
Every case runs `torch.compile(..., backend="fx2xla")` and compares with eager on the same
inputs at tests/conftest.py's tolerance per dtype (float32 rtol 1e-4 / atol 1e-5; bfloat16
outputs against a float64 eager copy, within 4x eager's own bfloat16 error and at least rtol
1.6e-2 / atol 1e-2). Checked besides the values:
- an inference graph holds the attention op and no math decomposition (no bmm, no softmax);
- a model's own interleaving repeat of K and V leaves no repeated copy in XLA's optimized
  program, while a tiling repeat (`Tensor.repeat`, which pairs heads differently) is kept and
  still matches eager;
- with only one of K and V repeated, neither is read in place and the result matches eager; a
  repeat traced through a slice that keeps everything (a dynamic length) is still read in place;
- a training graph keeps torch's decomposition, and its gradients match eager's;
- a transformers LLaMA (grouped-query attention) decodes the same tokens as eager with a
  static cache, and an 8-layer one folded into a loop keeps the op inside the loop's body;
- at batch 1 (and 2) with a longer static cache, decoding gives eager's tokens and logits, and
  the compiled step copies no cache;
- with dynamic shapes, three sequence lengths match eager."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import tolerance

import fx2xla  # noqa: F401  (registers the backend)
from fx2xla.metrics import live_graphs
from fx2xla.runtime.executor import optimized_hlo_text

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default


def repeat_kv(x, n):
    """transformers' repeat_kv: kv head j serves query heads [j*n, (j+1)*n)."""
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


def compiled_graphs(fn, *args, options=None):
    """fn compiled by fx2xla and called once: (its output, the graphs it made)."""
    before = {id(g) for g in live_graphs}
    torch._dynamo.reset()
    out = torch.compile(fn, backend="fx2xla", fullgraph=True, options=options)(*args)
    return out, [g for g in live_graphs if id(g) not in before]


def targets(graph) -> set:
    return {n.target for n in graph.gm.graph.nodes if n.op == "call_function"}


def qkv(dtype=torch.float32, heads=4, kv_heads=2, lq=5, lk=7, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, heads, lq, d, generator=g).to(dtype), torch.randn(2, kv_heads, lk, d, generator=g).to(dtype),
            torch.randn(2, kv_heads, lk, d, generator=g).to(dtype))


def assert_matches_eager(fn, args, actual):
    dtype = args[0].dtype
    if dtype == torch.float32:
        torch.testing.assert_close(actual, fn(*args), **tolerance(dtype))
        return
    exact = fn(*[a.double() if a.is_floating_point() else a for a in args])
    eager_err = float((fn(*args).double() - exact).abs().max())
    tol = tolerance(dtype)
    torch.testing.assert_close(actual.double(), exact, rtol=tol["rtol"], atol=max(tol["atol"], 4 * eager_err))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [None, "bool", "float", "causal"])
def test_inference_attention_is_one_op_and_matches_eager(dtype, mask):
    q, k, v = qkv(dtype)
    g = torch.Generator().manual_seed(3)
    attn = None
    if mask == "bool":
        attn = torch.rand(2, 1, 5, 7, generator=g) > 0.4
        attn[0, 0, 2] = False  # a fully masked row: eager's output there is 0
    elif mask == "float":
        attn = torch.randn(5, 7, generator=g).to(dtype)

    def fn(q, k, v, *attn):  # the mask as an argument: the float64 reference casts it too
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=attn[0] if attn else None,
                                              is_causal=mask == "causal", scale=0.3)

    args = (q, k, v) if attn is None else (q, k, v, attn)
    with torch.no_grad():
        out, graphs = compiled_graphs(fn, *args)
    assert len(graphs) == 1
    ops = targets(graphs[0])
    assert FLASH in ops and aten.bmm.default not in ops and aten._softmax.default not in ops
    assert_matches_eager(fn, args, out)


def test_option_off_decomposes_and_matches_eager():
    q, k, v = qkv()

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)

    with torch.no_grad():
        out, graphs = compiled_graphs(fn, q, k, v, options={"attention_op": False})
    ops = targets(graphs[0])
    assert FLASH not in ops and aten.bmm.default in ops
    assert_matches_eager(fn, (q, k, v), out)
    with pytest.raises(Exception, match="option attention_op=1; expected True or False"):  # Dynamo wraps it
        torch.compile(fn, backend="fx2xla", options={"attention_op": 1})(q, k, v)


def test_enable_gqa_matches_eager():
    q, k, v = qkv(heads=6, kv_heads=3)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with torch.no_grad():
        out, graphs = compiled_graphs(fn, q, k, v)
    assert FLASH in targets(graphs[0])
    assert_matches_eager(fn, (q, k, v), out)


def _broadcasts_to(hlo: str, shape: tuple) -> bool:
    """Whether XLA's optimized program broadcasts anything to `shape` (f32[...])."""
    dims = ",".join(map(str, shape))
    return re.search(rf"= f32\[{dims}\]\{{[0-9,]*\}} broadcast\(", hlo) is not None


def test_interleaving_repeat_is_read_in_place_and_tiling_repeat_is_kept():
    q, k, v = qkv(heads=4, kv_heads=2)

    def interleaved(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2))

    def tiled(q, k, v):  # query head h reads kv head h % 2, not h // 2
        return F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1))

    with torch.no_grad():
        out, graphs = compiled_graphs(interleaved, q, k, v)
        assert_matches_eager(interleaved, (q, k, v), out)
        hlo = optimized_hlo_text(graphs[0].static.exe)
        assert not _broadcasts_to(hlo, (2, 2, 2, 7, 8)), hlo
        out, graphs = compiled_graphs(tiled, q, k, v)
        assert_matches_eager(tiled, (q, k, v), out)
        assert not torch.allclose(out, interleaved(q, k, v))  # the two pairings differ


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("repeated", ["key", "value"])
def test_one_repeated_operand_matches_eager(rows, repeated):
    """Only one of K and V repeated by the model (the other given with every query head): the
    rule reads neither in place, as their head counts must agree, and matches eager, for a
    decode step's one query row and for 40 rows (torch's kernel's threshold)."""
    q, kv2, _ = qkv(lq=rows)
    full = torch.randn(2, 4, 7, 8, generator=torch.Generator().manual_seed(5))

    def fn(q, kv2, full):
        k, v = (repeat_kv(kv2, 2), full) if repeated == "key" else (full, repeat_kv(kv2, 2))
        return F.scaled_dot_product_attention(q, k, v)

    with torch.no_grad():
        out, graphs = compiled_graphs(fn, q, kv2, full)
    assert FLASH in targets(graphs[0])
    assert_matches_eager(fn, (q, kv2, full), out)


def test_repeat_through_a_dynamic_slice_is_read_in_place():
    """transformers' repeat_kv on a value whose length is dynamic (a cache Dynamo saw at other
    lengths) traces a slice that keeps everything between the unsqueeze and the expand: both K
    and V are still read in place (no 5-d broadcast in XLA's program), and the step matches
    eager at two lengths."""
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fx2xla")
    before = {id(g) for g in live_graphs}
    with torch.no_grad():
        for length in (7, 11):
            q, k, v = qkv(lq=1, lk=length, seed=length)
            torch._dynamo.mark_dynamic(v, 2)
            assert_matches_eager(fn, (q, k, v), compiled(q, k, v))
    graphs = [g for g in live_graphs if id(g) not in before]
    slices = [n for g in graphs for n in g.gm.graph.nodes if n.target is aten.slice.Tensor]
    assert slices, "the traced repeat no longer slices: this test no longer covers the case"
    hlo = "".join(optimized_hlo_text(spec.exe) for g in graphs for spec in g.specializations())
    assert "f32[2,2,11,8]" in hlo, hlo  # the pattern below can match
    assert not _broadcasts_to(hlo, (2, 2, 2, 11, 8)), hlo


def test_training_graph_keeps_decomposition_and_grads_match():
    q, k, v = (t.clone().requires_grad_() for t in qkv())
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)

    out, graphs = compiled_graphs(fn, q, k, v)
    out.square().sum().backward()
    fn(*ref).square().sum().backward()
    assert graphs and all(FLASH not in targets(g) for g in graphs)
    assert any(aten.bmm.default in targets(g) for g in graphs)
    torch.testing.assert_close(out, fn(*ref), **tolerance(torch.float32))
    for got, want in zip((q, k, v), ref):
        torch.testing.assert_close(got.grad, want.grad, **tolerance(torch.float32, 10))


def decode_llama(batch: int, **extra):
    """A 2-layer GQA LLaMA decoding 6 tokens after 6 with a static cache, greedily, eagerly and
    with its step compiled by fx2xla (generate's `extra` arguments to both): (model, eager's
    result, fx2xla's, the graphs the compiled step made)."""
    from fx2xla.testing import llama
    from transformers import CompileConfig

    torch.manual_seed(0)
    model = llama(layers=2, hidden=64).eval()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    ids = torch.randint(1, model.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, min_new_tokens=6, do_sample=False,
              cache_implementation="static", pad_token_id=0, **extra)
    config = CompileConfig(backend="fx2xla", fullgraph=True, mode=None)
    config._compile_all_devices = True
    with torch.no_grad():
        eager = model.generate(ids, disable_compile=True, **kw)
        before = {id(g) for g in live_graphs}
        compiled = model.generate(ids, compile_config=config, **kw)
    return model, eager, compiled, [g for g in live_graphs if id(g) not in before]


def test_llama_decode_with_grouped_query_attention_matches_eager():
    _, eager, compiled, graphs = decode_llama(2)
    assert torch.equal(compiled, eager)
    assert any(FLASH in targets(g) for g in graphs)


@pytest.mark.parametrize("batch", [1, 2])
def test_batch_one_decode_copies_no_cache(batch):
    """A LLaMA (2 layers, GQA) decoding 6 tokens with a 96-position static cache, compiled step
    against eager: the same ids, logits within float32 rtol 1e-4 / atol 1e-5. At batch 1 the
    rule multiplies and sums (nn._summed_attention): the step's optimized HLO copies no cache
    (XLA copies a cache written in place four times over when a batched dot reads it through a
    reshape). At batch 2 the rule keeps its batched dots, which XLA reads in place too."""
    model, eager, compiled, graphs = decode_llama(batch, max_cache_len=96, output_logits=True,
                                                  return_dict_in_generate=True)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), **tolerance(torch.float32))
    kv = model.config.num_key_value_heads
    head = model.config.hidden_size // model.config.num_attention_heads
    cache = f"f32[{batch},{kv},96,{head}]"
    hlo = "".join(optimized_hlo_text(g.static.exe) for g in graphs)
    assert cache in hlo, hlo  # the pattern below can match
    copies = re.findall(re.escape(cache) + r"\{[\d,]*\} copy\(", hlo)
    assert not copies, copies


def test_dynamic_lengths_match_eager():
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fx2xla", dynamic=True)
    with torch.no_grad():
        for length in (5, 9, 13):
            q, k, v = qkv(lq=length, lk=length, seed=length)
            assert_matches_eager(fn, (q, k, v), compiled(q, k, v))


def test_folded_layers_keep_attention_in_the_loop():
    from fx2xla.testing import llama

    torch.manual_seed(0)
    model = llama(layers=8, hidden=64).eval()
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    folds = fx2xla.metrics()["scan_folds"]
    with torch.no_grad():
        out, graphs = compiled_graphs(model, ids)
    assert fx2xla.metrics()["scan_folds"] > folds
    bodies = [m for g in graphs for m in g.gm.modules() if isinstance(m, torch.fx.GraphModule)]
    assert any(FLASH in {n.target for n in b.graph.nodes if n.op == "call_function"} for b in bodies)
    with torch.no_grad():
        torch.testing.assert_close(out.logits, model(ids).logits, **tolerance(torch.float32))
