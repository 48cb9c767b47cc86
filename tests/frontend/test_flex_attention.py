"""FlexAttention (`torch.nn.attention.flex_attention`) lowers whole: forward and backward.

Every compiled call here runs with `fallback="error"`, so the op is lowered (no eager island).
The forward is compared with eager's own flex_attention on the same inputs (its dense path);
the backward with backend="aot_eager", which runs torch's own dense forward and backward ops
(eager torch refuses flex_attention's backward on the CPU, `_validate_device`, so the training
tests lift that check for both contenders; on a CUDA GPU torch allows it). The logsumexp
(`AuxRequest(lse=True)`) is compared with eager's, and -inf where eager's is.

Tolerances: float32 rtol 1e-4 / atol 1e-5; float64 rtol 1e-7 / atol 1e-7, except where an
output passes through the logsumexp, which torch keeps in float32 for every input dtype
(float32's then); bfloat16 rtol 1.6e-2 / atol 1e-2, gradients scaled by 4 (a bf16 ulp of the
largest values, 0.03 at 5, against eager's differently ordered bf16 products), and by 8 where
the forward walked the blocks (its bf16 output, rounded once from an online softmax, is an ulp
from eager's in places, and the query's gradient carries that through dO . O: 0.06 at 5)."""
import pytest
import torch
from torch.nn.attention.flex_attention import (AuxRequest, BlockMask, and_masks, create_block_mask,
                                               flex_attention)

import fx2xla
import fx2xla.lowering.flex as flex_rules
from tests.conftest import tolerance

OPTIONS = {"fallback": "error"}


def _compiled(fn, backend="fx2xla"):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True,
                         options=OPTIONS if backend == "fx2xla" else None)


WALKS = ("block walk", "block walk, all query blocks")


@pytest.fixture(params=["all rows", "row chunks", *WALKS])
def rows(request, monkeypatch):
    """Every way the rules take the query rows. The dense path: all rows at once, and (`row
    chunks`) in chunks of 40 rows by a loop, as where the scores would be more than
    `CHUNK_SCORES` (the last chunk padded: 200, 192 and 128 rows are no multiple of 40). The
    forward's walk over the listed key blocks: one query block a step (the CPU's), and all query
    blocks a step (other platforms'). Yields what the rules chose, for `_assert_rows`."""
    chosen, walked = [], []
    choose, plan = flex_rules.row_chunk, flex_rules.walk_plan

    def chunk_spy(B, H, M, N, block_rows):
        chosen.append(40 if request.param == "row chunks" else choose(B, H, M, N, block_rows))
        return chosen[-1]

    def walk_spy(platform, B, H, M, N, block_mask):
        group = plan(platform, B, H, M, N, block_mask)
        if request.param not in WALKS or group is None:
            group = None
        elif request.param == WALKS[1]:
            group = block_mask[flex_rules.KV_IDX].shape[-2]
        walked.append(group)
        return group

    monkeypatch.setattr(flex_rules, "row_chunk", chunk_spy)
    monkeypatch.setattr(flex_rules, "walk_plan", walk_spy)
    yield request.param, chosen, walked


def _assert_rows(rows, walks=True):
    """The rules took the rows as the fixture asked: chunks of 40 or all at once on the dense
    path, or (where the test's mask has more than one key block: `walks`) the forward walked
    the blocks, one query block a step or all at once."""
    kind, chosen, walked = rows
    if kind in WALKS and walks:
        assert walked and all(w is not None for w in walked), walked
        assert all(w == 1 for w in walked) if kind == WALKS[0] else any(w > 1 for w in walked), walked
    else:
        assert chosen and all(c == (40 if kind == "row chunks" else None) for c in chosen), chosen
        assert all(w is None for w in walked), walked


def test_walk_steps_are_chosen_by_platform_and_number_of_scores(monkeypatch):
    """The block walk: none with fewer than two key blocks or with tables that do not tile the
    query rows; on the CPU one query block a step; elsewhere as many as keep a step's scores
    within CHUNK_SCORES (all of them while they fit), at least one."""
    monkeypatch.setattr(flex_rules, "CHUNK_SCORES", 1 << 20)
    bm = create_block_mask(_causal, B=None, H=None, Q_LEN=1024, KV_LEN=1024, device="cpu").as_tuple()
    assert flex_rules.walk_plan("cpu", 1, 8, 1024, 1024, bm) == 1
    assert flex_rules.walk_plan("cuda", 1, 8, 1024, 1024, bm) == 8  # 8 x 8 x 128 x 128 = 2^20 scores
    assert flex_rules.walk_plan("cuda", 2, 8, 1024, 1024, bm) == 4
    assert flex_rules.walk_plan("cuda", 64, 64, 1024, 1024, bm) == 1
    assert flex_rules.walk_plan("cuda", 1, 8, 1024, 128, bm) is None  # one key block
    assert flex_rules.walk_plan("cuda", 1, 8, 2048, 1024, bm) is None  # 8 query blocks for 2,048 rows


def test_row_chunks_are_chosen_by_the_number_of_scores(monkeypatch):
    """All rows at once while batch x heads x rows x keys <= CHUNK_SCORES; past it, as many rows
    as fit, whole query blocks where at least one fits, and at least one row."""
    monkeypatch.setattr(flex_rules, "CHUNK_SCORES", 1 << 20)
    assert flex_rules.row_chunk(1, 8, 256, 512, 128) is None  # 2^20 scores: fits
    assert flex_rules.row_chunk(2, 8, 256, 512, 128) == 128  # 128 rows fit, one block
    assert flex_rules.row_chunk(1, 8, 1024, 1024, 64) == 128  # 128 rows fit, two blocks
    assert flex_rules.row_chunk(1, 4, 1024, 1024, 100) == 200  # 256 rows fit: two blocks of 100
    assert flex_rules.row_chunk(1, 8, 1024, 4096, 128) == 32  # fewer rows than a block
    assert flex_rules.row_chunk(64, 64, 1024, 4096, 128) == 1


def _causal(b, h, q, kv):
    return q >= kv


def _window(b, h, q, kv):
    return (q - kv).abs() < 40


def _softcap(score, b, h, q, kv):
    return 20 * torch.tanh(score / 20)


def _qkv(B=2, H=4, S=200, D=16, dtype=torch.float32, Hkv=None, Bkv=None, grad=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, S, D, generator=gen, dtype=dtype)
    k, v = (torch.randn(Bkv or B, Hkv or H, S, D, generator=gen, dtype=dtype) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _forward_matches(fn, args):
    """Eager's and the compiled outputs of `fn`, asserted close: the same dtype and shape, except
    float64's logsumexp, which eager returns in float64 and torch's meta (so every compiled
    backend) in float32, compared at float32's tolerance."""
    expected = fn(*args)
    actual = _compiled(fn)(*args)
    expected = expected if isinstance(expected, tuple) else (expected,)
    actual = actual if isinstance(actual, tuple) else (actual,)
    assert len(actual) == len(expected)
    for i, (e, a) in enumerate(zip(expected, actual)):
        assert a.shape == e.shape
        if i == 1 and e.dtype == torch.float64:
            assert a.dtype == torch.float32
            e = e.float()
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, **tolerance(e.dtype))
    return expected, actual


DOC = torch.tensor([0] * 70 + [1] * 100 + [2] * 30)


def _document(b, h, q, kv):  # a mask_mod that reads a captured tensor
    return DOC[q] == DOC[kv]


@pytest.mark.parametrize("mask,block", [
    (_causal, 128),
    (_window, 64),
    (and_masks(_causal, _document), 128),
    (lambda b, h, q, kv: (q >= 64) & (kv <= q), 128),  # rows 0-63 entirely masked
])
def test_forward_with_block_masks_matches_eager(mask, block, rows):
    """Causal, sliding-window (64-row blocks), document (a captured tensor) and partly empty
    masks over a length that is no multiple of the block size, with a soft-capping score_mod:
    the output and the logsumexp match eager's, rows with every key masked give output 0 and
    logsumexp -inf as eager's."""
    S = 200
    bm = create_block_mask(mask, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cpu", BLOCK_SIZE=block)

    def fn(q, k, v):
        out, aux = flex_attention(q, k, v, score_mod=_softcap, block_mask=bm, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    (out, lse), _ = _forward_matches(fn, _qkv(S=S))
    assert torch.isfinite(out).all()
    assert torch.isinf(lse).any() == (mask.__name__ == "<lambda>")  # the partly empty mask's rows
    _assert_rows(rows)


def test_masks_per_batch_and_head_with_grouped_query_heads(rows):
    """Block tables that differ per batch row and per query head (each head its own window,
    batch row 1 also cut into documents), over grouped-query heads (8 over 2): a kv head's block
    serves query heads that list different blocks. Output and logsumexp match eager's."""
    S = 384
    docs = torch.arange(S) // 150

    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv < 48 * (h % 3 + 1)) & ((b == 0) | (docs[q] == docs[kv]))

    bm = create_block_mask(mask, B=2, H=8, Q_LEN=S, KV_LEN=S, device="cpu")

    def fn(q, k, v):
        out, aux = flex_attention(q, k, v, score_mod=_softcap, block_mask=bm, enable_gqa=True,
                                  return_aux=AuxRequest(lse=True))
        return out, aux.lse

    _forward_matches(fn, _qkv(H=8, Hkv=2, S=S))
    _assert_rows(rows)


def test_queries_and_keys_of_other_lengths(rows):
    """300 queries over 700 keys (neither a multiple of the 128-row blocks; the last key block
    runs past the keys), each query seeing keys up to twice its index and below 650: output and
    logsumexp match eager's."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 300, 16, generator=gen)
    k, v = (torch.randn(2, 4, 700, 16, generator=gen) for _ in range(2))
    bm = create_block_mask(lambda b, h, qi, kv: (kv <= 2 * qi) & (kv < 650), B=None, H=None,
                           Q_LEN=300, KV_LEN=700, device="cpu")

    def fn(q, k, v):
        out, aux = flex_attention(q, k, v, score_mod=_softcap, block_mask=bm, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    _forward_matches(fn, [q, k, v])
    _assert_rows(rows)


def test_lengths_change_under_dynamic_shapes(rows):
    """Compiled with dynamic=True and called at 256, 384 and 640 tokens (a block mask made for
    each): every output matches eager's."""
    fn = lambda q, k, v, bm: flex_attention(q, k, v, score_mod=_softcap, block_mask=bm)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fx2xla", dynamic=True, options=OPTIONS)
    for S in (256, 384, 640):
        q, k, v = _qkv(B=1, H=2, S=S)
        bm = create_block_mask(_causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cpu")
        torch.testing.assert_close(compiled(q, k, v, bm), fn(q, k, v, bm), **tolerance(torch.float32))
    _assert_rows(rows)


def test_sharded_over_batch_and_heads_needs_no_collective(rows):
    """q, k, v and the output sharded over a 2 x 4 mesh of the 8 virtual CPU devices, batch
    over one axis and heads over the other: the output matches eager's, and the optimized HLO
    holds no collective (each device attends its own batch rows and heads)."""
    from fx2xla.metrics import live_graphs
    from fx2xla.runtime.executor import optimized_hlo_text
    from fx2xla.sharding import collectives

    mesh = fx2xla.Mesh((2, 4), ("data", "model"))
    spec = ("data", "model", None, None)
    S = 384
    bm = create_block_mask(_causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cpu")

    def fn(q, k, v):
        q, k, v = (fx2xla.mark_sharding(t, mesh, spec) for t in (q, k, v))
        return fx2xla.mark_sharding(flex_attention(q, k, v, score_mod=_softcap, block_mask=bm), mesh, spec)

    q, k, v = _qkv(B=2, H=8, S=S)
    before = {id(g) for g in live_graphs}
    actual = _compiled(fn)(q, k, v)
    expected = flex_attention(q, k, v, score_mod=_softcap, block_mask=bm)
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))
    graphs = [g for g in live_graphs if id(g) not in before]
    assert len(graphs) == 1
    assert collectives(optimized_hlo_text(graphs[0].static.exe)) == []
    _assert_rows(rows)


def test_forward_without_mask_or_score_mod_and_with_a_scale():
    """No block mask and no score_mod (plain attention), and an explicit scale, match eager."""
    args = _qkv(S=96)
    _forward_matches(lambda q, k, v: flex_attention(q, k, v), args)
    _forward_matches(lambda q, k, v: flex_attention(q, k, v, scale=0.5), args)


def test_score_mod_reading_indices_and_a_captured_bias(rows):
    """A relative-position score_mod with a per-head bias table (a captured tensor indexed by
    the head index), and grouped-query attention (8 query heads over 2 kv heads)."""
    S = 160
    bias = torch.randn(8)

    def alibi(score, b, h, q, kv):
        return score + bias[h] * (kv - q) / S

    bm = create_block_mask(_causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cpu")
    args = _qkv(H=8, Hkv=2, S=S)
    _forward_matches(lambda q, k, v: flex_attention(q, k, v, score_mod=alibi, block_mask=bm, enable_gqa=True), args)
    _assert_rows(rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_forward_dtypes(dtype, rows):
    """bf16 (scores in float32, probabilities rounded to bf16 before V, as eager) and float64
    (computed in float64; the logsumexp is float32 as torch's meta says)."""
    S = 256
    bm = create_block_mask(_causal, B=None, H=None, Q_LEN=S, KV_LEN=S, device="cpu")

    def fn(q, k, v):
        out, aux = flex_attention(q, k, v, score_mod=_softcap, block_mask=bm, return_aux=AuxRequest(lse=True))
        return out, aux.lse

    _, (out, lse) = _forward_matches(fn, _qkv(S=S, dtype=dtype))
    assert out.dtype == dtype and lse.dtype == torch.float32
    _assert_rows(rows)


def test_block_tables_are_honored_as_the_kernels_do(rows):
    """A BlockMask given only by its tables (`from_kv_blocks`, mask_mod a no-op): q block 0
    attends kv block 0 and q block 1 kv block 1. The result is SDPA with that dense mask. (Eager's
    dense path reads mask_mod alone and would attend everything: the check that it differs makes
    sure the tables decide here.)"""
    S = 256
    q, k, v = _qkv(B=1, H=2, S=S)
    bm = BlockMask.from_kv_blocks(torch.ones(1, 1, 2, dtype=torch.int32),
                                  torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32))
    dense = torch.zeros(S, S, dtype=torch.bool)
    dense[:128, :128] = dense[128:, 128:] = True
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    fn = lambda q, k, v: flex_attention(q, k, v, block_mask=bm)  # noqa: E731
    actual = _compiled(fn)(q, k, v)
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))
    assert (fn(q, k, v) - expected).abs().max() > 0.1
    _assert_rows(rows)


def test_out_of_range_index_in_score_mod_raises(rows):
    """A score_mod reading a captured table at q_idx beyond its length raises
    IndexOutOfRangeError naming the op and this file (XLA would clamp the gather silently)."""
    table = torch.randn(200)
    q, k, v = _qkv(S=256)
    bm = create_block_mask(_causal, B=None, H=None, Q_LEN=256, KV_LEN=256, device="cpu")

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + table[qi], block_mask=bm)

    with pytest.raises(fx2xla.IndexOutOfRangeError) as info:
        _compiled(fn)(q, k, v)
    assert "aten.index" in str(info.value) and "test_flex_attention.py" in str(info.value)
    _assert_rows(rows)


@pytest.fixture
def cpu_backward(monkeypatch):
    """Lift torch's refusal of flex_attention's backward on the CPU (for every backend)."""
    import torch.nn.attention.flex_attention as flex_module
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)


@pytest.mark.parametrize("case", [
    dict(),
    dict(H=8, Hkv=2),  # grouped-query attention: kv gradients summed over each group
    dict(H=8, Hkv=2, mask_heads=8),  # a table per query head: the walk's gradients per query head, summed
    dict(Bkv=1, mask_batch=2),  # key/value broadcast over the batch
    dict(lse=False),  # the logsumexp unused: no gradient flows into it
    dict(dtype=torch.float64),
    dict(dtype=torch.bfloat16),
])
def test_backward_matches_torch_dense_backward(cpu_backward, case, rows):
    """Gradients of q, k, v and of a learnable per-head bias the score_mod reads match torch's
    dense backward (backend="aot_eager"), through the output and the logsumexp."""
    dtype = case.get("dtype", torch.float32)
    H, Hkv, S = case.get("H", 4), case.get("Hkv", 4), 256 if dtype == torch.bfloat16 else 192
    q, k, v = _qkv(H=H, Hkv=Hkv, Bkv=case.get("Bkv"), S=S, dtype=dtype, grad=True)
    bias = torch.randn(H, dtype=dtype).requires_grad_()
    bm = create_block_mask(_causal, B=case.get("mask_batch"), H=case.get("mask_heads"), Q_LEN=S, KV_LEN=S,
                           device="cpu")
    use_lse = case.get("lse", True)

    def fn(q, k, v):
        out, aux = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s + bias[h] * (qi - kv) / S,
                                  block_mask=bm, enable_gqa=H != Hkv, return_aux=AuxRequest(lse=True))
        return out.float().square().sum() + (aux.lse.float().sum() if use_lse else 0)

    results = {}
    for backend in ("aot_eager", "fx2xla"):
        for t in (q, k, v, bias):
            t.grad = None
        loss = _compiled(fn, backend)(q, k, v)
        loss.backward()
        results[backend] = [loss.detach()] + [t.grad for t in (q, k, v, bias)]
    # float64's gradients go through the float32 logsumexp torch saves
    bf16_scale = 8 if rows[0] in WALKS else 4
    tol = tolerance(torch.float32 if dtype == torch.float64 else dtype, bf16_scale if dtype == torch.bfloat16 else 1)
    for name, e, a in zip(("loss", "q", "k", "v", "bias"), results["aot_eager"], results["fx2xla"]):
        if name == "loss" and dtype == torch.float64:
            # aot_eager's float64 logsumexp (eager's dtype) against the float32 of torch's meta,
            # which also drops the .float() before the sum
            e = e.float()
        assert a.dtype == e.dtype and a.shape == e.shape, name
        torch.testing.assert_close(a, e, **tol, msg=name)
    _assert_rows(rows)


def test_transformers_llama_with_flex_attention():
    """A transformers LLaMA (grouped-query, causal) built with attn_implementation=
    "flex_attention" compiles to one executable and matches eager's logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="flex_attention").eval()
    ids = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        expected = model(ids).logits
        torch._dynamo.reset()
        actual = torch.compile(model, backend="fx2xla", options=OPTIONS)(ids).logits
    torch.testing.assert_close(actual, expected, **tolerance(torch.float32))
