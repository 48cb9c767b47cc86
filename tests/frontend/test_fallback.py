"""Ops with no lowering rule run eagerly between XLA subgraphs; one warning per op kind."""
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
