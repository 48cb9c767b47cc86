"""Launching executables: the private fast path (execute_sharded + prebuilt C++ result
handlers) and the public `LoadedExecutable.execute` fallback give the same tensors."""
import jax
import jax.numpy as jnp
import pytest
import torch

from fx2xla.runtime import compile_module, default_device
from fx2xla.runtime.executor import make_launcher
from fx2xla.runtime.handoff import import_tensor

CASES = [
    (torch.float32, jnp.float32, torch.randn(2, 3)),
    (torch.bfloat16, jnp.bfloat16, torch.randn(2, 3).to(torch.bfloat16)),
    (torch.int64, jnp.int64, torch.tensor([[2**40, -5, 7], [1, 2, 3]])),
    (torch.bool, jnp.bool_, torch.tensor([[True, False, True], [False, False, True]])),
]


def _exe(jdt):
    # Several outputs of different shapes, a 0-d one and a dtype change among them.
    def f(x):
        return x, x.reshape(3, 2), (x.astype(jnp.float32) * 2).sum(), x[:1]

    with jax.enable_x64(True):
        text = jax.jit(f).lower(jax.ShapeDtypeStruct((2, 3), jdt)).as_text()
    return compile_module(text, default_device(), use_disk=False)


def _expected(t):
    return [t, t.reshape(3, 2), (t.float() * 2).sum(), t[:1]]


@pytest.mark.parametrize("public", [False, True], ids=["private", "public"])
@pytest.mark.parametrize("dt,jdt,t", CASES, ids=lambda v: str(v) if isinstance(v, torch.dtype) else "")
def test_launch_matches(public, dt, jdt, t):
    exe = _exe(jdt)
    launch = make_launcher(exe, public=public)
    assert launch.__name__ == ("launch_public" if public else "launch_private")
    dev = default_device().jax_device
    for _ in range(3):  # the private path learns its result handlers on the first call
        outs = launch([import_tensor(t, dev)])
        assert all(isinstance(o, torch.Tensor) for o in outs)
        for o, e in zip(outs, _expected(t)):
            assert o.dtype == e.dtype and o.shape == e.shape
            torch.testing.assert_close(o, e)  # exact for ints; the float sum may round differently


def test_private_launch_falls_back_when_handlers_are_refused(monkeypatch):
    from jax._src.lib import _jax

    def refuse(*a, **k):
        raise TypeError("no handler")

    monkeypatch.setattr(_jax, "array_result_handler", refuse)
    _launch_three_times()


def _launch_three_times():
    """A private launcher of a float32 executable, called three times (the first learns its
    result handlers), each time giving eager's values; returns it."""
    t = torch.randn(2, 3)
    launch = make_launcher(_exe(jnp.float32), public=False)
    dev = default_device().jax_device
    for _ in range(3):
        for o, e in zip(launch([import_tensor(t, dev)]), _expected(t)):
            torch.testing.assert_close(o, e)  # the float sum may round differently
    return launch


def test_private_launch_uses_handlers_of_a_jaxlib_without_skip_checks(monkeypatch):
    """jaxlib 0.11.2 (seen in its CUDA build) takes no `_skip_checks` (and its handlers, seen
    there, need none): the launcher still builds C++ result handlers, not the plain-callable
    fallback, and their results equal eager's. (This jaxlib's handler, called with the checks
    skipped, stands in for one without the argument.)"""
    from jax._src.lib import _jax

    real = _jax.array_result_handler
    made = []

    def without_skip_checks(aval, sharding, committed):
        made.append(aval)
        return real(aval, sharding, committed=committed, _skip_checks=True)

    monkeypatch.setattr(_jax, "array_result_handler", without_skip_checks)
    launch = _launch_three_times()
    assert len(made) == 4  # one handler per result, built once
    handlers = [c.cell_contents for c in launch.__closure__ if isinstance(c.cell_contents, list)]
    assert any(h and all(type(x).__name__ == "ResultHandler" for x in h) for h in handlers)


def test_public_execute_env_switch(monkeypatch):
    exe = _exe(jnp.float32)
    monkeypatch.setenv("FX2XLA_PUBLIC_EXECUTE", "1")
    assert make_launcher(exe).__name__ == "launch_public"
    monkeypatch.setenv("FX2XLA_PUBLIC_EXECUTE", "0")
    assert make_launcher(exe).__name__ == "launch_private"


@pytest.mark.parametrize("public", ["0", "1"], ids=["private", "public"])
def test_compiled_graph_with_either_launcher(monkeypatch, public):
    import fx2xla  # noqa: F401

    monkeypatch.setenv("FX2XLA_PUBLIC_EXECUTE", public)
    torch._dynamo.reset()

    def f(x, y):
        return x * 2 + y, (x @ y.t()).t(), x.sum()

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    compiled = torch.compile(f, backend="fx2xla", fullgraph=True)
    for _ in range(3):
        for o, e in zip(compiled(x, y), f(x, y)):
            torch.testing.assert_close(o, e, rtol=1e-4, atol=1e-5)
            assert o.stride() == e.stride()


@pytest.mark.parametrize("public", [False, True], ids=["private", "public"])
def test_traceback_pause(public):
    from jax._src.lib import _jax

    from fx2xla.runtime.executor import make_traceback_pause

    pause, resume = make_traceback_pause(public)
    assert pause.__name__ == ("pause_public" if public else "pause_private")
    assert _jax.tracebacks_enabled()
    paused = pause()
    assert paused is (not public) and _jax.tracebacks_enabled() is public
    if paused:
        resume()
    assert _jax.tracebacks_enabled()
    if not public:  # already off (someone else paused, or the user turned them off): left alone
        _jax.set_tracebacks_enabled(False)
        try:
            assert pause() is False and not _jax.tracebacks_enabled()
        finally:
            _jax.set_tracebacks_enabled(True)


def test_compiled_call_leaves_tracebacks_on():
    from jax._src.lib import _jax

    import fx2xla  # noqa: F401

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x.sin() + 1, backend="fx2xla", fullgraph=True)
    x = torch.randn(5)
    torch.testing.assert_close(compiled(x), x.sin() + 1)
    assert _jax.tracebacks_enabled()
