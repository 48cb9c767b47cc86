"""Inputs of every kind reach the executable unchanged and outputs come back as eager's."""
import pytest
import torch

import fx2xla

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


WEIGHT_COPIES = {  # modules whose weight an inference graph imports as a copy, kept per version
    "linear_in_out": (lambda: torch.nn.Linear(16, 16), lambda: torch.randn(100, 16), 1e-5),
    "widened_bf16": (lambda: torch.nn.Linear(16, 16).bfloat16(), lambda: torch.randn(32, 16).bfloat16(), 1e-2),
    "conv_channels_last": (lambda: torch.nn.Conv2d(3, 4, 3), lambda: torch.randn(2, 3, 8, 8), 1e-5),
    "zero_copy": (lambda: torch.nn.Linear(16, 16), lambda: torch.randn(2, 16), 1e-5),
}


@pytest.mark.parametrize("case", sorted(WEIGHT_COPIES))
def test_weights_written_around_the_version_counter_are_seen_once_marked(case):
    """The documented ways to change an inference graph's weight between calls (docs/usage.md,
    "Weights changed between calls"): `copy_` under no_grad, and a write through `.data` followed
    by torch.autograd.graph.increment_version, are seen by the next call, for weights the graph
    holds as copies (nn.Linear's laid out [in, out], a bf16 one widened to float32, a
    convolution's channels-last) and for one it reads in place, where a `.data` write is seen
    with no mark. Each call equals eager's (float32 1e-5, bf16 1e-2, rtol and atol)."""
    make, make_x, tol = WEIGHT_COPIES[case]
    torch.manual_seed(0)
    m, x = make().eval(), make_x()
    c = torch.compile(m, backend="fx2xla")

    def same():
        torch.testing.assert_close(c(x), m(x), rtol=tol, atol=tol)

    with torch.no_grad():
        same()
        m.weight.copy_(m.weight * 2)
        same()
        m.weight.data.mul_(-0.5)
        if case != "zero_copy":
            torch.autograd.graph.increment_version(m.weight)
        same()


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


INT_VALUES = {  # uses of an int argument as a value: one executable serves every value
    "scale": lambda x, n: x * n + n,
    "compare": lambda x, n: torch.where(x > n, x, -x),
    "clamp": lambda x, n: x.clamp(max=n),
    "pow": lambda x, n: x.pow(n),
    "remainder": lambda x, n: torch.remainder(x, n) + x // n,
    "int64": lambda x, n: x.long() * n + n * (2**40),
    "bf16": lambda x, n: x.bfloat16() * n,
    "arithmetic": lambda x, n: x * (n * 2 + 1) - (n // 2),
    "roll": lambda x, n: torch.roll(x, n),
}
INT_SIZES = {  # uses a rule needs as a Python int: one executable per value, as before
    "select": lambda x, n: x[n],
    "narrow": lambda x, n: x.narrow(0, n, 2) * 2,
    "full_like": lambda x, n: torch.full_like(x, n) + x,
    "slice_view": lambda x, n: x[n:],
}


@pytest.mark.parametrize("case", sorted(INT_VALUES) + sorted(INT_SIZES))
def test_an_int_argument_that_changes(case):
    """A Python int argument that changes between calls (Dynamo makes it symbolic from the second
    value on): where the graph uses it as a value only, it is passed to the executable as one,
    so values 2-6 share one executable (two specializations in all, with the first call's);
    where a rule needs it as a Python int (an index, a fill value, a view's offset), each value
    specializes its own. Every result equals eager's exactly (dtype, shape, values; float32,
    bf16, int64 beyond 2**32), views of the input included."""
    fn = INT_VALUES.get(case) or INT_SIZES[case]
    x = torch.arange(-4.0, 6.0)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fx2xla")
    before = fx2xla.metrics()["specializations"]
    for n in range(1, 7):
        actual, expected = compiled(x, n), fn(x, n)
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert torch.equal(actual, expected), (n, actual, expected)
    made = fx2xla.metrics()["specializations"] - before
    assert made == (2 if case in INT_VALUES else 6), made


def test_an_int_argument_in_a_training_step():
    """loss = sum(x * w * step) + step, compiled for training with step = 1..5: the forward and
    the backward each take step as a value (the forward returns it for the backward as the call's
    own argument), so after the first call's two graphs the other four values share two more;
    the loss and w's gradient equal eager's (float32, rtol 1e-6, atol 1e-6)."""
    w = torch.nn.Parameter(torch.linspace(-1, 1, 6))

    def loss(x, step):
        return (x * w * step).sum() + step

    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="fx2xla")
    before = fx2xla.metrics()["specializations"]
    for step in range(1, 6):
        x = torch.linspace(0, 1, 6) * step
        results = []
        for f in (compiled, loss):
            out = f(x, step)
            out.backward()
            results.append((out.detach(), w.grad))
            w.grad = None
        torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)
    assert fx2xla.metrics()["specializations"] - before == 4


def test_folded_layers_see_weights_marked_after_a_data_write():
    """A stack of 8 identical blocks folded into one loop (scan_folds moves), trained: after every
    weight is rewritten through `.data` and marked with torch.autograd.graph.increment_version
    (docs/usage.md), the loop's stacked weights are rebuilt, and the loss and every gradient
    equal eager's (float32, rtol 1e-5, atol 1e-6)."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

        def forward(self, h):
            return h + torch.nn.functional.gelu(self.fc(self.ln(h)))

    torch.manual_seed(0)
    m = torch.nn.Sequential(*[Block() for _ in range(8)])
    torch._dynamo.reset()
    folds = fx2xla.metrics()["scan_folds"]
    c = torch.compile(m, backend="fx2xla")
    x = torch.randn(4, 16)
    c(x).pow(2).mean().backward()
    assert fx2xla.metrics()["scan_folds"] > folds
    m.zero_grad()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            torch.autograd.graph.increment_version(p)
    results = []
    for f in (c, m):
        loss = f(x).pow(2).mean()
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in m.parameters()])
        m.zero_grad()
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-6)
