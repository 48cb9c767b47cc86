"""Shared fixtures: compile with fx2xla and compare against eager PyTorch."""
from __future__ import annotations

import operator
import os
import tempfile

import pytest
import torch
import torch._dynamo

# Eight virtual CPU devices stand in for a mesh (tests/spmd); set before jax's CPU client
# starts. Single-device graphs run on the first, as they would with one.
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

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


def run_bench(script: str, args: list, out, *, cwd=None, env=None, timeout: int = 600) -> tuple[dict, str]:
    """Run bench/`script` with `args` and `--out out` in a child process (from the repository
    root, or `cwd`), assert it exits 0 (its output's tail in the message), and return the JSON
    it wrote and what it printed."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "bench" / script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd or root, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(Path(out).read_text()), proc.stdout


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """assert_close kwargs for `dtype` (exact for integer and bool), loosened by `scale`."""
    tol = TOLERANCES.get(dtype)
    if tol is None:
        return dict(rtol=0, atol=0)
    return {k: v * scale for k, v in tol.items()}


def assert_loss_and_grads_close(loss, ref, model, twin, dtype: torch.dtype = torch.float32) -> None:
    """A compiled step's `loss` and `model`'s gradients against eager's `ref` and `twin`'s, at
    `dtype`'s tolerance (each gradient named on failure)."""
    tol = tolerance(dtype)
    torch.testing.assert_close(loss, ref, **tol)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol, msg=name)


def calls_in_threads(fn, inputs, calls: int) -> dict:
    """`fn(inputs[i])` `calls` times in each of len(inputs) threads at once, under no_grad:
    {i: [each result]}. The first exception of any thread is raised here."""
    import threading

    results, errors = {i: [] for i in range(len(inputs))}, []

    def work(i):
        try:
            with torch.no_grad():
                for _ in range(calls):
                    results[i].append(fn(inputs[i]))
        except Exception as e:  # noqa: BLE001 - raised below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def llama_decode_step(model, batch: int):
    """A decode step of a transformers causal LM, one token after a cached 5-token prompt, at
    `batch`: (step, token, mask, eager's logits). `step(token, mask)` runs the model over a cache
    of its own (a step writes its cache), built when `llama_decode_step` is called; eager's
    logits come from another such cache."""
    ids = torch.randint(1, 1000, (batch, 6))
    mask = torch.ones(batch, 6, dtype=torch.long)

    def stepper():
        with torch.no_grad():
            cache = model(ids[:, :5], use_cache=True).past_key_values
        return lambda tok, mask: model(tok, attention_mask=mask, cache=cache).logits

    with torch.no_grad():
        expected = stepper()(ids[:, 5:], mask)
    return stepper(), ids[:, 5:], mask, expected


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
    if _layouts(actual) != _layouts(expected):
        # Strides as eager's, or else as the ones Dynamo's graph promises for its outputs (torch's
        # meta kernels, which every backend follows, differ from a few eager kernels, e.g. pow of
        # a Scalar base by a transposed tensor: eager returns it contiguous, meta keeps the layout).
        promised = _graph_output_layouts(fn, args, kwargs, fullgraph, dynamic)
        leaves = [_layouts(t) for t in torch.utils._pytree.tree_leaves(actual) if isinstance(t, torch.Tensor)]
        assert promised is not None and leaves == promised, (leaves, _layouts(expected), promised)
    return actual


def _graph_output_layouts(fn, args, kwargs, fullgraph, dynamic):
    """The layouts of the outputs of Dynamo's graph for `fn` (its fake tensors), or None."""
    seen = []

    def record(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        seen.append(tuple(n.meta.get("example_value") if isinstance(n, torch.fx.Node) else n
                          for n in (out if isinstance(out, (tuple, list)) else [out])))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=record, fullgraph=fullgraph, dynamic=dynamic)(*_clone(args), **kwargs)
    torch._dynamo.reset()
    if len(seen) != 1:
        return None
    return [_layouts(v) for v in seen[0] if isinstance(v, torch.Tensor)]


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


def run_op(op, *args, **kwargs):
    """Compile and run a one-node graph calling `op` with fx2xla: for core overloads that
    AOTAutograd's decompositions never emit (so torch.compile cannot reach them)."""
    from fx2xla.compiled_graph import CompiledGraph
    from fx2xla.runtime import default_device
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph, mode, inputs = torch.fx.Graph(), FakeTensorMode(), []

    def placeholder(a):
        if not isinstance(a, torch.Tensor):
            return a
        node = graph.placeholder(f"arg{len(inputs)}")
        node.meta["val"] = mode.from_tensor(a)
        inputs.append(a)
        return node

    node = graph.call_function(op, tuple(map(placeholder, args)), {k: placeholder(v) for k, v in kwargs.items()})
    with mode:
        node.meta["val"] = op(*torch.fx.node.map_arg(node.args, lambda n: n.meta["val"]),
                              **torch.fx.node.map_arg(node.kwargs, lambda n: n.meta["val"]))
    outs = [node]
    if isinstance(node.meta["val"], (tuple, list)):
        outs = []
        for i, v in enumerate(node.meta["val"]):
            outs.append(graph.call_function(operator.getitem, (node, i)))
            outs[-1].meta["val"] = v
    graph.output(tuple(outs))
    gm = torch.fx.GraphModule({}, graph)
    fakes = [n.meta["val"] for n in graph.nodes if n.op == "placeholder"]
    result = CompiledGraph(gm, fakes, default_device(), "run_op")(list(inputs))
    return result[0] if len(result) == 1 else tuple(result)


def cuda_available() -> bool:
    """A CUDA GPU torch can use and jax's CUDA PJRT plugin to run fx2xla's executables on it."""
    if not torch.cuda.is_available():
        return False
    try:
        from fx2xla.runtime import get_backend

        return bool(get_backend("cuda").local_devices())
    except Exception:  # noqa: BLE001  (no plugin installed)
        return False


def pytest_collection_modifyitems(config, items):
    """`cuda`-marked tests skip on machines without a GPU (run them with `pytest -m cuda`)."""
    cuda = [item for item in items if "cuda" in item.keywords]
    if cuda and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU and jax's CUDA plugin (PJRT_DEVICE=CUDA pytest -m cuda)")
        for item in cuda:
            item.add_marker(skip)


def _layouts(x):
    """The strides that matter, of every tensor in `x`: those of dims longer than 1 (a size-1
    dim's stride is free; so is the layout of a tensor of at most one element)."""
    if isinstance(x, torch.Tensor):
        return tuple(s for n, s in zip(x.shape, x.stride()) if n > 1) if x.numel() > 1 else ()
    if isinstance(x, (tuple, list)):
        return tuple(_layouts(v) for v in x)
    return None


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def check():
    """`check(fn, *args, tol_scale=1, dynamic=False)`: compile `fn` with fx2xla, compare with eager."""
    return assert_matches_eager
