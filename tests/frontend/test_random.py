"""Random ops are real randomness: right distributions, fresh values per call, and
`torch.manual_seed` makes compiled runs repeatable; on the CPU the bits are XLA's ThreeFry
RngBitGenerator's."""
import pytest
import scipy.stats
import torch

N = 200_000


def _compile(fn):
    return torch.compile(fn, backend="fx2xla", fullgraph=True)


def test_fresh_values_per_call_and_manual_seed_repeats():
    f = _compile(lambda x: x + torch.rand(1000))
    x = torch.zeros(1000)
    torch.manual_seed(123)
    a, b = f(x), f(x)
    torch.manual_seed(123)
    c = f(x)
    assert not torch.equal(a, b)
    assert torch.equal(a, c)


def test_two_random_ops_in_one_graph_are_independent():
    f = _compile(lambda x: (torch.rand_like(x), torch.rand_like(x)))
    a, b = f(torch.zeros(N))
    assert not torch.equal(a, b)
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rand_is_uniform(dtype):
    torch.manual_seed(0)
    u = _compile(lambda x: torch.rand_like(x))(torch.zeros(N, dtype=dtype))
    assert u.dtype == dtype and u.min() >= 0 and u.max() < 1
    assert scipy.stats.kstest(u.float().numpy()[:20000], "uniform").pvalue > 1e-3


def test_randn_is_standard_normal():
    torch.manual_seed(0)
    z = _compile(lambda x: torch.randn(N) + x)(torch.zeros(()))
    assert scipy.stats.kstest(z.numpy()[:20000], "norm").pvalue > 1e-3
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01


def test_normal_uniform_exponential_parameters():
    torch.manual_seed(0)

    def f(x):
        return (
            torch.empty_like(x).normal_(3.0, 2.0),
            torch.empty_like(x).uniform_(-1.0, 5.0),
            torch.empty_like(x).exponential_(4.0),
        )

    n, u, e = _compile(f)(torch.zeros(N))
    assert abs(n.mean() - 3) < 0.03 and abs(n.std() - 2) < 0.03
    assert u.min() >= -1 and u.max() < 5 and abs(u.mean() - 2) < 0.03
    assert e.min() >= 0 and abs(e.mean() - 0.25) < 0.005


def test_randint_and_randperm():
    torch.manual_seed(0)
    r, p = _compile(lambda x: (torch.randint(3, 10, (N,)), torch.randperm(50) + x))(torch.zeros((), dtype=torch.int64))
    assert r.dtype == torch.int64 and r.min() == 3 and r.max() == 9
    counts = torch.bincount(r - 3, minlength=7).double()
    assert scipy.stats.chisquare(counts.numpy()).pvalue > 1e-3
    assert p.dtype == torch.int64 and torch.equal(p.sort().values, torch.arange(50))
    assert not torch.equal(p, torch.arange(50))


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_dropout_in_training(p):
    torch.manual_seed(0)
    x = torch.randn(N)
    out = _compile(lambda x: torch.nn.functional.dropout(x, p, training=True))(x)
    dropped = out == 0
    assert abs(dropped.double().mean() - p) < 0.01
    if p < 1:
        kept = ~dropped
        torch.testing.assert_close(out[kept], x[kept] / (1 - p))


def test_bernoulli():
    torch.manual_seed(0)
    probs = torch.full((N,), 0.2)
    a, b = _compile(lambda q: (torch.bernoulli(q), q.bernoulli(0.7)))(probs)
    assert set(a.unique().tolist()) <= {0.0, 1.0}
    assert abs(a.mean() - 0.2) < 0.01 and abs(b.mean() - 0.7) < 0.01


def _attention_node(op, *args, **kwargs):
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    return graph.call_function(op, (q, k, v, *args), kwargs)


aten = torch.ops.aten
EFFICIENT = aten._scaled_dot_product_efficient_attention.default


@pytest.mark.parametrize("op,args,kwargs,drops", [
    (EFFICIENT, (None, False, 0.0), {}, False),  # positional
    (EFFICIENT, (None, False, 0.1), {}, True),
    (EFFICIENT, (None, False), {"dropout_p": 0.0}, False),  # keyword
    (EFFICIENT, (None, False), {"dropout_p": 0.2}, True),
    (EFFICIENT, (None, False), {}, False),  # the schema's default
    (aten._scaled_dot_product_flash_attention.default, (), {}, False),
    (aten._scaled_dot_product_flash_attention.default, (0.5,), {}, True),
    (aten._scaled_dot_product_cudnn_attention.default, (None, False), {"dropout_p": 0.3}, True),
    (aten.scaled_dot_product_attention.default, (), {}, False),
    (aten.scaled_dot_product_attention.default, (None, 0.1), {}, True),
], ids=lambda v: str(v) if not isinstance(v, torch._ops.OpOverload) else v._schema.name.split("::")[1])
def test_attention_draws_random_bits_only_with_dropout(op, args, kwargs, drops):
    """The attention rules' `random` predicate reads dropout_p wherever the node has it
    (positional, keyword, or the schema's default): a graph takes a seed only when it drops."""
    from fx2xla.lowering.registry import lowering_for

    node = _attention_node(op, *args, **kwargs)
    assert lowering_for(op).draws(node) is drops


def test_symbolic_dropout_is_assumed_to_draw():
    from fx2xla.lowering.registry import lowering_for

    graph = torch.fx.Graph()
    p = graph.placeholder("p")
    assert lowering_for(EFFICIENT).draws(_attention_node(EFFICIENT, None, False, p))


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_fused_attention_draws_a_seed_only_with_dropout(dropout_p):
    """A graph of fused attention (the memory-efficient kernel's op, as CUDA graphs hold it;
    lowered here on the CPU) takes no seed with dropout_p=0: torch's generator does not advance
    across a call (a drawn seed would be an extra kernel and input per call), and the output
    matches eager's math attention (float32: 1e-5). With dropout it draws (the check can fail)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None, False, dropout_p)[0],
                             backend="fx2xla", fullgraph=True, options={"fallback": "error"})
    compiled(q, k, v)
    state = torch.random.get_rng_state()
    out = compiled(q, k, v)
    assert torch.equal(torch.random.get_rng_state(), state) == (dropout_p == 0)
    if not dropout_p:
        expected = aten._scaled_dot_product_attention_math(q, k, v)[0]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cpu_bits_are_xlas_threefry(dtype):
    """On the CPU the bits come from XLA's RngBitGenerator with the ThreeFry algorithm (not
    XLA:CPU's default, Philox, 4x slower there): the StableHLO says so, and 32- and 64-bit draws
    are uniform (float64 draws take 64-bit words)."""
    from fx2xla.metrics import live_graphs

    before = {id(g) for g in live_graphs}
    torch.manual_seed(0)
    u = _compile(lambda x: torch.rand_like(x))(torch.zeros(N, dtype=dtype))
    texts = [g.static.lowered.module_text for g in live_graphs if id(g) not in before and g.static is not None]
    assert texts and all("rng_bit_generator" in t and "THREE_FRY" in t for t in texts), texts
    assert u.dtype == dtype and u.min() >= 0 and u.max() < 1
    assert scipy.stats.kstest(u.numpy()[:20000], "uniform").pvalue > 1e-3



@pytest.mark.parametrize("checkpointed", [True, False], ids=["checkpointed", "plain"])
def test_checkpointed_random_ops_recompute_the_forwards_bits(checkpointed):
    """Activation checkpointing (torch.utils.checkpoint, non-reentrant) around dropout and
    rand_like lowers whole (fallback="error": the forward's `run_and_save_rng_state` and the
    backward's `run_with_rng_state` have rules), and the backward recomputes the forward's
    draws. Each of two blocks returns tanh(linear(x)) * r, r its dropout mask times noise in
    [0.5, 1.5); the test reads r back from the compiled forward's outputs and replays the blocks
    eagerly with those r: the gradients of x, the linear's weight and bias equal the replay's
    (float32, rtol 1e-4 / atol 1e-5). The backward leaves torch's generator as it was. Two
    steps draw different masks; every block drops some."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def block(x):
        ones = torch.ones_like(x)
        return torch.tanh(lin(x)) * (torch.nn.functional.dropout(ones, 0.5) * (torch.rand_like(x) + 0.5))

    def fn(x):
        y1 = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        y2 = checkpoint(block, y1, use_reentrant=False) if checkpointed else block(y1)
        return y1, y2

    compiled = torch.compile(fn, backend="fx2xla", options={"fallback": "error"})
    dropped = []
    for _ in range(2):
        x = torch.randn(16, 8, requires_grad=True)
        lin.zero_grad()
        y1, y2 = compiled(x)
        state = torch.get_rng_state()
        (y1.sum() + y2.square().sum()).backward()
        assert torch.equal(torch.get_rng_state(), state)  # the recomputation draws no seed
        got = (x.grad, lin.weight.grad.clone(), lin.bias.grad.clone())
        with torch.no_grad():
            r1, r2 = y1 / torch.tanh(lin(x)), y2 / torch.tanh(lin(y1))
        x_ref = x.detach().clone().requires_grad_()
        lin.zero_grad()
        e1 = torch.tanh(lin(x_ref)) * r1
        e2 = torch.tanh(lin(e1)) * r2
        (e1.sum() + e2.square().sum()).backward()
        for a, e in zip(got, (x_ref.grad, lin.weight.grad, lin.bias.grad)):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
        assert (r1 == 0).any() and (r2 == 0).any() and (r1 != 0).any()
        dropped.append(r1 == 0)
    assert not torch.equal(dropped[0], dropped[1])


def _strict(fn):
    return torch.compile(fn, backend="fx2xla", options={"fallback": "error"})


def test_cauchy_log_normal_geometric():
    """Tensor.cauchy_, log_normal_ and geometric_ lower and draw their distributions: KS tests
    against scipy's Cauchy(1, 2) and lognormal(0.5, 0.3) at p > 0.01 (seeded, so fixed), and
    geometric(0.2) means within 2% of 1/p with a minimum of 1, in float32 and int64."""
    torch.manual_seed(0)
    x = torch.zeros(N)
    a = _strict(lambda x: x.clone().cauchy_(1.0, 2.0))(x)
    assert scipy.stats.kstest(a.numpy(), "cauchy", args=(1.0, 2.0)).pvalue > 0.01
    a = _strict(lambda x: x.clone().log_normal_(0.5, 0.3))(x)
    assert scipy.stats.kstest(a.numpy(), "lognorm", args=(0.3, 0, float(torch.tensor(0.5).exp()))).pvalue > 0.01
    for dtype in (torch.float32, torch.int64):
        g = _strict(lambda x: x.to(dtype).geometric_(0.2))(x)
        assert g.dtype == dtype and g.min() == 1
        assert abs(g.double().mean().item() - 5.0) < 0.1


def test_multinomial_with_and_without_replacement():
    """torch.multinomial lowers: with replacement the category frequencies are the normalized
    weights (within 0.01 over 50,000 draws); without, each row's draws are distinct, a zero
    weight is never drawn, and the first and second draws follow sequential sampling's
    distributions (within 0.015). 1-D and 2-D weights; int64 results; seeded runs repeat."""
    torch.manual_seed(0)
    w = torch.tensor([1.0, 0.0, 6.0, 3.0])
    p = w / w.sum()
    draws = _strict(lambda w: torch.multinomial(w, 50_000, replacement=True))(w)
    assert draws.dtype == torch.int64 and draws.shape == (50_000,)
    assert torch.allclose(torch.bincount(draws, minlength=4) / 50_000, p, atol=0.01)
    rows = 20_000
    f = _strict(lambda w: torch.multinomial(w, 3))
    torch.manual_seed(1)
    picked = f(w.repeat(rows, 1))
    torch.manual_seed(1)
    assert torch.equal(picked, f(w.repeat(rows, 1)))
    assert picked.shape == (rows, 3) and (picked != 1).all()
    assert all(len(set(r)) == 3 for r in picked[:500].tolist())
    second = torch.tensor([sum(p[i] * p[j] / (1 - p[i]) for i in range(4) if i != j) for j in range(4)])
    assert torch.allclose(torch.bincount(picked[:, 0], minlength=4) / rows, p, atol=0.015)
    assert torch.allclose(torch.bincount(picked[:, 1], minlength=4) / rows, second.float(), atol=0.015)


@pytest.mark.parametrize("weights, samples, words", [
    ([0.5, -0.1], 1, "element < 0"), ([float("nan"), 1.0], 1, "element < 0"), ([float("inf"), 1.0], 1, "inf"),
    ([0.0, 0.0], 1, "sum of probabilities <= 0"), ([0.0, 1.0, 0.0], 2, "not enough non-negative category")])
def test_multinomial_rejects_invalid_distributions(weights, samples, words):
    """Weights eager rejects raise fx2xla.InvalidValueError with eager's words when the graph
    runs (never a silent draw); more samples than categories without replacement is rejected
    while compiling."""
    import fx2xla

    with pytest.raises(fx2xla.InvalidValueError, match=words):
        _strict(lambda w: torch.multinomial(w, samples))(torch.tensor(weights))
    torch._dynamo.reset()
    with pytest.raises(fx2xla.InvalidInputError, match="without replacement"):
        _strict(lambda w: torch.multinomial(w, 3))(torch.tensor([0.5, 0.5]))


def test_rrelu_training_and_eval():
    """nn.RReLU in training scales each negative element by its own slope in [lower, upper)
    (mean within 0.002 of the middle), keeps positives, and its gradient is that slope; in eval
    it equals eager's (float32, rtol 1e-4 / atol 1e-5). Lowered whole, backward included."""
    torch.manual_seed(0)
    m = torch.nn.RReLU(0.1, 0.3).train()
    x = torch.randn(N, requires_grad=True)
    y = _strict(m)(x)
    slope = (y / x).detach()
    negative = x.detach() < 0
    assert slope[negative].min() >= 0.1 and slope[negative].max() < 0.3
    assert abs(slope[negative].mean().item() - 0.2) < 0.002 and (slope[~negative] == 1).all()
    y.sum().backward()
    torch.testing.assert_close(x.grad, slope, rtol=1e-4, atol=1e-5)
    m.eval()
    torch._dynamo.reset()
    xe = torch.randn(64)
    torch.testing.assert_close(_strict(m)(xe), m(xe), rtol=1e-4, atol=1e-5)
