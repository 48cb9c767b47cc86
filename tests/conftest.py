"""Shared fixtures: compile with fx2xla and compare against eager PyTorch."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch._dynamo

# Hermetic executable cache: every test session starts with an empty disk cache of its own.
os.environ["FX2XLA_CACHE_DIR"] = tempfile.mkdtemp(prefix="fx2xla-test-cache-")

# Tolerances per dtype for comparisons against eager (XLA fuses and reorders float math).
TOLERANCES = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.complex64: dict(rtol=1e-4, atol=1e-5),
    torch.complex128: dict(rtol=1e-7, atol=1e-7),
}


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """assert_close kwargs for `dtype` (exact for integer and bool), loosened by `scale`."""
    tol = TOLERANCES.get(dtype)
    if tol is None:
        return dict(rtol=0, atol=0)
    return {k: v * scale for k, v in tol.items()}


def assert_matches_eager(fn, *args, tol_scale: float = 1.0, fullgraph: bool = True, dynamic=False, **kwargs):
    """Run `fn` eagerly and compiled with fx2xla on the same inputs; assert outputs match in
    value, dtype, shape and strides. Returns the compiled outputs."""
    torch._dynamo.reset()
    expected = fn(*_clone(args), **kwargs)
    # fallback="error": a missing rule must fail the test, not run eagerly behind its back.
    compiled = torch.compile(fn, backend="fx2xla", fullgraph=fullgraph, dynamic=dynamic,
                             options={"fallback": "error"})
    actual = compiled(*_clone(args), **kwargs)
    _compare(actual, expected, tol_scale)
    return actual


def _clone(args):
    return tuple(_clone_keeping_layout(a) if isinstance(a, torch.Tensor) else a for a in args)


def _clone_keeping_layout(a: torch.Tensor) -> torch.Tensor:
    # clone() densifies views with gaps; rebuild the same strided view on a cloned base.
    if a._base is not None:
        return a._base.clone().as_strided(a.shape, a.stride(), a.storage_offset())
    return a.clone()


def _compare(actual, expected, tol_scale):
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _compare(a, e, tol_scale)
        return
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), type(actual)
        assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        torch.testing.assert_close(actual, expected, equal_nan=True, **tolerance(expected.dtype, tol_scale))
        return
    assert actual == expected


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def check():
    """`check(fn, *args, tol_scale=1, dynamic=False)`: compile `fn` with fx2xla, compare with eager."""
    return assert_matches_eager
