"""Real models compile whole (fullgraph) and match eager, in float32 and bfloat16."""
import pytest
import torch

from fx2xla.testing import LogitsOnly, SmallCNN, bert, gpt2, llama, mlp, token_ids

# Whole-model tolerances: errors of many fused ops add up, more so in bf16.
MODEL_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}

CASES = {
    "mlp": (lambda: mlp(64, 256, 32), lambda: (torch.randn(8, 64),)),
    "cnn": (SmallCNN, lambda: (torch.randn(2, 3, 32, 32),)),
    "gpt2": (lambda: LogitsOnly(gpt2(layers=4, hidden=256)), lambda: (token_ids(2, 128),)),
    "bert": (lambda: LogitsOnly(bert(layers=4, hidden=256)), lambda: (token_ids(2, 128),)),
    "llama": (lambda: LogitsOnly(llama(layers=4, hidden=256)), lambda: (token_ids(2, 128),)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_model_matches_eager(name, dtype):
    build, make_inputs = CASES[name]
    torch.manual_seed(0)
    model = build().eval().to(dtype)
    if name == "cnn":  # give batch norm non-trivial running statistics
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in make_inputs())
    with torch.no_grad():
        expected = model(*args)
        # fallback="error": a missing rule fails the test instead of running eagerly.
        actual = torch.compile(model, backend="fx2xla", fullgraph=True, options={"fallback": "error"})(*args)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.stride() == expected.stride()
    if dtype == torch.bfloat16:
        # bf16 rounding differs between XLA's and torch's fusions; compare against eager's own
        # error w.r.t. a float32 run, scaled, rather than bit-level agreement.
        ref32 = model.float()(*[a.float() if a.is_floating_point() else a for a in args])
        err = (actual.float() - ref32).abs().max()
        eager_err = (expected.float() - ref32).abs().max()
        assert err <= 3 * eager_err + 1e-2, (err, eager_err)
    torch.testing.assert_close(actual, expected, **MODEL_TOL[dtype])
