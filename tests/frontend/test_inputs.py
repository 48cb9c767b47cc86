"""Inputs of every kind reach the executable unchanged and outputs come back as eager's."""
import pytest
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8]


def _affine(x, y):
    return x * 3 + y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtypes_round_trip(check, dtype):
    x = (torch.arange(12) % 7).to(dtype).reshape(3, 4)
    y = (torch.arange(12) % 5).to(dtype).reshape(3, 4)
    out = check(_affine, x, y)
    assert out.dtype == dtype


def test_int64_stays_int64_beyond_int32_range(check):
    x = torch.tensor([2**40, -(2**35), 7], dtype=torch.int64)
    check(_affine, x, x)


def test_int64_does_not_flip_jax_x64():
    import jax

    before = jax.config.jax_enable_x64
    torch.compile(_affine, backend="fx2xla")(torch.arange(3), torch.arange(3))
    assert jax.config.jax_enable_x64 == before


def test_bool_inputs(check):
    x = torch.tensor([True, False, True])
    check(lambda a, b: a * b + a, x, torch.tensor([False, False, True]))


def test_zero_dim(check):
    check(_affine, torch.tensor(2.5), torch.tensor(-1.0))


def test_zero_dim_with_tensor(check):
    check(_affine, torch.tensor(2.5), torch.randn(3, 2))


def test_empty(check):
    check(_affine, torch.randn(0, 4), torch.randn(0, 4))


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(5, 3).t(),  # transposed: passed as a permuted dense view
        lambda: torch.randn(4, 6, 5).permute(2, 0, 1),
        lambda: torch.randn(8, 6)[::2, 1:5],  # sliced strides: copied dense first
        lambda: torch.randn(3, 1).expand(3, 4),  # stride 0
        lambda: torch.randn(33)[1:].view(4, 8),  # not 64-byte aligned
    ],
    ids=["transposed", "permuted3d", "sliced", "expanded", "unaligned"],
)
def test_non_contiguous_and_unaligned(check, make):
    x = make()
    y = torch.randn(x.shape)
    check(_affine, x, y)


def test_output_strides_follow_eager():
    def f(x):
        return (x * 2).t()  # eager returns a transposed (column-major) result

    x = torch.randn(3, 5)
    out = torch.compile(f, backend="fx2xla")(x)
    ref = f(x)
    torch.testing.assert_close(out, ref)
    assert out.stride() == ref.stride()


def test_inplace_on_input_takes_effect():
    def f(x, y):
        x.mul_(2)
        return x + y

    x, y = torch.randn(4), torch.randn(4)
    xe = x.clone()
    ref = f(xe, y)
    out = torch.compile(f, backend="fx2xla")(x, y)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x, xe)  # the mutation reached the caller's tensor


def test_parameters_updated_between_calls_are_seen():
    """Resident parameter buffers must not go stale after an in-place update."""
    lin = torch.nn.Parameter(torch.randn(4))

    def f(x):
        return x * lin

    c = torch.compile(f, backend="fx2xla")
    x = torch.randn(4)
    with torch.no_grad():
        torch.testing.assert_close(c(x), x * lin)
        lin.mul_(3)
        torch.testing.assert_close(c(x), x * lin)
        lin.data = torch.randn(4)  # a new storage behind the same Parameter
        torch.testing.assert_close(c(x), x * lin)


def test_outputs_that_are_views_of_inputs_are_not_copied():
    """Saved tensors of a training forward include inputs and permuted weights: they come back
    as views of the caller's tensors, not as copies through the executable."""
    from fx2xla.compiled_graph import CompiledGraph
    from fx2xla.runtime import default_device
    from torch.fx.experimental.proxy_tensor import make_fx

    def fwd(x, w):
        wt = torch.ops.aten.permute.default(w, [1, 0])
        return torch.ops.aten.mm.default(x, wt), x, wt

    x, w = torch.randn(4, 3), torch.randn(5, 3)
    gm = make_fx(fwd)(x, w)
    g = CompiledGraph(gm, [x, w], default_device(), "views", resident_inputs=set())
    out, x_out, wt_out = g([x, w])
    torch.testing.assert_close(out, x @ w.t())
    assert x_out.data_ptr() == x.data_ptr() and x_out.shape == x.shape
    assert wt_out.data_ptr() == w.data_ptr() and wt_out.stride() == w.t().stride()
    assert g.static.lowered.module_text.count("return") == 1
    assert len(g.static.lowered.outputs) == 3 and sum(p.kind == "tensor" for p in g.static.lowered.outputs) == 1


def test_expanded_output_keeps_eager_broadcast_strides():
    from fx2xla.compiled_graph import CompiledGraph
    from fx2xla.runtime import default_device
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return torch.ops.aten.expand.default(x * 2, [4, 3])

    x = torch.randn(1, 3)
    gm = make_fx(f)(x)
    (out,) = CompiledGraph(gm, [x], default_device(), "expand", resident_inputs=set())([x])
    torch.testing.assert_close(out, f(x))
    assert out.stride() == f(x).stride()


def test_conjugate_and_negative_views_are_read_as_eager():
    """A complex input with torch's lazy conjugate bit (`x.conj()`, the strided `x.mH`) or a real
    input with its negative bit (`x.conj().imag`) reaches the executable with the bit applied:
    each result equals eager's exactly (complex64 / float32, rtol = atol = 0: one add or multiply),
    the inputs keep their bits, and the same compiled function then gives eager's result for the
    plain tensors too (whichever kind it saw first)."""
    x = torch.randn(3, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    f = torch.compile(lambda a: a * 2 + 1, backend="fx2xla", options={"fallback": "error"})
    for a in (x.conj(), x.mH, x.conj().imag, x, x.imag, x.mH.resolve_conj()):
        before = (a.is_conj(), a.is_neg())
        torch.testing.assert_close(f(a), a * 2 + 1, rtol=0, atol=0)
        assert (a.is_conj(), a.is_neg()) == before
    assert x.conj().is_conj() and x.mH.is_conj() and x.conj().imag.is_neg()
    g = torch.compile(lambda a: a - 1, backend="fx2xla", options={"fallback": "error"})
    for a in (x, x.conj(), x.imag, x.conj().imag):  # the plain kind first this time
        torch.testing.assert_close(g(a), a - 1, rtol=0, atol=0)
