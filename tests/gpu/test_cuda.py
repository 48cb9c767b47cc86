"""On a CUDA GPU (`PJRT_DEVICE=CUDA pytest -m cuda`): models with torch's default SDPA run as
one executable (the fused attention kernels torch picks on CUDA lower: no eager islands), bf16
attention goes to cuDNN's fused kernel, results match eager (float32: rtol 1e-4 / atol 1e-5
scaled by 10 for whole models, 20 for 5 AdamW steps; bfloat16: rtol 1.6e-2 / atol 1e-2 scaled
the same), torch keeps its GPU memory, the hand-off is stream-ordered both ways without host
syncs (inputs written by a long kernel just before a call, outputs read just after, a side
stream, 20 queued calls), CPU scalars beside CUDA tensors are moved, and random ops draw on the
GPU. Skipped without a GPU."""
import os

import pytest
import torch

import fx2xla
from conftest import tolerance

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _cuda_client(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CUDA")


def _gpt2(dtype):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128)
    return transformers.GPT2LMHeadModel(config).eval().to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt2_default_sdpa_runs_without_islands(dtype):
    model = _gpt2(dtype)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    compiled = torch.compile(model, backend="fx2xla", options={"fallback": "error"})
    with torch.no_grad():
        expected = model(ids).logits
        actual = compiled(ids).logits
    assert actual.device == expected.device
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance(dtype, 10))
    assert fx2xla.metrics()["fallback_ops"] == 0


def test_torch_keeps_its_gpu_memory():
    free_before, _ = torch.cuda.mem_get_info()
    model = _gpt2(torch.float32)
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        compiled(torch.randint(0, 1000, (2, 64), device="cuda"))
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
    assert free_after >= 0.9 * free_before, (free_before, free_after)
    memory = fx2xla.metrics()["device_memory"]
    assert any(m["bytes_limit"] for m in memory.values())


# -- stream order: every test here would read stale or unfinished memory without it ---------

def _long_kernel():
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on torch's current stream (test-only)


def _matmul_chain():
    compiled = torch.compile(lambda x: (x @ x).relu() @ x + 1, backend="fx2xla", options={"fallback": "error"})
    return compiled


def test_input_written_by_a_long_kernel_right_before_the_call():
    compiled = torch.compile(lambda x: x * 2, backend="fx2xla")
    x = torch.zeros(1 << 20, device="cuda")
    compiled(x)  # compile first
    _long_kernel()
    x.fill_(1.0)  # queued behind the long kernel: XLA must wait for it
    torch.testing.assert_close(compiled(x), torch.full_like(x, 2.0), rtol=0, atol=0)


def test_output_read_by_torch_right_after_the_call():
    compiled = _matmul_chain()
    x = torch.randn(2048, 2048, device="cuda") / 50
    expected = ((x @ x).relu() @ x + 1)
    compiled(x)
    y = compiled(x)
    total = y.sum()  # queued on torch's stream right away: must wait for XLA's result
    torch.testing.assert_close(total, expected.sum(), rtol=1e-3, atol=1e-2)


def test_a_call_on_a_non_default_stream():
    compiled = torch.compile(lambda x: x * 3 + 1, backend="fx2xla")
    x = torch.zeros(1 << 20, device="cuda")
    compiled(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _long_kernel()
        x.fill_(2.0)
        y = compiled(x)
        z = y + 0  # read on the side stream
    side.synchronize()
    torch.testing.assert_close(z, torch.full_like(x, 7.0), rtol=0, atol=0)


def test_calls_return_before_the_gpu_finishes():
    """20 calls queue without a host sync: the host is back while the GPU still works on the
    kernel queued before them, and one sync at the end gives every result right."""
    compiled = torch.compile(lambda x: x + 1, backend="fx2xla")
    x = torch.zeros(1024, device="cuda")
    compiled(x)
    torch.cuda.synchronize()
    _long_kernel()
    outs = [compiled(x + i) for i in range(20)]
    assert not torch.cuda.current_stream().query()  # the long kernel is still running
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        torch.testing.assert_close(o, torch.full_like(x, i + 1.0), rtol=0, atol=0)


def test_cpu_scalar_beside_cuda_tensors():
    """A CPU 0-d tensor mixed with CUDA tensors (as eager allows) is moved to the GPU first,
    never handed to the CUDA executable as a host pointer (the sliding-window crash)."""
    compiled = torch.compile(lambda x, s: x * s + s, backend="fx2xla")
    x = torch.randn(16, device="cuda")
    s = torch.tensor(3.0)
    out = compiled(x, s)
    assert out.device == x.device
    torch.testing.assert_close(out, x * 3 + 3, rtol=0, atol=0)


def test_random_ops_draw_on_the_gpu():
    compiled = torch.compile(lambda x: torch.nn.functional.dropout(x, 0.5, training=True), backend="fx2xla")
    x = torch.ones(1 << 16, device="cuda")
    torch.manual_seed(0)
    a = compiled(x)
    torch.manual_seed(0)
    b = compiled(x)
    assert a.device == x.device and torch.equal(a, b)
    assert 0.45 < (a == 0).float().mean().item() < 0.55


def _sliding_window_lm(dtype):
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=256, vocab_size=1000,
                                        max_position_embeddings=256, sliding_window=16)
    return transformers.MistralForCausalLM(config).eval().to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_causal_lm(dtype):
    model = _sliding_window_lm(dtype)
    ids = torch.randint(0, 1000, (2, 64), device="cuda")
    compiled = torch.compile(model, backend="fx2xla")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        actual = compiled(ids, use_cache=False).logits
    torch.testing.assert_close(actual.float(), expected.float(), **tolerance(dtype, 10))


def test_bf16_attention_uses_cudnn_fused_attention():
    from fx2xla.metrics import live_graphs

    older = set(live_graphs)
    q = torch.randn(2, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                             backend="fx2xla", options={"fallback": "error"})
    with torch.no_grad():
        out = compiled(q, q, q)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(torch.bfloat16, 4))
    texts = [g._static.lowered.module_text for g in live_graphs if g not in older and g._static is not None]
    assert any("cudnn" in t for t in texts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_adamw_steps_match_eager(dtype):
    from fx2xla.testing import LogitsOnly, llama, token_ids

    torch.manual_seed(0)
    eager = LogitsOnly(llama(layers=2, hidden=128)).to("cuda", dtype)
    compiled_model = LogitsOnly(llama(layers=2, hidden=128)).to("cuda", dtype)
    compiled_model.load_state_dict(eager.state_dict())
    ids = token_ids(2, 32).cuda()
    compiled = torch.compile(compiled_model, backend="fx2xla")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in (eager, compiled_model)]
    for _ in range(5):
        for fn, opt in ((eager, opts[0]), (compiled, opts[1])):
            opt.zero_grad()
            loss = fn(ids).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
    for a, b in zip(compiled_model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.float(), b.float(), **tolerance(dtype, 20))


def test_bf16_logits_gemm_writes_bf16():
    """The bf16 logits GEMM writes bf16 itself: no float32 [rows, vocab] buffer and no separate
    convert over it in the optimized HLO (GPU.md: a 256 µs convert kernel per call before)."""
    from fx2xla.metrics import live_graphs
    from fx2xla.runtime.executor import optimized_hlo_text

    older = set(live_graphs)
    head = torch.nn.Linear(256, 4096, bias=False).to("cuda", torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = torch.compile(head, backend="fx2xla")(x)
        expected = head(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), **tolerance(torch.bfloat16, 4))
    (g,) = [g for g in live_graphs if g not in older]
    hlo = optimized_hlo_text(g._static.exe)
    assert "f32[512,4096]" not in hlo, hlo


def test_gpu_autotune_results_are_kept_beside_the_executables():
    """An fp32 GEMM's autotuning (Triton tilings / cuBLAS algorithms) lands in
    $FX2XLA_CACHE_DIR/xla-autotune, where a later process finds it."""
    folder = os.path.join(os.environ["FX2XLA_CACHE_DIR"], "xla-autotune")
    a = torch.randn(1024, 1024, device="cuda")
    out = torch.compile(lambda a, b: torch.relu(a @ b), backend="fx2xla")(a, a.t().contiguous())
    torch.testing.assert_close(out, torch.relu(a @ a.t()), **tolerance(torch.float32, 10))
    assert os.path.isdir(folder) and os.listdir(folder), "XLA wrote no autotune results"
