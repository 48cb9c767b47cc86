"""OpInfo sweep: PyTorch's `op_db`, compiled with fx2xla, against eager.

Each (op, dtype) runs its OpInfo samples through `torch.compile(fn, backend="fx2xla",
fullgraph=True, options={"fallback": "error"})` and compares the outputs, and the inputs of ops
that update them in place, with eager using `assert_close` at the tolerances in TOLERANCES.

What is not compared:
- SKIPS: ops that cannot be compared deterministically, with the reason.
- Samples eager rejects, and samples that torch.compile cannot handle whatever the backend
  (`backend="aot_eager"` fails too: graph breaks, Python-scalar outputs...) or whose graph has
  data-dependent output shapes (nonzero, unique, masked_select...: no static-shape lowering).
  These are classified when a sample fails, and reported as skips.
- Random ops (eager differs from itself under another seed) and the uninitialised outputs of
  UNINITIALISED: compiled and run, but only dtypes and shapes are compared.
- TIED_INDICES (sort, topk...): indices are compared by the input values they pick, since
  the order among equal values is unspecified.
- PHASED_COLUMNS (linalg.eigh): eigenvectors are compared after a common sign or phase is
  chosen for each, since each is unique only up to one.
- ALWAYS_RANDOM (fractional pooling): only dtypes and shapes, as for random ops.

Everything else that fails is listed in expected_failures.json: one record per (op, variant,
dtype) with the index of its first failing sample and the error. Those tests xfail; one that
passes FAILS ("unexpected success"), and so does one failing at an earlier sample than
recorded, so coverage can only go up.

Commands (from the repository root):
  default subset (part of `make test`): every op at float32, at complex64 where supported,
  plus one more of its dtypes (picked by a hash of the op's name), DEFAULT_SAMPLES sample(s)
  each; ~1700 tests, 5-9 min on 2 busy cores:
      .venv/bin/python -m pytest tests/opinfo
  full sweep (slow marker, not in the default run): every op, every dtype, every sample
  (~48k samples, hours on 2 cores; FX2XLA_OPINFO_MAX_SAMPLES=N caps the samples per case):
      .venv/bin/python -m pytest tests/opinfo -m opinfo_full
  rewrite expected_failures.json from the actual results of whichever cases ran (records of
  cases that did not run, or whose recorded failure lies beyond the samples that ran, stay):
      FX2XLA_OPINFO_REGEN=1 .venv/bin/python -m pytest tests/opinfo [-m opinfo_full]
  every op at every dtype, first sample, and the coverage figures (same merge with --regen):
      .venv/bin/python bench/opinfo_coverage.py --all-dtypes [--regen]
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import warnings
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch._dynamo

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64, torch.complex128)

# assert_close tolerances per output dtype (integers and bool: exact). XLA fuses and reorders
# float math, and rounds bf16/f16 intermediates at other points than eager does. A bf16/f16/f32
# output outside them still passes if it is, element by element, no further (within them) from
# a float64 computation of the same sample than eager's output is (see _as_close_to_float64).
TOLERANCES = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.complex64: dict(rtol=1e-4, atol=1e-5),
    torch.complex128: dict(rtol=1e-7, atol=1e-7),
}

DEFAULT_SAMPLES = 1  # samples per (op, dtype) in the default run
_max = os.environ.get("FX2XLA_OPINFO_MAX_SAMPLES")
FULL_SAMPLES = int(_max) if _max else None  # the full sweep: all samples unless capped
SEED = 0  # sample inputs are drawn after torch.manual_seed(SEED), per (op, dtype)

EXPECTED_FAILURES_PATH = Path(__file__).with_name("expected_failures.json")
REGEN = os.environ.get("FX2XLA_OPINFO_REGEN") == "1"


def _group(reason: str, names: str) -> dict[str, str]:
    return {name: reason for name in names.split()}


# Ops not run at all. Keys: op name (all its variants) or "name.variant".
SKIPS: dict[str, str] = {
    **_group("CUDA/ROCm only (jiterator)",
             "jiterator_unary jiterator_binary jiterator_4inputs_with_extra_args "
             "jiterator_binary_return_by_ref jiterator_2inputs_2outputs"),
    **_group("sparse layouts: Dynamo cannot trace sparse tensors", "to_sparse sparse.sampled_addmm sparse.mm.reduce"),
    **_group("returns a Python scalar/bool: a graph break under fullgraph=True", "item equal allclose"),
    **_group("resizes its input in place: Dynamo cannot trace it", "resize_ resize_as_"),
    **_group("complex32 has no XLA element type", "chalf"),
    **_group("data-dependent output shape: no static-shape lowering (XLA needs static shapes)",
             "nonzero argwhere masked_select unique unique_consecutive"),
}

# Their outputs are uninitialised memory: only dtypes and shapes are compared.
UNINITIALISED = set("empty empty_like new_empty new_empty_strided empty_strided empty_permuted".split())


# Random ops whose draws some samples' sizes make irrelevant to eager's output, so that two seeds
# cannot tell them from deterministic ones, while fx2xla's own draws (another generator) may
# still pick other windows: fractional pooling with an output dimension of 3 from 5 picks its
# middle start from a draw. Only dtypes and shapes are compared; their values are compared with
# fixed samples in tests/frontend/test_nn_more.py.
ALWAYS_RANDOM = set("nn.functional.fractional_max_pool2d nn.functional.fractional_max_pool3d".split())


# Ops whose index outputs are unspecified among equal values (eager's CPU sort is not stable
# for large inputs; fx2xla's is): their indices are compared by the input values they pick.
# Each maps the sample's arguments to (dim, keepdim).
def _dim_of_sort(input, dim=-1, descending=False, stable=False):
    return dim, True


def _dim_of_topk(input, k, dim=-1, largest=True, sorted=True):
    return dim, True


def _dim_of_kthvalue(input, k, dim=-1, keepdim=False):
    return dim, keepdim


def _dim_of_reduction(input, dim=-1, keepdim=False):
    return dim, keepdim


TIED_INDICES = {
    "sort": _dim_of_sort, "argsort": _dim_of_sort, "topk": _dim_of_topk, "kthvalue": _dim_of_kthvalue,
    "mode": _dim_of_reduction, "median": _dim_of_reduction, "nanmedian": _dim_of_reduction,
}

# Ops whose output at this index holds eigenvectors, each unique only up to a unit factor (a sign
# for real, a phase for complex; torch.linalg.eigh's documentation says so): compared after both
# sides' columns are rotated so that the entry largest in eager's column is real and positive.
PHASED_COLUMNS = {"linalg.eigh": 1}


# -- cases ------------------------------------------------------------------------------------
def op_key(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class Case:
    op: object  # an OpInfo
    dtype: torch.dtype

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.op.name, self.op.variant_test_name, dtype_name(self.dtype))

    @property
    def id(self) -> str:
        return f"{op_key(self.op)}-{dtype_name(self.dtype)}"


def _op_db():
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def all_cases() -> list[Case]:
    """Every op at every dtype of DTYPES it supports on CPU."""
    cases = []
    for op in _op_db():
        supported = op.supported_dtypes("cpu")
        cases.extend(Case(op, d) for d in DTYPES if d in supported)
    return cases


def default_cases() -> list[Case]:
    """Every op at float32 (or its first supported dtype), at complex64 where it supports it
    (complex results are easy to get silently wrong: a dropped imaginary part), plus one other
    supported dtype picked by a hash of its name: each dtype is covered for a fixed share of
    the ops."""
    by_op: dict = {}
    for c in all_cases():
        by_op.setdefault(id(c.op), []).append(c)
    cases = []
    for op_cases in by_op.values():
        first = next((c for c in op_cases if c.dtype == torch.float32), op_cases[0])
        chosen = [first] + [c for c in op_cases if c.dtype == torch.complex64 and c is not first]
        others = [c for c in op_cases if c not in chosen]
        cases.extend(chosen)
        if others:
            cases.append(others[zlib.crc32(op_key(first.op).encode()) % len(others)])
    return cases


# -- running one case -------------------------------------------------------------------------
@dataclasses.dataclass
class SampleResult:
    index: int
    status: str  # "pass", "fail", "skip"
    error: str = ""


class _NotComparable(Exception):
    """Eager rejects the sample."""


def summarize(exc: BaseException) -> str:
    """One line naming the error: the root cause of Dynamo's wrappers, type and first line."""
    inner = getattr(exc, "inner_exception", None)  # BackendCompilerFailed
    if inner is not None:
        exc = inner
    lines = [l.strip() for l in str(exc).strip().splitlines() if l.strip()]
    first = lines[0] if lines else ""
    if isinstance(exc, AssertionError) and len(lines) > 1:
        # assert_close: "Tensor-likes are not close!" + "Mismatched elements: 3 / 20 (15.0%)"
        extra = next((l for l in lines[1:] if l.startswith(("Mismatched", "The values", "Greatest"))), lines[1])
        first = f"{first} {extra}"
    text = f"{type(exc).__name__}: {first}"
    return text if len(text) <= 300 else text[:297] + "..."


def _clone(x):
    if isinstance(x, torch.Tensor):
        if x._base is not None:  # keep the same strided view (clone() would densify it)
            return x._base.clone().as_strided(x.shape, x.stride(), x.storage_offset())
        return x.clone()
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def compare(actual, expected, meta_only: bool = False, exact: bool = False) -> None:
    """assert_close at each output's dtype tolerance (dtype and shape always checked)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"expected a tensor, got {type(actual).__name__}"
        assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != eager's {expected.dtype}"
        assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != eager's {tuple(expected.shape)}"
        if meta_only:
            return
        tol = dict(rtol=0, atol=0) if exact else TOLERANCES.get(expected.dtype, dict(rtol=0, atol=0))
        torch.testing.assert_close(actual, expected, equal_nan=True, check_device=False, **tol)
        return
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)), f"expected a sequence, got {type(actual).__name__}"
        assert len(actual) == len(expected), f"{len(actual)} outputs != eager's {len(expected)}"
        for a, e in zip(actual, expected):
            compare(a, e, meta_only, exact)
        return
    if not meta_only:
        torch.testing.assert_close(actual, expected, equal_nan=True)


def _no_seed_wrapper(op, *args, **kwargs):
    return op(*args, **kwargs)


@contextlib.contextmanager
def _traceable_random_ops():
    """op_db wraps random ops in `wrapper_set_seed` (freeze_rng_state + manual_seed), which
    Dynamo cannot trace; call them directly instead (only their dtype/shape is compared)."""
    import torch.testing._internal.common_methods_invocations as cmi

    with mock.patch.object(cmi, "wrapper_set_seed", _no_seed_wrapper):
        yield


@contextlib.contextmanager
def _no_guard_latency_profiling():
    """Dynamo times each new guard set after flushing the CPU caches (a metric only), ~40 ms
    per compile on 2 busy cores: a sixth of a typical case here. Skip it."""
    import torch._dynamo.guards as guards

    if not hasattr(guards, "profile_guard_manager"):
        yield
        return
    with mock.patch.object(guards, "profile_guard_manager", lambda *args: 0.0):
        yield


def _call_fn(op):
    fn = op.get_op()

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    return call


def _eager(fn, args, kwargs, seed):
    torch.manual_seed(seed)
    args, kwargs = _clone(args), _clone(kwargs)
    out = fn(*args, **kwargs)
    return out, _tensors((args, kwargs))


def _is_random(fn, args, kwargs, expected, inputs_after) -> bool:
    """Eager gives other values under another seed: a random op (or sample)."""
    again, inputs_again = _eager(fn, args, kwargs, SEED + 1)
    try:
        compare((again, inputs_again), (expected, inputs_after), exact=True)
    except AssertionError:
        return True
    return False


def _picked_values(op_name: str, sample, out):
    """`out` with its index tensor replaced by the input values it picks (TIED_INDICES)."""
    x = sample.input
    dim, keepdim = TIED_INDICES[op_name](x, *sample.args, **sample.kwargs)

    def pick(idx):
        if x.dim() == 0:
            return idx
        return x.gather(dim, idx if keepdim else idx.unsqueeze(dim))

    if op_name == "argsort":  # indices only
        return pick(out)
    if isinstance(out, tuple) and len(out) == 2:  # (values, indices)
        return (out[0], pick(out[1]))
    return out  # e.g. median without dim: the value only


def _phase_aligned(op_name: str, actual, expected):
    """(actual, expected) with the PHASED_COLUMNS output's columns rotated to a common phase."""
    index = PHASED_COLUMNS[op_name]
    if expected[index].numel() == 0:
        return actual, expected
    pivot = expected[index].abs().argmax(dim=-2, keepdim=True)

    def align(vectors):
        entry = vectors.gather(-2, pivot)
        unit = torch.where(entry == 0, torch.ones_like(entry), entry / entry.abs())
        return vectors / unit

    def replaced(out):
        return (*out[:index], align(out[index]), *out[index + 1:])

    return replaced(actual), replaced(expected)


# Float dtypes whose outputs may be refereed by a float64 run when they miss eager's: float32 too,
# since ill-conditioned results (matrix_exp's small entries beside large ones) differ from eager's
# by more than rtol while both are as close to float64 as float32 allows.
REFEREED = (torch.bfloat16, torch.float16, torch.float32)


def _upcast(x):
    if isinstance(x, torch.Tensor):
        return x.double() if x.dtype in REFEREED else x
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_upcast(v) for v in x)
    if isinstance(x, dict):
        return {k: _upcast(v) for k, v in x.items()}
    return x


def _as_close_to_float64(fn, args, kwargs, actual, expected) -> bool:
    """Whether each bf16/f16/f32 output of the compiled run is at most TOLERANCES further from a
    float64 run of the sample than eager's own output (and the rest match as usual). Where
    eager gives NaN or an infinity and float64 a number, the compiled value must be within
    TOLERANCES of float64's, or the same as eager's."""
    try:
        reference = _eager(fn, _upcast(args), _upcast(kwargs), SEED)[0]
    except Exception:  # noqa: BLE001  (no float64 kernel: no better reference)
        return False
    a_list, e_list, r_list = _tensors(actual), _tensors(expected), _tensors(reference)
    if not len(a_list) == len(e_list) == len(r_list):
        return False
    for a, e, r in zip(a_list, e_list, r_list):
        if e.dtype not in REFEREED or not r.is_floating_point():
            if not torch.equal(a, e) and not torch.allclose(a, e, equal_nan=True, **TOLERANCES.get(e.dtype, {})):
                return False
            continue
        tol = TOLERANCES[e.dtype]
        a64, e64, r64 = a.double(), e.double(), r.double()
        # Where eager's output is not finite and float64's is, eager's distance is unbounded: there
        # the compiled value must be within the tolerances of float64's (not merely closer).
        eager_error = torch.where(~e64.isfinite() & r64.isfinite(), 0.0, (e64 - r64).abs())
        bound = eager_error + tol["atol"] + tol["rtol"] * r64.abs()
        ok = ((a64 - r64).abs() <= bound) | (a64.isnan() & e64.isnan()) | (a64 == e64)
        if not bool(ok.all()):
            return False
    return True


def _run_sample(compiled, fn, sample, meta_only: bool, op_name: str = "") -> None:
    args, kwargs = (sample.input, *sample.args), sample.kwargs
    try:
        expected, eager_inputs = _eager(fn, args, kwargs, SEED)
    except Exception as e:  # noqa: BLE001  (a sample eager rejects tests nothing of ours)
        raise _NotComparable(f"eager raises: {summarize(e)}") from e
    meta_only = meta_only or _is_random(fn, args, kwargs, expected, eager_inputs)
    torch.manual_seed(SEED)
    comp_args, comp_kwargs = _clone(args), _clone(kwargs)
    actual = compiled(*comp_args, **comp_kwargs)
    if op_name in TIED_INDICES and not meta_only:
        compare(actual, expected, meta_only=True)  # index dtypes and shapes
        actual, expected = _picked_values(op_name, sample, actual), _picked_values(op_name, sample, expected)
    if op_name in PHASED_COLUMNS and not meta_only:
        compare(actual, expected, meta_only=True)
        actual, expected = _phase_aligned(op_name, actual, expected)
    try:
        compare(actual, expected, meta_only)
    except AssertionError:
        refereed = any(t.dtype in REFEREED for t in _tensors(expected))
        if meta_only or not refereed:
            raise
        compare(actual, expected, meta_only=True)  # structure, dtypes and shapes must match
        if not _as_close_to_float64(fn, args, kwargs, actual, expected):
            raise
    # Ops that update their inputs in place: the compiled call must have done so too.
    compare(_tensors((comp_args, comp_kwargs)), eager_inputs, meta_only)


def not_an_fx2xla_failure(fn, sample) -> str | None:
    """Why a failing sample says nothing about fx2xla, or None. Compiles it again with
    `backend="aot_eager"` behind a check for data-dependent (unbacked) shapes in the graph."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    data_dependent = []

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and free_unbacked_symbols(n.meta.get("example_value")):
                data_dependent.append(getattr(n.target, "__name__", str(n.target)))
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(
            *_clone((sample.input, *sample.args)), **_clone(sample.kwargs))
    except Exception as e:  # noqa: BLE001
        return f"torch.compile(backend='aot_eager') fails too: {summarize(e)}"
    finally:
        torch._dynamo.reset()
    if data_dependent:
        return f"data-dependent output shape (from {data_dependent[0]}): no static-shape lowering"
    return None


def samples_of(case: Case, max_samples: int | None) -> list:
    import torch.testing._internal.common_utils as common_utils
    import torch.testing._internal.opinfo.core as opinfo_core

    torch.manual_seed(SEED)
    # OpInfo looks for a unittest test method up the stack with inspect.stack(), which under
    # pytest's deep stack costs ~0.3 s per call and finds none: skip the search.
    with mock.patch.object(common_utils, "extract_test_fn", lambda: None), \
            mock.patch.object(opinfo_core, "extract_test_fn", lambda: None):
        samples = case.op.sample_inputs("cpu", case.dtype, requires_grad=False)
        return list(itertools.islice(samples, max_samples))


def skip_reason(case: Case) -> str | None:
    return SKIPS.get(op_key(case.op)) or SKIPS.get(case.op.name)


def run_case(case: Case, max_samples: int | None, expected_failure: dict | None = None,
             stop_at_first_failure: bool = True) -> list[SampleResult]:
    """Run the first `max_samples` samples (None: all) of `case`; one result per sample.

    A failure at the sample `expected_failure` records was classified when it was recorded,
    so it is not re-checked against aot_eager (saves a compile per expected failure)."""
    reason = skip_reason(case)
    if reason is not None:
        return [SampleResult(0, "skip", reason)]
    fn = _call_fn(case.op)
    meta_only = case.op.name in UNINITIALISED or case.op.name in ALWAYS_RANDOM
    torch._dynamo.reset()
    results = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_traceable_random_ops())
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        # Each sample signature is a recompile of the same function: never fall back to eager.
        stack.enter_context(torch._dynamo.config.patch(
            recompile_limit=100000, accumulated_recompile_limit=100000, fail_on_recompile_limit_hit=True))
        stack.enter_context(_no_guard_latency_profiling())
        try:
            samples = samples_of(case, max_samples)
        except Exception as e:  # noqa: BLE001
            return [SampleResult(0, "skip", f"sample generation fails: {summarize(e)}")]
        # One compiled function for all samples: samples of the same signature reuse its graph.
        compiled = torch.compile(fn, backend="fx2xla", fullgraph=True, dynamic=False,
                                 options={"fallback": "error"})
        for i, sample in enumerate(samples):
            try:
                _run_sample(compiled, fn, sample, meta_only, case.op.name)
                results.append(SampleResult(i, "pass"))
                continue
            except _NotComparable as e:
                results.append(SampleResult(i, "skip", str(e)))
                continue
            except Exception as e:  # noqa: BLE001
                error = summarize(e)
            known = expected_failure is not None and expected_failure["sample"] == i
            why = None if known else not_an_fx2xla_failure(fn, sample)
            if why is not None:
                results.append(SampleResult(i, "skip", why))
                continue
            results.append(SampleResult(i, "fail", error))
            if stop_at_first_failure:
                break
    torch._dynamo.reset()
    return results or [SampleResult(0, "skip", "no samples")]


# -- expected failures ------------------------------------------------------------------------
def load_expected_failures(path: Path = EXPECTED_FAILURES_PATH) -> dict[tuple[str, str, str], dict]:
    if not path.exists():
        return {}
    return {(r["op"], r["variant"], r["dtype"]): r for r in json.loads(path.read_text())}


def save_expected_failures(entries: dict[tuple[str, str, str], dict], path: Path = EXPECTED_FAILURES_PATH) -> None:
    records = [entries[k] for k in sorted(entries)]
    body = ",\n".join("  " + json.dumps(r) for r in records)
    path.write_text("[\n" + body + ("\n" if body else "") + "]\n")


def first_failure(results: list[SampleResult]) -> SampleResult | None:
    return next((r for r in results if r.status == "fail"), None)


def expected_within(entry: dict | None, max_samples: int | None) -> dict | None:
    """The record, if its failing sample is among the first `max_samples` (None: all)."""
    if entry is None or (max_samples is not None and entry["sample"] >= max_samples):
        return None
    return entry


def merged_entry(old: dict | None, key, results: list[SampleResult], max_samples: int | None) -> dict | None:
    """The expected-failure record of `key` after a run of its first `max_samples` samples."""
    fail = first_failure(results)
    if fail is not None:
        op, variant, dtype = key
        return dict(op=op, variant=variant, dtype=dtype, sample=fail.index, error=fail.error)
    if old is not None and expected_within(old, max_samples) is None:
        return old  # its failing sample did not run
    return None


def regenerate(runs: dict, path: Path = EXPECTED_FAILURES_PATH) -> None:
    """Merge {key: (results, max_samples)} into the expected-failures file."""
    entries = load_expected_failures(path)
    for key, (results, max_samples) in runs.items():
        new = merged_entry(entries.get(key), key, results, max_samples)
        if new is None:
            entries.pop(key, None)
        else:
            entries[key] = new
    save_expected_failures(entries, path)


# -- pytest -----------------------------------------------------------------------------------
EXPECTED = load_expected_failures()
_regen_runs: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _regen_writer():
    yield
    if REGEN and _regen_runs:
        regenerate(_regen_runs)


def check_case(case: Case, max_samples: int | None) -> None:
    recorded = EXPECTED.get(case.key)
    expected = expected_within(recorded, max_samples)
    results = run_case(case, max_samples, expected_failure=None if REGEN else expected)
    if REGEN:
        _regen_runs[case.key] = (results, max_samples)
    fail = first_failure(results)
    if fail is None:
        if expected is not None and not REGEN:
            pytest.fail(f"unexpected success — remove it from expected_failures: {case.key} "
                        f"(or rerun with FX2XLA_OPINFO_REGEN=1); it failed with: {expected['error']}",
                        pytrace=False)
        if all(r.status == "skip" for r in results):
            pytest.skip(results[0].error)
        return
    if REGEN:
        pytest.xfail(f"(recorded) sample {fail.index}: {fail.error}")
    if recorded is None:
        pytest.fail(f"sample {fail.index} fails and is not in expected_failures.json: {fail.error}", pytrace=False)
    if fail.index < recorded["sample"]:
        pytest.fail(f"sample {fail.index} fails, but expected_failures.json records the first failure "
                    f"at sample {recorded['sample']}: {fail.error}", pytrace=False)
    pytest.xfail(f"sample {fail.index}: {fail.error}")


@pytest.mark.parametrize("case", default_cases(), ids=lambda c: c.id)
def test_opinfo(case):
    check_case(case, DEFAULT_SAMPLES)


@pytest.mark.slow
@pytest.mark.opinfo_full
@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.id)
def test_opinfo_full(case):
    check_case(case, FULL_SAMPLES)
