"""Serving warm-up: every shape compiled before traffic; nothing compiles afterwards."""
import pytest
import torch

import fx2xla


class Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1)).softmax(-1)


def test_warmup_then_no_recompile():
    torch.manual_seed(0)
    model = Scorer().eval()
    compiled = torch.compile(model, backend="fx2xla")
    shapes = [(2, 8), (4, 8), (4, 16)]
    with torch.no_grad():
        report = fx2xla.warmup(compiled, [fx2xla.TensorSpec(s, torch.int64) for s in shapes], progress=False)
        assert report["signatures"] == 3 and report["compiles"] >= 1
        with fx2xla.no_recompile():
            for s in shapes:  # warmed-up shapes run, and match eager
                ids = torch.randint(0, 50, s)
                torch.testing.assert_close(compiled(ids), model(ids))
            with pytest.raises(Exception, match="after warm-up") as info:
                compiled(torch.randint(0, 50, (3, 5)))
            assert "[3, 5]" in str(info.value)
        compiled(torch.randint(0, 50, (3, 5)))  # outside the region it compiles again


def test_no_recompile_option_allows_only_warmup():
    compiled = torch.compile(lambda x: x.cumsum(0) * 2, backend="fx2xla", options={"no_recompile": True})
    with pytest.raises(Exception, match="no_recompile"):
        compiled(torch.randn(4))
    fx2xla.warmup(compiled, [torch.randn(4), (torch.randn(6),), torch.Size([9])], progress=False)
    x = torch.randn(6)
    torch.testing.assert_close(compiled(x), x.cumsum(0) * 2)
    with pytest.raises(Exception, match="no_recompile"):
        compiled(torch.randn(7))


@pytest.mark.parametrize("n", [3, 6, 11])
def test_dynamic_shapes_match_eager(n):
    def f(x, y):
        return (x @ y).relu().sum(0) + x.shape[0]

    compiled = torch.compile(f, backend="fx2xla", dynamic=True)
    for m in (n, n + 1, 2 * n):
        x, y = torch.randn(m, 5), torch.randn(5, n)
        torch.testing.assert_close(compiled(x, y), f(x, y))


def test_mark_dynamic_specialises_per_size_and_caches():
    def f(x):
        return torch.nn.functional.gelu(x).mean(-1)

    compiled = torch.compile(f, backend="fx2xla")
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    compiled(x)
    before = fx2xla.metrics()["specializations"]
    for b in (2, 5, 2, 5):
        xb = torch.randn(b, 8)
        torch.testing.assert_close(compiled(xb), f(xb))
    assert fx2xla.metrics()["specializations"] - before == 2  # one per new size, then cached


def test_batch_buckets_pad_and_share_executables():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).eval()
    compiled = torch.compile(model, backend="fx2xla", options={"batch_buckets": [4, 8]})
    x = torch.randn(2, 8)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        compiled(x)
        before = fx2xla.metrics()["specializations"]
        for b in (3, 5, 6, 7, 8):  # (batch 1 would be a new static graph: Dynamo specialises 1)
            xb = torch.randn(b, 8)
            out = compiled(xb)
            assert out.shape == (b, 3)
            torch.testing.assert_close(out, model(xb), rtol=1e-4, atol=1e-5)
        # 3 shares bucket 4 (compiled already for the first call, batch 2); 5-8 share bucket 8.
        assert fx2xla.metrics()["specializations"] - before == 1
