"""Error parity with eager: OpInfo's `error_inputs` (inputs eager must reject) through fx2xla.

For every op of `op_db` that has error inputs, each one is run eagerly and compiled with
`torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error"})`:
- eager does not raise (the error input is for another device or dtype): nothing to compare;
- the compiled call returns a value where eager raised: a silent answer, the test FAILS;
- it raises: the exception must be an instance of eager's exception type, or else of the type
  that `torch.compile(backend="aot_eager")` raises for it (errors found while Dynamo traces,
  before any backend runs, are torch.compile's, not fx2xla's);
- fx2xla's own errors must name the op (and, once the graph runs, the user's source line).

KNOWN lists the few inputs where torch.compile itself returns a value (aot_eager too): the
check eager makes is lost in Dynamo's tracing or the decompositions, before fx2xla sees the
graph. One that starts raising fails the run ("now raises"), so the list can only shrink.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo

from test_opinfo import _clone, _no_guard_latency_profiling, _op_db, op_key, summarize

# (op key, error input index) -> why torch.compile itself does not raise there.
_REFLECTED = ("calling the unbound Tensor.{}(int, tensor) is a TypeError in eager; Dynamo traces it as the "
              "reflected operator and returns a value (aot_eager too)")
KNOWN: dict[tuple[str, int], str] = {
    ("aminmax", 3): "out= tensors of the wrong dtype: Dynamo's out= handling returns a value (aot_eager too)",
    ("complex", 2): "out= tensors of the wrong dtype: Dynamo's out= handling returns a value (aot_eager too)",
    **{(name, i): _REFLECTED.format(name) for name in ("__radd__", "__rmul__", "__rand__", "__ror__", "__rxor__")
       for i in (0, 1)},
}


def _error_ops() -> list:
    return [op for op in _op_db() if op.error_inputs_func is not None]


def _error_inputs(op) -> list:
    from unittest import mock

    import torch.testing._internal.common_utils as common_utils
    import torch.testing._internal.opinfo.core as opinfo_core

    with mock.patch.object(common_utils, "extract_test_fn", lambda: None), \
            mock.patch.object(opinfo_core, "extract_test_fn", lambda: None):
        return list(op.error_inputs("cpu"))


def _call(op, sample):
    fn = op.get_op()
    args, kwargs = (sample.input, *sample.args), sample.kwargs
    return lambda: fn(*_clone(args), **_clone(kwargs))


def _compiled_raises(op, sample, backend, options=None):
    """The exception torch.compile(backend=...) raises for `sample`, or None if it returns."""
    fn = op.get_op()

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    torch._dynamo.reset()
    kwargs = dict(options=options) if options else {}
    compiled = torch.compile(call, backend=backend, fullgraph=True, dynamic=False, **kwargs)
    try:
        compiled(*_clone((sample.input, *sample.args)), **_clone(sample.kwargs))
    except Exception as e:  # noqa: BLE001
        return e
    finally:
        torch._dynamo.reset()
    return None


def check_error_input(op, index: int, error_input) -> str:
    """'pass', 'skip: ...' or 'known: ...'; raises AssertionError on a parity failure."""
    sample = error_input.sample_input
    try:
        _call(op, sample)()
    except Exception as e:  # noqa: BLE001
        eager = e
    else:
        return "skip: eager does not raise here"
    ours = _compiled_raises(op, sample, "fx2xla", {"fallback": "error"})
    known = KNOWN.get((op_key(op), index))
    if ours is None:
        reference = _compiled_raises(op, sample, "aot_eager")
        if reference is None and known is not None:
            return f"known: {known}"
        raise AssertionError(f"error input {index}: eager raises {summarize(eager)}, fx2xla returns a value"
                             + ("" if reference is None else f" (aot_eager raises {summarize(reference)})"))
    assert known is None, f"error input {index} now raises ({summarize(ours)}): remove it from KNOWN"
    if isinstance(ours, type(eager)):
        return "pass"
    reference = _compiled_raises(op, sample, "aot_eager")
    if reference is not None and isinstance(ours, type(reference)):
        return "pass"
    raise AssertionError(f"error input {index}: eager raises {summarize(eager)}, fx2xla raises {summarize(ours)}"
                         + ("" if reference is None else f", aot_eager raises {summarize(reference)}"))


@pytest.mark.parametrize("op", _error_ops(), ids=op_key)
def test_error_inputs(op):
    inputs = _error_inputs(op)
    outcomes, failures = [], []
    with warnings.catch_warnings(), _no_guard_latency_profiling():
        warnings.simplefilter("ignore")
        for i, error_input in enumerate(inputs):
            try:
                outcomes.append(check_error_input(op, i, error_input))
            except AssertionError as e:
                failures.append(str(e))
    assert not failures, "\n".join(failures)
    if outcomes and all(o.startswith("skip") for o in outcomes):
        pytest.skip(outcomes[0])
