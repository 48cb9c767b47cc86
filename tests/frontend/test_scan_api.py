"""fx2xla.scan / fx2xla.scan_layers (and torch's scan, cond, while_loop ops): compiled with fx2xla
they are one StableHLO loop; results and gradients match an eager Python loop.

Tolerances: conftest's per dtype (float32 rtol 1e-4 / atol 1e-5, bfloat16 rtol 1.6e-2 / atol
1e-2, integers exact), loosened 10x for gradients through several steps (XLA reorders float
math inside the loop)."""
from __future__ import annotations

import glob
import importlib
import os

import pytest
import torch
import torch.nn.functional as F

import fx2xla
from tests.conftest import tolerance

scan_module = importlib.import_module("fx2xla.scan")  # `fx2xla.scan` is the function


def _compile(fn, **kwargs):
    return torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"}, **kwargs)


def _close(actual, expected, scale=1.0):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    torch.testing.assert_close(actual, expected, **tolerance(expected.dtype, scale))


def _leaf(t, requires_grad=True):
    return t.detach().clone().requires_grad_(requires_grad)


def _stablehlo(dump_dir, kind="forward"):
    """Texts of the dumped StableHLO modules whose name contains `kind`."""
    files = sorted(f for f in glob.glob(os.path.join(dump_dir, "*.stablehlo.mlir")) if kind in os.path.basename(f))
    return [open(f).read() for f in files]


@pytest.fixture
def dump_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FX2XLA_DUMP_DIR", str(tmp_path))
    return str(tmp_path)


# ---------------------------------------------------------------------------- fx2xla.scan


def _rnn_step(w):
    def step(h, x):
        h = torch.tanh(h @ w + x)
        return h, (h * 2.0, h.sum())
    return step


def _loop_reference(step, h, xs, reverse=False):
    ys = [None] * xs.shape[0]
    for i in (reversed(range(xs.shape[0])) if reverse else range(xs.shape[0])):
        h, ys[i] = step(h, xs[i])
    return h, tuple(torch.stack(list(t)) for t in zip(*ys))


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_forward_and_grads_match_python_loop(reverse, dump_dir):
    torch.manual_seed(0)
    w0, h0, xs0 = torch.randn(4, 4) * 0.5, torch.randn(4), torch.randn(7, 4)

    def run(fn):
        w, h, xs = _leaf(w0), _leaf(h0), _leaf(xs0)
        final, ys = fn(_rnn_step(w), h, xs)
        (final.sum() * 3 + (ys[0] * torch.arange(7.0)[:, None]).sum() + ys[1].pow(2).sum()).backward()
        return final, ys, (h.grad, xs.grad, w.grad)

    compiled = _compile(lambda step, h, xs: fx2xla.scan(step, h, xs, reverse=reverse))
    final, ys, grads = run(compiled)
    ref_final, ref_ys, ref_grads = run(lambda step, h, xs: _loop_reference(step, h, xs, reverse))
    _close(final, ref_final)
    _close(ys[0], ref_ys[0])
    _close(ys[1], ref_ys[1])
    for g, r in zip(grads, ref_grads):  # init, xs, closed-over parameter
        _close(g, r, scale=10)
    # eager fx2xla.scan: the same values
    e_final, e_ys, e_grads = run(lambda step, h, xs: fx2xla.scan(step, h, xs, reverse=reverse))
    _close(e_final, ref_final)
    for g, r in zip(e_grads, ref_grads):
        _close(g, r)
    # forward and backward are one loop each, not 7 unrolled steps
    for kind in ("forward", "backward"):
        (text,) = _stablehlo(dump_dir, kind)
        assert text.count("stablehlo.while") == 1, kind


def test_scan_pytrees_and_dtypes():
    torch.manual_seed(0)
    init = {"f": torch.randn(3), "b": torch.randn(2, 3).bfloat16(), "n": torch.tensor(5, dtype=torch.int64)}
    xs = (torch.randn(6, 3), {"k": torch.randint(-4, 4, (6,), dtype=torch.int64), "v": torch.randn(6, 2, 3).bfloat16()})

    def step(c, x):
        u, d = x
        f = c["f"] * 0.5 + u
        b = c["b"] * 0.75 + d["v"]
        n = c["n"] * 2 - d["k"]  # int64 carry: exact
        return {"f": f, "b": b, "n": n}, [f.sum(), {"b": b.float(), "n": n}]

    def loop(init, xs):
        c, ys = init, []
        for i in range(6):
            c, y = step(c, (xs[0][i], {"k": xs[1]["k"][i], "v": xs[1]["v"][i]}))
            ys.append(y)
        return c, [torch.stack([y[0] for y in ys]),
                   {"b": torch.stack([y[1]["b"] for y in ys]), "n": torch.stack([y[1]["n"] for y in ys])}]

    expected = loop(init, xs)
    for actual in (_compile(lambda i, x: fx2xla.scan(step, i, x))(init, xs), fx2xla.scan(step, init, xs)):
        carry, ys = actual
        assert set(carry) == {"f", "b", "n"} and isinstance(ys, list) and set(ys[1]) == {"b", "n"}
        for key in ("f", "b", "n"):
            _close(carry[key], expected[0][key])
        _close(ys[0], expected[1][0])
        # b.float() of bf16 values carries bf16's precision: XLA may round `c*0.75 + v` to bf16
        # once where eager rounds after each op (seen on a CPU with AVX-512 bf16)
        assert ys[1]["b"].dtype == torch.float32
        torch.testing.assert_close(ys[1]["b"], expected[1][1]["b"], **tolerance(torch.bfloat16))
        _close(ys[1]["n"], expected[1][1]["n"])


def test_scan_without_per_step_output_and_passthrough_carry():
    # y None -> ys None; a carry returned unchanged and y aliasing the carry are fine
    def step(c, x):
        a, b = c
        a = a + x
        return (a, b), a

    init, xs = (torch.zeros(2), torch.ones(2)), torch.arange(8.0).reshape(4, 2)
    for fn in (_compile(lambda i, x: fx2xla.scan(step, i, x)), lambda i, x: fx2xla.scan(step, i, x)):
        (a, b), ys = fn(init, xs)
        _close(a, xs.sum(0))
        _close(b, torch.ones(2))
        _close(ys, xs.cumsum(0))
    for fn in (_compile(lambda i, x: fx2xla.scan(lambda c, x: (c + x, None), i, x)),
               lambda i, x: fx2xla.scan(lambda c, x: (c + x, None), i, x)):
        c, ys = fn(torch.zeros(2), xs)
        assert ys is None
        _close(c, xs.sum(0))


def test_nested_scan(dump_dir):
    def f(c0, xs):
        def outer(c, x):  # an inner scan over the rows of each outer slice
            return fx2xla.scan(lambda a, b: (a * 0.5 + b, a.sum()), c, x)
        return fx2xla.scan(outer, c0, xs)

    c0, xs = torch.randn(3), torch.randn(4, 5, 3)
    expected_c, expected_ys = c0, []
    for i in range(4):
        rows = []
        for j in range(5):
            rows.append(expected_c.sum())
            expected_c = expected_c * 0.5 + xs[i, j]
        expected_ys.append(torch.stack(rows))
    c, ys = _compile(f)(c0, xs)
    _close(c, expected_c)
    _close(ys, torch.stack(expected_ys))
    (text,) = _stablehlo(dump_dir, "")
    assert text.count("stablehlo.while") == 2  # a loop in a loop, nothing unrolled


def test_scan_dropout_differs_per_iteration():
    n, width, p = 8, 4096, 0.25

    def f(x, xs):
        def step(c, x):
            m = F.dropout(x, p=p, training=True)
            return c + m.sum(), m
        return fx2xla.scan(step, x, xs)

    compiled = _compile(f)
    xs = torch.ones(n, width, requires_grad=True)
    total, masks = compiled(torch.zeros(()), xs)
    assert masks.shape == (n, width)
    kept = masks != 0
    # kept elements are scaled by 1/(1-p); the keep rate is 1-p (binomial sd ~0.0024 here)
    torch.testing.assert_close(masks[kept], torch.full_like(masks[kept], 1 / (1 - p)))
    assert abs(kept.float().mean().item() - (1 - p)) < 0.02
    for i in range(1, n):  # every iteration draws its own mask
        assert not torch.equal(kept[0], kept[i]), i
    for i in range(n):
        assert abs(kept[i].float().mean().item() - (1 - p)) < 0.05
    _close(total, masks.sum().detach())
    # the backward loop uses the forward's masks: d(3 * sum(ys))/dxs = 3 * ys when xs = 1
    (masks.sum() * 3).backward()
    _close(xs.grad, 3 * masks.detach())
    _, masks2 = compiled(torch.zeros(()), xs)
    assert not torch.equal(masks2 != 0, kept)  # a fresh seed per call


def test_scan_private_op_and_public_fallback_agree(monkeypatch, dump_dir):
    torch.manual_seed(0)
    w0, h0, xs0 = torch.randn(3, 3), torch.randn(3), torch.randn(5, 3)

    def run(fn):  # forward only: gradients through the op are tested above
        final, ys = fn(_rnn_step(w0), h0, xs0)
        return final, ys[0], ys[1]

    calls = []
    real = scan_module.torch_scan_op

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(scan_module, "torch_scan_op", counting)
    with_op = run(_compile(lambda s, h, x: fx2xla.scan(s, h, x)))
    assert calls, "the compiled path did not use torch's scan op"
    assert _stablehlo(dump_dir, "")[-1].count("stablehlo.while") == 1

    torch._dynamo.reset()
    monkeypatch.setattr(scan_module, "torch_scan_op", lambda: None)  # a torch without the op
    fallback = run(_compile(lambda s, h, x: fx2xla.scan(s, h, x)))
    assert _stablehlo(dump_dir, "")[-1].count("stablehlo.while") == 0  # unrolled Python loop
    eager = run(lambda s, h, x: fx2xla.scan(s, h, x))
    for a, b, c in zip(with_op, fallback, eager):
        _close(a, c, scale=10)
        _close(b, c, scale=10)


def test_scan_errors():
    step = lambda c, x: (c + x, x)  # noqa: E731
    with pytest.raises(ValueError, match=r"same leading size.*\(5, 3\), \(4, 3\)"):
        fx2xla.scan(step, torch.zeros(3), (torch.zeros(5, 3), torch.zeros(4, 3)))
    with pytest.raises(ValueError, match=r"length 0.*\(0, 3\)"):
        fx2xla.scan(step, torch.zeros(3), torch.zeros(0, 3))
    with pytest.raises(ValueError, match="no tensors"):
        fx2xla.scan(step, torch.zeros(3), ())
    with pytest.raises(ValueError, match="leading dimension"):
        fx2xla.scan(step, torch.zeros(3), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"from shape \(3,\) torch.float32 to shape \(3,\) torch.float64"):
        fx2xla.scan(lambda c, x: ((c + x).double(), x), torch.zeros(3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"from shape \(3,\) torch.float32 to shape \(2, 3\)"):
        fx2xla.scan(lambda c, x: (c + x[None].expand(2, 3), x), torch.zeros(3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="structure"):
        fx2xla.scan(lambda c, x: ((c, c), x), torch.zeros(3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="without None"):
        fx2xla.scan(lambda c, x: (c, (x, None)), torch.zeros(3), torch.zeros(5, 3))
    # compiled: input checks run before fn is traced; without fullgraph Dynamo graph-breaks
    # there and the eager check raises the ValueError itself
    loose = torch.compile(lambda i, a, b: fx2xla.scan(step, i, (a, b)), backend="fx2xla")
    with pytest.raises(ValueError, match="same leading size"):
        loose(torch.zeros(3), torch.zeros(5, 3), torch.zeros(4, 3))
    # with fullgraph (and for fn's carry, checked while Dynamo traces fn) Dynamo wraps the
    # error in its own exception, with the message inside
    with pytest.raises(Exception, match=r"same leading size.*\(5, 3\), \(4, 3\)"):
        _compile(lambda i, a, b: fx2xla.scan(step, i, (a, b)))(torch.zeros(3), torch.zeros(5, 3), torch.zeros(4, 3))
    with pytest.raises(Exception, match=r"fn changed carry leaf 0 from shape \(3,\) torch.float32"):
        _compile(lambda i, x: fx2xla.scan(lambda c, x: ((c + x).double(), x), i, x))(torch.zeros(3), torch.zeros(5, 3))

# ---------------------------------------------------------------------- fx2xla.scan_layers


class Block(torch.nn.Module):
    def __init__(self, d=16, hidden=32):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, hidden)
        self.fc2 = torch.nn.Linear(hidden, d)

    def forward(self, x, scale=None):
        h = self.fc2(F.gelu(self.fc1(self.ln(x))))
        return x + (h if scale is None else h * scale)


def _grads(layers):
    return [p.grad.clone() for p in layers.parameters()]


def test_scan_layers_matches_python_loop_and_is_one_loop(dump_dir):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Block() for _ in range(6)])
    x0, scale = torch.randn(2, 5, 16), torch.tensor(0.5)

    def run(fn):
        layers.zero_grad(set_to_none=True)
        x = _leaf(x0)
        out = fn(x)
        (out * torch.linspace(-1, 1, 16)).sum().backward()
        return out, x.grad, _grads(layers)

    def loop(x):
        for layer in layers:
            x = layer(x, scale=scale)
        return x

    expected = run(loop)
    compiled = run(_compile(lambda x: fx2xla.scan_layers(layers, x, scale=scale)))
    eager = run(lambda x: fx2xla.scan_layers(layers, x, scale=scale))
    for actual in (compiled, eager):
        _close(actual[0], expected[0])
        _close(actual[1], expected[1], scale=10)
        assert len(actual[2]) == len(expected[2]) == 6 * 6  # every layer's own parameters
        for g, r in zip(actual[2], expected[2]):
            _close(g, r, scale=10)
    # one while loop, whose body (LayerNorm + 2 Linear) appears once, not 6 times
    (forward,) = _stablehlo(dump_dir, "forward")
    assert forward.count("stablehlo.while") == 1
    assert forward.count("stablehlo.dot_general") == 2
    (backward,) = _stablehlo(dump_dir, "backward")
    assert backward.count("stablehlo.while") == 1


class TupleBlock(Block):
    def __init__(self, extra=False):
        super().__init__(8, 8)
        self.extra = extra

    def forward(self, x):
        y = super().forward(x)
        return (y, y.mean() if self.extra else None, None)


def test_scan_layers_tuple_outputs():
    torch.manual_seed(0)
    layers = [TupleBlock() for _ in range(3)]
    x = torch.randn(4, 8)
    expected = x
    for layer in layers:
        expected = layer(expected)[0]
    with torch.no_grad():
        _close(fx2xla.scan_layers(layers, x), expected)
        _close(_compile(lambda x: fx2xla.scan_layers(layers, x))(x), expected)
    bad = [TupleBlock(extra=True) for _ in range(3)]
    with pytest.raises(ValueError, match=r"non-None elements at positions \[1\]"):
        fx2xla.scan_layers(bad, x)


def test_scan_layers_rejects_heterogeneous_layers():
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"layer 1 is a Linear, layer 0 a Block"):
        fx2xla.scan_layers([Block(), torch.nn.Linear(16, 16)], x)
    with pytest.raises(ValueError, match=r"layer 2's parameter 'fc1.weight' differs.*shape \(64, 16\) vs \(32, 16\)"):
        fx2xla.scan_layers([Block(), Block(), Block(hidden=64)], x)
    frozen = Block()
    frozen.fc2.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"layer 1's parameter 'fc2.bias' differs.*requires_grad False vs True"):
        fx2xla.scan_layers([Block(), frozen], x)
    with pytest.raises(ValueError, match=r"layer 1's parameter 'ln.weight' differs.*dtype torch.float64 vs torch.float32"):
        fx2xla.scan_layers([Block(), Block().double()], x)
    with pytest.raises(ValueError, match="train/eval mode"):
        fx2xla.scan_layers([Block(), Block().eval()], x)
    with pytest.raises(ValueError, match=r"maps x of shape \(2, 16\).*to shape \(2, 8\)"):
        fx2xla.scan_layers([torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)], x)
    bn = [torch.nn.BatchNorm1d(16) for _ in range(2)]
    with pytest.raises(ValueError, match="update buffers.*num_batches_tracked"):
        fx2xla.scan_layers(bn, x)
    assert fx2xla.scan_layers([], x) is x


def test_scan_layers_gpt2_blocks():
    # Forward only: Dynamo needs ~10 s to trace a GPT-2 block inside torch's scan op, twice
    # that with autograd; gradients through scan_layers are covered by the MLP test above.
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4, n_positions=16, vocab_size=10)
    cfg._attn_implementation = "eager"
    blocks = torch.nn.ModuleList([GPT2Block(cfg, layer_idx=i) for i in range(3)]).eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        expected = x
        for block in blocks:
            expected = block(expected)
        _close(_compile(lambda x: fx2xla.scan_layers(blocks, x))(x), expected, scale=10)
        _close(fx2xla.scan_layers(blocks, x), expected)


# --------------------------------------------------------------- torch.cond / while_loop


def test_cond_lowers_to_one_branch_op(dump_dir):
    def f(pred, x, w):
        return torch.cond(pred, lambda x, w: (x @ w).sin(), lambda x, w: x.cos() * 2, (x, w))

    compiled = _compile(f)
    x, w = torch.randn(3, 3), torch.randn(3, 3)
    for pred in (torch.tensor(True), torch.tensor(False)):
        _close(compiled(pred, x, w), f(pred, x, w))
    (text,) = _stablehlo(dump_dir, "")
    assert text.count("stablehlo.case") + text.count("stablehlo.if") == 1


def test_while_loop(dump_dir):
    from torch._higher_order_ops.while_loop import while_loop

    def f(x, n):
        def cond(i, x):
            return i < n

        def body(i, x):
            return i + 1, x * 0.5 + 1.0

        return while_loop(cond, body, (torch.zeros((), dtype=torch.int64), x))

    x, n = torch.randn(4), torch.tensor(5)
    i, out = _compile(f)(x, n)
    expected = x
    for _ in range(5):
        expected = expected * 0.5 + 1.0
    _close(i, torch.tensor(5))
    _close(out, expected)
    (text,) = _stablehlo(dump_dir, "")
    assert text.count("stablehlo.while") == 1
