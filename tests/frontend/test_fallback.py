"""Ops with no lowering rule run eagerly between XLA subgraphs; one warning per op kind."""
import re
import warnings

import pytest
import torch

import fx2xla


@torch.library.custom_op("fx2xla_test::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    return limit * torch.tanh(x / limit)


@soft_clip.register_fake
def _(x, limit):
    return torch.empty_like(x)


@torch.library.custom_op("fx2xla_test::split_halves", mutates_args=())
def split_halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = x.chunk(2, dim=-1)
    return a.clone(), b.clone()


@split_halves.register_fake
def _(x):
    h = x.shape[-1] // 2
    return x.new_empty(*x.shape[:-1], h), x.new_empty(*x.shape[:-1], h)


class ClippedMLP(torch.nn.Module):
    """An MLP whose activation is a custom op that XLA knows nothing about."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        h = soft_clip(self.fc1(x), 2.0)
        a, b = split_halves(h)  # multi-output custom op
        return self.fc2(a * torch.sigmoid(b)).softmax(-1)


def _fallback_warnings(record):
    return [str(w.message) for w in record if "runs eagerly" in str(w.message)]


def test_model_with_custom_ops_matches_eager():
    torch.manual_seed(0)
    model = ClippedMLP().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
        before = fx2xla.metrics()["specializations"]
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            actual = torch.compile(model, backend="fx2xla", fullgraph=True)(x)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    msgs = _fallback_warnings(record)
    assert any("fx2xla_test.soft_clip.default" in m for m in msgs)
    assert any("fx2xla_test.split_halves.default" in m for m in msgs)
    # The XLA parts really ran on XLA: one executable per subgraph around the custom ops.
    assert fx2xla.metrics()["specializations"] - before >= 2


def test_one_warning_per_op_kind(monkeypatch):
    import fx2xla.partition

    monkeypatch.setattr(fx2xla.partition, "warned_ops", set())

    def f(x):
        return soft_clip(soft_clip(x, 1.0) * 2, 3.0) + 1

    x = torch.randn(5)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = torch.compile(f, backend="fx2xla")(x)
        torch._dynamo.reset()
        torch.compile(f, backend="fx2xla")(x * 2)
    torch.testing.assert_close(out, f(x))
    assert len([m for m in _fallback_warnings(record) if "soft_clip" in m]) == 1


def test_fallback_error_option_raises_instead():
    def f(x):
        return soft_clip(x * 2, 1.0)

    c = torch.compile(f, backend="fx2xla", options={"fallback": "error"})
    with pytest.raises(Exception, match="no lowering rule for fx2xla_test.soft_clip.default"):
        c(torch.randn(3))


DATA_DEPENDENT = {
    "mask": (lambda x, n: x[x > 0] * 2 + x.sum(), "aten.index.Tensor"),
    "nonzero": (lambda x, n: torch.nonzero(x > 0).float() + 1, "aten.nonzero.default"),
    "item": (lambda x, n: x[: n.item()] * 2, "aten.slice.Tensor"),
}


@pytest.mark.parametrize("case", sorted(DATA_DEPENDENT))
def test_data_dependent_sizes_run_eagerly(case, monkeypatch):
    """Under Dynamo's capture_dynamic_output_shape_ops / capture_scalar_outputs, an op whose
    result size depends on the data (a boolean mask index, nonzero, a slice to `n.item()`) runs
    eagerly, as does what reads its result, in one graph: two calls whose data select 2 and 4
    elements equal eager's exactly (float32); the warning says why, naming the op; no warning
    names the size checks Dynamo adds; under fallback="error" the op raises UnsupportedOpError
    saying its size depends on the input's values."""
    import fx2xla.partition

    monkeypatch.setattr(fx2xla.partition, "warned_ops", set())
    fn, op = DATA_DEPENDENT[case]
    calls = [(torch.tensor([1.0, -2.0, 3.0, -4.0, 0.5]), torch.tensor(2)),
             (torch.tensor([1.0, 2.0, 3.0, -4.0, 0.5]), torch.tensor(4))]
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True):
        torch._dynamo.reset()
        f = torch.compile(fn, backend="fx2xla", fullgraph=True)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for x, n in calls:
                torch.testing.assert_close(f(x, n), fn(x, n), rtol=0, atol=0)
        msgs = _fallback_warnings(record)
        assert any(op in m and "depends on the input's values" in m for m in msgs), msgs
        assert not any("_assert_scalar" in m or "sym_size" in m or "built-in function" in m for m in msgs), msgs
        torch._dynamo.reset()
        strict = torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})
        with pytest.raises(fx2xla.errors.UnsupportedOpError, match="depends on the input's values"):
            strict(*calls[0])


def test_scalar_reads_nothing_needs_are_dropped():
    """Device values read as Python scalars that nothing needs (a sum's `.item()` never used, a
    bool `.item()` only read by the range checks Dynamo adds) leave no eager read behind: the
    graph compiles with fallback="error" and matches eager (float32, exact). A check on a bool
    read that can fail (`torch._check(b)`) stays: it runs eagerly and raises for a negative
    input, as eager does, and a positive input passes."""
    def unused(x, m):
        x.sum().item()
        causal = bool((m == torch.ones(3, 3, dtype=torch.bool).triu(1)).all())  # as nn.Transformer does
        del causal
        return x * 2

    def checked(x):
        b = (x > 0).all().item()
        torch._check(b)
        return x * 3

    x, m = torch.tensor([1.0, -2.0, 3.0]), torch.ones(3, 3, dtype=torch.bool).triu(1)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch._dynamo.reset()
        f = torch.compile(unused, backend="fx2xla", fullgraph=True, options={"fallback": "error"})
        torch.testing.assert_close(f(x, m), unused(x, m), rtol=0, atol=0)
        torch._dynamo.reset()
        g = torch.compile(checked, backend="fx2xla", fullgraph=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(g(x.abs()), x.abs() * 3, rtol=0, atol=0)
            with pytest.raises(Exception, match="u0|assert|check"):
                g(x)
        torch._dynamo.reset()
        strict = torch.compile(checked, backend="fx2xla", fullgraph=True, options={"fallback": "error"})
        with pytest.raises(fx2xla.errors.UnsupportedOpError, match="_local_scalar_dense"):
            strict(x.abs())


def test_training_patterns_lower_whole():
    """Two training patterns compile with fallback="error" and match eager: the backward of a
    slice assignment on an activation (AOTAutograd's new_empty_strided), and an AdamW step with
    a StepLR scheduler (once the learning rate changes, Dynamo passes it as a symbolic float
    that the graph casts with prims.convert_element_type). Float32: the weight gradient within
    rtol/atol 1e-6; four scheduled steps' parameters within rtol 1e-5, atol 1e-6."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)

    def loss(x):
        h = lin(x)
        h[:, 0] = h[:, 0] * 2
        return h.sum()

    x = torch.randn(4, 8)
    torch._dynamo.reset()
    torch.compile(loss, backend="fx2xla", options={"fallback": "error"})(x).backward()
    compiled_grad, lin.weight.grad = lin.weight.grad, None
    loss(x).backward()
    torch.testing.assert_close(compiled_grad, lin.weight.grad, rtol=1e-6, atol=1e-6)

    params = []
    for compiled in (False, True):
        torch.manual_seed(1)
        m = torch.nn.Linear(8, 4)
        opt = torch.optim.AdamW(m.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        torch._dynamo.reset()
        step = torch.compile(opt.step, backend="fx2xla", options={"fallback": "error"}) if compiled else opt.step
        gen = torch.Generator().manual_seed(2)
        for _ in range(4):
            m(torch.randn(3, 8, generator=gen)).sum().backward()
            step()
            opt.zero_grad()
            sched.step()
        params.append([p.detach().clone() for p in m.parameters()])
    for a, e in zip(params[1], params[0], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_ops_torch_nn_calls_are_placed_by_module(monkeypatch):
    """An op with no rule that torch.nn's own code calls (Dynamo records no line of the user's
    for it) is placed by the module it ran in, in the fallback warning and in the
    fallback="error" message: `module 1 (torch.nn.modules.pooling.FractionalMaxPool2d)`.
    (Its op, with its rule taken out of the registry for the test, stands for any op without
    one: every torch.nn module has rules now.)"""
    import fx2xla.lowering.registry
    import fx2xla.partition

    monkeypatch.setattr(fx2xla.partition, "warned_ops", set())
    monkeypatch.delitem(fx2xla.lowering.registry.LOWERINGS, torch.ops.aten.fractional_max_pool2d.default)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.FractionalMaxPool2d(2, output_size=(3, 3)))
    model = model.to(torch.bfloat16)
    x = torch.randn(1, 3, 9, 9, dtype=torch.bfloat16)
    where = "module 1 (torch.nn.modules.pooling.FractionalMaxPool2d)"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        torch.compile(model, backend="fx2xla")(x)
    assert any("fractional_max_pool2d" in m and where in m for m in _fallback_warnings(record)), \
        _fallback_warnings(record)
    torch._dynamo.reset()
    with pytest.raises(fx2xla.errors.UnsupportedOpError, match=re.escape(where)):
        torch.compile(model, backend="fx2xla", options={"fallback": "error"})(x)
