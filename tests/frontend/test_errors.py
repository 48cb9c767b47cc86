"""Bad input gets a clear error naming the op, its inputs and the user's source line."""
import pytest
import torch

from fx2xla.lowering.registry import LOWERINGS, register_lowering


@torch.library.custom_op("fx2xla_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


def model_with_unsupported_op(x):
    y = x * 2
    return mystery(y)  # the line the error must point at


def test_missing_rule_names_op_inputs_and_source_line():
    compiled = torch.compile(
        model_with_unsupported_op, backend="fx2xla", fullgraph=True, options={"fallback": "error"}
    )
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3, 5))
    msg = str(info.value)
    assert "no lowering rule for fx2xla_test.mystery.default" in msg
    assert "f32[3, 5]" in msg
    assert "test_errors.py" in msg and "return mystery(y)" in msg


def test_failing_rule_names_op_and_source_line():
    op = torch.ops.fx2xla_test.mystery.default

    @register_lowering(op)
    def _broken(ctx, x):
        raise NotImplementedError("padding mode 'circular' is not supported")

    try:
        compiled = torch.compile(model_with_unsupported_op, backend="fx2xla", fullgraph=True)
        with pytest.raises(Exception) as info:
            compiled(torch.randn(2, dtype=torch.bfloat16))
        msg = str(info.value)
        assert "lowering fx2xla_test.mystery.default failed" in msg
        assert "circular" in msg and "bf16[2]" in msg and "return mystery(y)" in msg
    finally:
        del LOWERINGS[op]


def test_unknown_option_is_rejected():
    """An unknown option raises, naming it; a misspelt one also names the option meant."""
    compiled = torch.compile(lambda x: x + 1, backend="fx2xla", options={"no_such_option": 1})
    with pytest.raises(Exception, match="unknown option.*no_such_option") as info:
        compiled(torch.randn(2))
    assert "did you mean" not in str(info.value)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x + 1, backend="fx2xla", options={"scan_foldng": True})
    with pytest.raises(Exception, match="did you mean 'scan_folding' for 'scan_foldng'"):
        compiled(torch.randn(2))


def test_bad_fallback_value_is_rejected():
    compiled = torch.compile(lambda x: x + 1, backend="fx2xla", options={"fallback": "maybe"})
    with pytest.raises(Exception, match="fallback='maybe'"):
        compiled(torch.randn(2))


def test_bad_pjrt_device_is_rejected(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "QPU")
    compiled = torch.compile(lambda x: x + 1, backend="fx2xla")
    with pytest.raises(Exception, match="PJRT_DEVICE='QPU'"):
        compiled(torch.randn(2))


@pytest.mark.parametrize("a_dtype,b_dtype", [(torch.int64, torch.float32), (torch.float64, torch.float32),
                                             (torch.float16, torch.float32), (torch.float32, torch.bfloat16)])
def test_mixed_dtype_matmuls_raise_like_eager(a_dtype, b_dtype):
    """Eager's matmul kernels refuse mixed dtypes (an int64 batch into a float32 Linear); so
    does fx2xla, with a RuntimeError naming the op, both dtypes and the source line."""
    a = torch.ones(2, 4).to(a_dtype)
    w = torch.ones(3, 4).to(b_dtype)
    bias = torch.ones(3).to(b_dtype)
    for fn in (lambda a, w: a @ w.t(), lambda a, w: torch.nn.functional.linear(a, w),
               lambda a, w: torch.nn.functional.linear(a, w, bias),
               lambda a, w: torch.nn.functional.linear(a.unsqueeze(0), w)):
        with pytest.raises(RuntimeError, match="same dtype"):
            fn(a, w)
        torch._dynamo.reset()
        with pytest.raises(RuntimeError) as info:
            torch.compile(fn, backend="fx2xla", fullgraph=True)(a, w)
        msg = str(info.value)
        assert type(info.value).__name__ == "InvalidInputError", msg
        assert "expected m1 and m2 to have the same dtype" in msg
        assert str(a_dtype).removeprefix("torch.") in msg and str(b_dtype).removeprefix("torch.") in msg
        assert "test_errors.py" in msg


def test_int64_input_into_linear_module_raises():
    layer = torch.nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.compile(layer, backend="fx2xla")(torch.arange(8).reshape(2, 4))
