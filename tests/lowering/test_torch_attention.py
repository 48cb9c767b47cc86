"""torch's CPU flash-attention kernel inside XLA:CPU executables (fx2xla/torch_kernels.py, kind
"attention"; lowering/nn.py `_torch_attention`).

In CPU inference graphs, attention with at least nn.TORCH_ATTENTION_ROWS query rows runs as the
custom call `fx2xla_torch_attention`, which calls the kernel eager calls for the same op. Where
q, k and v are the graph's inputs (no op of XLA's before the attention), the results are eager's
bit for bit, in float32, bfloat16 and float16: masks of every broadcast shape, causal, a scale,
grouped-query attention (transformers' repeat_kv and enable_gqa), operands laid out [B, L, H, E]
and [B, H, L, E], the batch cut across XLA's threads or not, and for a batch of one, the kv heads
cut. Checked besides the values:
- the custom call is in the program, and where q, k, v come as [B, L, H * E] and the output
  leaves that way, XLA's optimized program transposes nothing;
- with dynamic shapes, each concrete signature takes the kernel, with eager's bits;
- after torch.set_num_threads (which makes MKL's thread count explicit), lengths that leave
  partial blocks keep eager's bits: the kernel's gemms run on one thread, as in eager;
- decode-sized attention (fewer rows), options={"torch_kernels": [...]} without "attention" and
  FX2XLA_TORCH_KERNELS=0 keep XLA's own attention, matching eager at float32 rtol 1e-4 / atol
  1e-5 (tests/conftest.py);
- an executable holding the custom call parks torch's spinning workers, whatever its cost
  analysis says (torch_kernels.calls_handlers);
- four threads calling one compiled attention get eager's results;
- transformers' GPT-2, BERT and LLaMA (4 x 64 tokens) match eager at float32 rtol 1e-4 / atol
  1e-5 with every layer's attention in the kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import calls_in_threads, tolerance

import fx2xla  # noqa: F401  (registers the backend)
from fx2xla import torch_kernels
from fx2xla.lowering.nn import TORCH_ATTENTION_ROWS
from fx2xla.metrics import live_graphs
from fx2xla.runtime.executor import optimized_hlo_text

TARGET = "fx2xla_torch_attention"
pytestmark = pytest.mark.skipif(not torch_kernels.available("attention"), reason=torch_kernels.status())


def attention_calls() -> int:
    return torch_kernels.attention_calls()


def compiled(fn, *args, **options):
    """fn compiled by fx2xla (with `options`) and called once under no_grad: (its output, the
    graphs it made)."""
    before = {id(g) for g in live_graphs}
    with torch.no_grad():
        out = torch.compile(fn, backend="fx2xla", fullgraph=True, options=options or None)(*args)
    return out, [g for g in live_graphs if id(g) not in before]


def module_text(graphs) -> str:
    return "".join(g.static.lowered.module_text for g in graphs)


def repeat_kv(x, n):
    """transformers' repeat_kv: kv head j serves query heads [j*n, (j+1)*n)."""
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


def tensors(*shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


B, H, KV, L, S, E = 2, 4, 2, TORCH_ATTENTION_ROWS, TORCH_ATTENTION_ROWS + 8, 16
MASKS = {
    "none": None,
    "2d": (L, S),
    "batch": (B, 1, 1, S),
    "full": (B, H, L, S),
    "rows": (1, 1, L, 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", list(MASKS))
def test_head_major_operands_match_eager_bit_for_bit(dtype, mask):
    q, k, v = tensors((B, H, L, E), (B, H, S, E), (B, H, S, E), dtype=dtype)
    args = [q, k, v]
    if MASKS[mask] is not None:
        args += tensors(MASKS[mask], dtype=dtype, seed=1)

    def fn(q, k, v, *m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m[0] if m else None, scale=0.3)

    calls = attention_calls()
    out, graphs = compiled(fn, *args)
    assert TARGET in module_text(graphs)
    assert attention_calls() == calls + 1
    with torch.no_grad():
        assert torch.equal(out, fn(*args))


def projected(q, k, v, *, heads, kv_heads, **sdpa):
    """Attention as a transformers layer computes it from [B, L, heads * E] projections: viewed,
    transposed, and the output transposed back to [B, L, heads * E]."""
    b, length, width = q.shape
    e = width // heads
    q = q.view(b, length, heads, e).transpose(1, 2)
    k = k.view(b, k.shape[1], kv_heads, e).transpose(1, 2)
    v = v.view(b, v.shape[1], kv_heads, e).transpose(1, 2)
    if kv_heads != heads and not sdpa.get("enable_gqa"):
        k, v = repeat_kv(k, heads // kv_heads), repeat_kv(v, heads // kv_heads)
    out = F.scaled_dot_product_attention(q, k, v, **sdpa)
    return out.transpose(1, 2).reshape(b, length, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["mha", "repeat_kv", "enable_gqa"])
@pytest.mark.parametrize("batch", [1, 4])
def test_sequence_major_operands_match_eager_and_transpose_nothing(dtype, form, batch):
    kv = H if form == "mha" else KV
    q, k, v = tensors((batch, L, H * E), (batch, L, kv * E), (batch, L, kv * E), dtype=dtype)

    def fn(q, k, v):
        return projected(q, k, v, heads=H, kv_heads=kv, is_causal=True, enable_gqa=form == "enable_gqa")

    out, graphs = compiled(fn, q, k, v)
    with torch.no_grad():
        assert torch.equal(out, fn(q, k, v))
    hlo = "".join(optimized_hlo_text(g.static.exe) for g in graphs)
    assert f'custom_call_target="{TARGET}"' in hlo
    assert " transpose(" not in hlo and " copy(" not in hlo, hlo


@pytest.mark.parametrize("batch", [1, 4])
def test_sliced_across_threads_and_whole_give_eager_bits(batch):
    """Work of a million multiply-adds or more is cut across XLA's intra-op threads (two or more
    on any machine this runs on: one per core), by batch at batch 4 and by kv head at batch 1;
    `batch_slicing(False)` runs it whole. Both are eager's bits."""
    length, e = 64, 32
    q, k, v = tensors((batch, length, H * e), (batch, length, KV * e), (batch, length, KV * e))

    def fn(q, k, v):
        return projected(q, k, v, heads=H, kv_heads=KV, is_causal=True)

    with torch.no_grad():
        want = fn(q, k, v)
    sliced = torch_kernels.sliced_calls()
    out, _ = compiled(fn, q, k, v)
    assert torch_kernels.sliced_calls() == sliced + 1
    assert torch.equal(out, want)
    torch._dynamo.reset()
    with torch_kernels.batch_slicing(False):
        whole, _ = compiled(fn, q, k, v)
    assert torch_kernels.sliced_calls() == sliced + 1
    assert torch.equal(whole, want)


def test_fewer_rows_and_switched_off_keep_xla_attention(monkeypatch):
    def fn(q, k, v):
        return projected(q, k, v, heads=H, kv_heads=KV, is_causal=False)

    short = tensors((2, TORCH_ATTENTION_ROWS - 1, H * E), (2, S, KV * E), (2, S, KV * E))
    full = tensors((2, L, H * E), (2, S, KV * E), (2, S, KV * E))
    cases = [(short, {}), (full, {"torch_kernels": ["convolution", "skinny_matmul"]})]
    for args, options in cases:
        torch._dynamo.reset()
        out, graphs = compiled(fn, *args, **options)
        assert TARGET not in module_text(graphs)
        with torch.no_grad():
            torch.testing.assert_close(out, fn(*args), **tolerance(torch.float32))
    torch._dynamo.reset()
    monkeypatch.setenv("FX2XLA_TORCH_KERNELS", "0")
    out, graphs = compiled(fn, *full)
    assert TARGET not in module_text(graphs)
    with torch.no_grad():
        torch.testing.assert_close(out, fn(*full), **tolerance(torch.float32))


def test_dynamic_shapes_take_the_kernel_per_signature():
    """A graph with symbolic lengths is lowered per concrete signature, each with the kernel and
    eager's bits."""
    def fn(q, k, v):
        return projected(q, k, v, heads=H, kv_heads=KV, is_causal=True)

    dyn = torch.compile(fn, backend="fx2xla", dynamic=True)
    with torch.no_grad():
        for length in (TORCH_ATTENTION_ROWS, TORCH_ATTENTION_ROWS + 5, TORCH_ATTENTION_ROWS + 9):
            args = tensors((2, length, H * E), (2, length, KV * E), (2, length, KV * E), seed=length)
            calls = attention_calls()
            out = dyn(*args)
            assert attention_calls() == calls + 1, length
            assert torch.equal(out, fn(*args)), length


@pytest.mark.parametrize("length", [TORCH_ATTENTION_ROWS + 5, TORCH_ATTENTION_ROWS + 9])
def test_explicit_torch_thread_count_keeps_eager_bits(length):
    """torch.set_num_threads(n) switches MKL's dynamic thread count off and sets MKL's count on
    each thread torch initializes. The handler's kernel runs its gemms outside any parallel
    region, where MKL would then run them on n threads, with other bits than eager's (it runs
    MKL inside its parallel region, on one thread): 1.8e-7 apart at these lengths, whose blocks
    end in partial vectors. The handler holds MKL to one thread too, where torch has MKL (it
    finds MKL's setter exactly then), so the bits are eager's."""
    assert torch_kernels.holds_mkl_threads() == torch.backends.mkl.is_available()
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        def fn(q, k, v):
            return projected(q, k, v, heads=H, kv_heads=KV, is_causal=True)

        args = tensors((2, length, H * E), (2, length, KV * E), (2, length, KV * E), seed=length)
        calls = attention_calls()
        out, _ = compiled(fn, *args)
        assert attention_calls() == calls + 1
        with torch.no_grad():
            assert torch.equal(out, fn(*args))
    finally:
        torch.set_num_threads(before)


def test_executable_with_the_kernel_parks_spinning_workers():
    """Its cost analysis counts no flops for the custom call, yet the kernel's work is the
    call's: such an executable checks for torch's running workers (`park`)."""
    q, k, v = tensors((1, L, H * E), (1, L, H * E), (1, L, H * E))

    def fn(q, k, v):
        return projected(q, k, v, heads=H, kv_heads=H)

    _, graphs = compiled(fn, q, k, v)
    (graph,) = graphs
    assert torch_kernels.calls_handlers(graph.static.exe)
    assert graph.static.park == torch_kernels.parking_on()
    torch._dynamo.reset()
    _, graphs = compiled(fn, q, k, v, torch_kernels=False)
    assert not torch_kernels.calls_handlers(graphs[0].static.exe)


def test_many_threads():
    q, k, v = tensors((2, L, H * E), (2, L, KV * E), (2, L, KV * E))
    masks = tensors(*[(2, 1, 1, L)] * 4, seed=5)

    def fn(inputs):
        q, k, v, m = inputs
        return projected(q, k, v, heads=H, kv_heads=KV, attn_mask=m)

    step = torch.compile(fn, backend="fx2xla")
    inputs = [(q * (i + 1), k, v, masks[i]) for i in range(4)]
    with torch.no_grad():
        want = [fn(x) for x in inputs]
        results = calls_in_threads(step, inputs, calls=5)
    for i, outs in results.items():
        for out in outs:
            assert torch.equal(out, want[i])


@pytest.mark.parametrize("model", ["gpt2", "bert", "llama"])
def test_transformers_models_match_eager(model):
    from fx2xla import testing

    torch.manual_seed(0)
    m = getattr(testing, model)(layers=2, hidden=64).eval()
    ids = torch.randint(1, 1000, (4, 64), generator=torch.Generator().manual_seed(1))
    calls = attention_calls()
    out, graphs = compiled(m, ids)
    assert attention_calls() == calls + 2  # one per layer
    with torch.no_grad():
        torch.testing.assert_close(out[0], m(ids)[0], **tolerance(torch.float32))
