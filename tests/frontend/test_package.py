"""fx2xla.export writes a package (torch.export -> fx2xla's lowering -> StableHLO, executable,
weights); fx2xla.load runs it with no tracing. Results match eager (float32 rtol 1e-4 / atol
1e-4 for whole models, 1e-5 for an MLP; bfloat16 rtol 1.6e-2 / atol 1e-2 scaled by 10) and the
torch.compile results; a fresh process loads with no Dynamo graph and no XLA compile; with
dynamic shapes each new shape compiles once; written buffers and index checks carry over;
foreign, newer, corrupted packages and wrong inputs are clear errors; the portable module
compiles when no executable fits, on the private serializer and the public one; many threads
may call a loaded model.

A loaded model returns what the model returns: transformers LMs as users build them (GPT-2,
LLaMA with their default config, use_cache=True) return their ModelOutput with logits and a
DynamicCache whose every key and value tensor matches eager's (float32 rtol 1e-4 / atol 1e-4),
and which eager decoding continues from as from eager's own cache; a sliding-window cache
(Mistral) keeps its per-shape length under dynamic shapes; dicts, lists, namedtuples,
torch.return_types, None and Python numbers keep their structure; weights keep the model's
names; packages without a recorded structure return their outputs flat; an output a package
cannot carry (an unknown object, a StaticCache, an unimportable class) is a PackageError
naming its type and what to change."""
import collections
import gc
import json
import re
import os
import subprocess
import sys
import threading

import pytest
import torch

import fx2xla
from fx2xla import torch_kernels
from fx2xla.package import PackageError, portable_module
from fx2xla.testing import LogitsOnly, gpt2, llama, token_ids

from tests.lowering.test_linear_weights import NO_FEW_ROWS


def _gpt2():
    torch.manual_seed(0)
    return LogitsOnly(gpt2(layers=2, hidden=64, heads=2, vocab=100, positions=64)).eval()


def _llama():
    torch.manual_seed(0)
    return LogitsOnly(llama(layers=2, hidden=64, heads=2, kv_heads=1, vocab=100, positions=64)).eval()


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_export_load_matches_eager_and_compile(tmp_path, build):
    model = build()
    ids = token_ids(2, 16, vocab=100)
    path = fx2xla.export(model, (ids,), str(tmp_path / "pkg"))
    run = fx2xla.load(path)
    assert not run.compiled_from_module  # the executable fitted this device and jaxlib
    with torch.no_grad():
        expected = model(ids)
        compiled = torch.compile(model, backend="fx2xla")(ids)
    actual = run(ids)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(actual, compiled, rtol=1e-5, atol=1e-5)
    other = token_ids(2, 16, vocab=100, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(run(other), model(other), rtol=1e-4, atol=1e-4)


def test_bf16_mlp_and_several_outputs(tmp_path):
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 32)

        def forward(self, x, y):
            h = self.fc(x)
            return h.relu(), (h.t() @ y).sum(0), x.shape[0]

    torch.manual_seed(0)
    model = Two().to(torch.bfloat16)
    x, y = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(4, 3, dtype=torch.bfloat16)
    run = fx2xla.load(fx2xla.export(model, (x, y), str(tmp_path / "pkg")))
    with torch.no_grad():
        expected = model(x, y)
    actual = run(x, y)
    assert len(actual) == 3 and actual[2] == 4
    for a, e in zip(actual[:2], expected[:2]):
        assert a.dtype == torch.bfloat16 and a.shape == e.shape
        torch.testing.assert_close(a.float(), e.float(), rtol=1.6e-1, atol=1e-1)


def _load_in_fresh_process(tmp_path, path, x, report: str):
    """Load the package at `path` in a fresh process (an empty disk cache), call it on `x`:
    (its output, the dict the child's `report` expression gave, read as JSON)."""
    torch.save(x, tmp_path / "x.pt")
    child = ("import json, sys, torch, fx2xla\n"
             "from fx2xla import torch_kernels\n"
             "run = fx2xla.load(sys.argv[1])\n"
             "torch.save(run(torch.load(sys.argv[2])), sys.argv[3])\n"
             "m = fx2xla.metrics()\n"
             f"print(json.dumps({report}))\n")
    env = dict(os.environ, FX2XLA_CACHE_DIR=str(tmp_path / "empty-cache"))
    r = subprocess.run([sys.executable, "-c", child, path, str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return torch.load(tmp_path / "out.pt"), json.loads(r.stdout.strip().splitlines()[-1])


def test_a_fresh_process_loads_without_tracing(tmp_path):
    model = _gpt2()
    ids = token_ids(2, 16, vocab=100)
    path = fx2xla.export(model, (ids,), str(tmp_path / "pkg"))
    with torch.no_grad():
        expected = model(ids)
    out, report = _load_in_fresh_process(tmp_path, path, ids, "{'graphs': m['graphs'], 'compiles': m['compiles'], "
                                         "'dynamo': len(torch._dynamo.utils.counters['frames'])}")
    assert report == {"graphs": 0, "compiles": 0, "dynamo": 0}
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


def test_written_buffers_are_replayed(tmp_path):
    class Counter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(3))

        def forward(self, x):
            self.calls.add_(1)
            return x * self.calls

    x = torch.ones(3)
    run = fx2xla.load(fx2xla.export(Counter(), (x,), str(tmp_path / "pkg")))
    eager = Counter()
    for _ in range(3):
        torch.testing.assert_close(run(x), eager(x), rtol=0, atol=0)


def test_index_checks_survive_the_package(tmp_path):
    model = torch.nn.Embedding(10, 4)
    run = fx2xla.load(fx2xla.export(model, (torch.tensor([1, 2]),), str(tmp_path / "pkg")))
    torch.testing.assert_close(run(torch.tensor([3, 9])), model(torch.tensor([3, 9])), rtol=0, atol=0)
    with pytest.raises(fx2xla.IndexOutOfRangeError, match="embedding"):
        run(torch.tensor([3, 10]))


class _Solves(torch.nn.Module):
    def forward(self, a, b):
        return torch.linalg.solve(a, b) + torch.linalg.inv(a).sum((-2, -1), keepdim=True)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_linalg_checks_survive_the_package(tmp_path, dynamic):
    """A model calling torch.linalg.solve and inv (their error checks thread an effect token
    through the exported graph) exports as a package of format 3 (effect tokens; a model without
    them still writes 2): loaded, it equals eager (float64 rtol/atol 1e-10) at the export's
    batch and, dynamic, at another one compiled on the way; a singular matrix raises
    fx2xla.LinAlgError, a torch.linalg.LinAlgError, naming the api."""
    model = _Solves()
    gen = torch.Generator().manual_seed(0)

    def inputs(n):
        a = torch.randn(n, 3, 3, generator=gen, dtype=torch.float64) + 3 * torch.eye(3, dtype=torch.float64)
        return a, torch.randn(n, 3, 2, generator=gen, dtype=torch.float64)

    a, b = inputs(4)
    n = torch.export.Dim("n", min=2, max=8)
    path = fx2xla.export(model, (a, b), str(tmp_path / "pkg"),
                         dynamic_shapes={"a": {0: n}, "b": {0: n}} if dynamic else None)
    with open(os.path.join(path, "manifest.json")) as f:
        assert json.load(f)["format_version"] == 3
    run = fx2xla.load(path)
    for args in [(a, b)] + ([inputs(2)] if dynamic else []):
        torch.testing.assert_close(run(*args), model(*args), rtol=1e-10, atol=1e-10)
    singular = a.clone()
    singular[1] = 0
    with pytest.raises(fx2xla.LinAlgError, match="torch.linalg.solve: .*singular") as info:
        run(singular, b)
    assert isinstance(info.value, torch.linalg.LinAlgError)


def test_wrong_inputs_are_clear_errors(tmp_path):
    model = torch.nn.Linear(4, 2)
    run = fx2xla.load(fx2xla.export(model, (torch.randn(3, 4),), str(tmp_path / "pkg")))
    with pytest.raises(PackageError, match=r"float64\[3, 4\].*exported for float32\[3, 4\]"):
        run(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(PackageError, match=r"float32\[5, 4\].*exported for float32\[3, 4\]"):
        run(torch.randn(5, 4))
    with pytest.raises(PackageError, match="takes 1 tensor input"):
        run(torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(PackageError, match="must be a tensor"):
        run([1.0, 2.0])


def test_dynamic_shapes_compile_each_new_shape_once(tmp_path):
    """Exported with a dynamic batch: the example shape loads its executable; each new batch
    size is lowered from the stored program (no tracing) and compiled once; sizes outside the
    declared range and changed static dims are errors."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    batch = torch.export.Dim("batch", min=2, max=64)
    path = fx2xla.export(model, (torch.randn(4, 8),), str(tmp_path / "pkg"), dynamic_shapes=({0: batch},))
    run = fx2xla.load(path)
    assert not run.compiled_from_module and "2..64, 8]" in repr(run)
    before = fx2xla.metrics()["compiles"]
    for n in (4, 7, 7, 33, 4):
        x = torch.randn(n, 8)
        with torch.no_grad():
            torch.testing.assert_close(run(x), model(x), rtol=1e-4, atol=1e-5)
    assert fx2xla.metrics()["compiles"] - before == 2  # 7 and 33, once each
    with pytest.raises(PackageError, match=r"float32\[65, 8\].*exported for float32\[2..64, 8\]"):
        run(torch.randn(65, 8))
    with pytest.raises(PackageError, match=r"float32\[4, 9\]"):
        run(torch.randn(4, 9))


def _package(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    x = torch.randn(2, 4)
    return fx2xla.export(model, (x,), str(tmp_path / "pkg")), model, x


def _edit_manifest(path, **changes):
    file = os.path.join(path, "manifest.json")
    with open(file) as f:
        manifest = json.load(f)
    manifest.update(changes)
    with open(file, "w") as f:
        json.dump(manifest, f)


def test_foreign_newer_and_corrupted_packages(tmp_path):
    with pytest.raises(PackageError, match="not an fx2xla package"):
        fx2xla.load(str(tmp_path))  # no manifest
    path, _, _ = _package(tmp_path)
    _edit_manifest(path, format_version=99)
    with pytest.raises(PackageError, match="format version 99.*upgrade fx2xla"):
        fx2xla.load(path)
    _edit_manifest(path, format="something-else", format_version=1)
    with pytest.raises(PackageError, match="not an fx2xla package"):
        fx2xla.load(path)
    path, _, _ = _package(tmp_path)
    module = os.path.join(path, "module-0.stablehlo")
    data = bytearray(open(module, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(module, "wb").write(bytes(data))
    with pytest.raises(PackageError, match="module-0.stablehlo does not match the checksum"):
        fx2xla.load(path)
    path, _, _ = _package(tmp_path)
    weights = os.path.join(path, "weights.safetensors")
    open(weights, "r+b").truncate(os.path.getsize(weights) - 7)
    with pytest.raises(PackageError, match="weights.safetensors does not match"):
        fx2xla.load(path)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(PackageError, match="unreadable"):
        fx2xla.load(path)


@pytest.mark.parametrize("public", [False, True])
def test_compiles_from_the_portable_module_when_no_executable_fits(tmp_path, monkeypatch, public):
    """No executable for this device/jaxlib (here: the manifest lists none): the portable module
    is compiled instead, written by the private serializer or the public one."""
    monkeypatch.setenv("FX2XLA_PUBLIC_EXPORT", "1" if public else "0")
    path, model, x = _package(tmp_path)
    with open(os.path.join(path, "manifest.json")) as f:
        variants = json.load(f)["variants"]
    variants[0]["executables"] = {}
    _edit_manifest(path, variants=variants)
    run = fx2xla.load(path)
    assert run.compiled_from_module
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("public", [False, True])
def test_portable_module_private_and_public(public):
    """Both serializers give a module PJRT compiles; CHLO ops (jax emits chlo.square for x**2)
    are legalized by the private one and kept as text by the public one."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from fx2xla.runtime import default_device

    text = jax.jit(lambda x: lax.square(x) + 1).lower(jax.ShapeDtypeStruct((3,), jnp.float32)).as_text()
    assert "chlo." in text
    kind, blob = portable_module(text, public=public)
    assert kind == ("text" if public else "portable")
    device = default_device()
    exe = device.client.compile_and_load(blob if kind == "portable" else blob.decode(), [device.jax_device],
                                         __import__("fx2xla.runtime.executor", fromlist=["x"]).compile_options())
    out = exe.execute([jax.device_put(jnp.arange(3.0), device.jax_device)])[0]
    assert list(map(float, out)) == [1.0, 2.0, 5.0]


def test_loaded_model_serves_many_threads(tmp_path):
    path, model, x = _package(tmp_path)
    run = fx2xla.load(path)
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        want = [model(v) for v in xs]
    errors = []

    def work(i):
        try:
            for _ in range(50):
                torch.testing.assert_close(run(xs[i]), want[i], rtol=1e-4, atol=1e-5)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[0]


def _assert_same_output(actual, expected, where="output"):
    """`actual` has `expected`'s structure and types, and its tensors match (float32 rtol 1e-4 /
    atol 1e-4); a transformers cache and each of its layers match attribute by attribute."""
    from transformers import cache_utils

    assert type(actual) is type(expected), f"{where}: {type(actual).__name__}, expected {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, where
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{where}: {m}")
    elif type(expected).__module__ == "transformers.cache_utils":  # a cache, a layer: every attribute
        if isinstance(expected, cache_utils.Cache):
            assert actual.get_seq_length() == expected.get_seq_length(), where
        assert vars(actual).keys() == vars(expected).keys(), where
        for k, v in vars(expected).items():
            _assert_same_output(vars(actual)[k], v, f"{where}.{k}")
    elif isinstance(expected, dict):  # dicts and ModelOutputs
        assert list(actual.keys()) == list(expected.keys()), where
        for k in expected:
            _assert_same_output(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same_output(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r}, expected {expected!r}"


def _gpt2_lm():
    torch.manual_seed(0)
    return gpt2(layers=2, hidden=64, heads=2, vocab=100, positions=64).eval()


def _llama_lm():
    torch.manual_seed(0)
    return llama(layers=2, hidden=64, heads=2, kv_heads=1, vocab=100, positions=64).eval()


@pytest.mark.parametrize("build", [_gpt2_lm, _llama_lm], ids=["gpt2", "llama"])
def test_language_models_export_with_their_cache(tmp_path, build):
    """GPT2LMHeadModel / LlamaForCausalLM as built from a config (use_cache=True): the loaded
    model returns the same ModelOutput, its logits and every cache tensor as eager's, and
    decoding the next token from its cache gives eager's logits."""
    from transformers import cache_utils

    model = build()
    assert model.config.use_cache
    ids = token_ids(2, 16, vocab=100)
    path = fx2xla.export(model, (ids,), str(tmp_path / "pkg"))
    run = fx2xla.load(path)
    with torch.no_grad():
        expected = model(ids)
    actual = run(ids)
    cache = actual[list(actual.keys())[1]]  # past_key_values (named `cache` in transformers 5)
    assert isinstance(cache, cache_utils.DynamicCache) and len(cache.layers) == 2
    assert all(layer.keys.shape[-2] == 16 for layer in cache.layers)
    _assert_same_output(actual, expected)
    other = token_ids(2, 16, vocab=100, seed=1)
    with torch.no_grad():
        _assert_same_output(run(other), model(other))
    # The rebuilt cache is a working one: eager decodes the next token from it as from its own.
    step = token_ids(2, 1, vocab=100, seed=2)
    with torch.no_grad():
        from_loaded = model(step, cache=cache)
        from_eager = model(step, cache=expected[list(expected.keys())[1]])
    torch.testing.assert_close(from_loaded.logits, from_eager.logits, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 17
    # Weights keep the model's own names.
    with open(os.path.join(path, "manifest.json")) as f:
        names = {spec["name"] for spec in json.load(f)["inputs"] if spec["kind"] == "parameter"}
    assert names and names <= set(model.state_dict())


def test_sliding_window_cache_with_dynamic_length(tmp_path):
    """Mistral with a sliding window of 8: each layer's cache keeps the last 7 positions and
    counts every position seen, at each sequence length of a dynamic package."""
    import transformers

    from transformers import cache_utils

    transformers.logging.set_verbosity_error()
    cfg = transformers.MistralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                     num_key_value_heads=1, intermediate_size=128, vocab_size=100,
                                     max_position_embeddings=64, sliding_window=8)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval()
    seq = torch.export.Dim("seq", min=9, max=64)
    run = fx2xla.load(fx2xla.export(model, (token_ids(2, 16, vocab=100),), str(tmp_path / "pkg"),
                                    dynamic_shapes={"input_ids": {1: seq}}))
    for n in (16, 11):
        ids = token_ids(2, n, vocab=100, seed=n)
        with torch.no_grad():
            expected = model(ids)
        actual = run(ids)
        layers = actual.cache.layers
        assert all(type(layer) is cache_utils.DynamicSlidingWindowLayer for layer in layers)
        assert [(layer.keys.shape[-2], layer.cumulative_length) for layer in layers] == [(7, n)] * 2
        _assert_same_output(actual, expected)


def test_encoder_decoder_cache(tmp_path):
    """T5 (use_cache=True) returns an EncoderDecoderCache: its self-attention and cross-attention
    caches come back with every tensor as eager's."""
    import transformers

    from transformers import cache_utils

    transformers.logging.set_verbosity_error()
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    ids, mask = token_ids(2, 16, vocab=100), torch.ones(2, 16, dtype=torch.long)
    decoder_ids = token_ids(2, 5, vocab=100, seed=2)
    run = fx2xla.load(fx2xla.export(model, (ids, mask, decoder_ids), str(tmp_path / "pkg")))
    with torch.no_grad():
        expected = model(ids, mask, decoder_ids)
    actual = run(ids, mask, decoder_ids)
    cache = actual[list(actual.keys())[1]]
    assert isinstance(cache, cache_utils.EncoderDecoderCache) and cache.is_updated == {0: True, 1: True}
    assert [len(c.layers) for c in (cache.self_attention_cache, cache.cross_attention_cache)] == [2, 2]
    assert cache.cross_attention_cache.layers[0].keys.shape[-2] == 16  # the encoder's positions
    _assert_same_output(actual, expected)


Pair = collections.namedtuple("Pair", ["first", "second"])


class _Structured(torch.nn.Module):
    def forward(self, x):
        return {"pair": Pair(x + 1, [x * 2, None, x.shape[0]]), "max": torch.max(x, dim=0), "scale": 0.5}


def test_outputs_keep_the_model_structure(tmp_path):
    """Dicts, lists, namedtuples, torch.return_types, None and numbers come back as the model
    returned them; a package written before the structure was recorded returns them flat."""
    x = torch.randn(3, 4)
    path = fx2xla.export(_Structured(), (x,), str(tmp_path / "pkg"))
    expected = _Structured()(x)
    _assert_same_output(fx2xla.load(path)(x), expected)
    _edit_manifest(path, output_tree=None)
    flat = fx2xla.load(path)(x)
    assert isinstance(flat, tuple) and len(flat) == 4  # the graph's outputs (its tensors), flat
    torch.testing.assert_close(flat[0], x + 1, rtol=0, atol=0)


def test_outputs_a_package_cannot_carry_are_clear_errors(tmp_path):
    """An object of no known structure, a transformers cache other than the dynamic ones, an
    unknown object inside a DynamicCache, and a class that cannot be imported by name are
    refused at export, naming the output's place and type and what to change."""
    from transformers import cache_utils

    class Box:
        def __init__(self, t):
            self.t = t

    class Boxed(torch.nn.Module):
        def forward(self, x):
            return x + 1, Box(x * 2)

    with pytest.raises(PackageError, match=r"returns output\[1\], a .*Box, which a package cannot carry.*"
                                           r"return tensors, or tuples"):
        fx2xla.export(Boxed(), (torch.ones(3),), str(tmp_path / "box"))

    class StaticCacheLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = _gpt2_lm()

        def forward(self, ids):
            return self.lm(ids, cache=cache_utils.StaticCache(config=self.lm.config, max_cache_len=32))

    with pytest.raises(PackageError, match=r"returns output.cache, a transformers.cache_utils.StaticCache, which a "
                                           r"package cannot carry: pass use_cache=False"):
        fx2xla.export(StaticCacheLM(), (token_ids(2, 16, vocab=100),), str(tmp_path / "static"))

    class OddCache(torch.nn.Module):
        def forward(self, x):
            cache = cache_utils.DynamicCache()
            cache.update(x, x * 2, 0)
            cache.layers[0].note = Box(x)
            return x + 1, cache

    with pytest.raises(PackageError, match=r"returns output\[1\].layers\[0\].note, a .*Box, which a package cannot "
                                           r"carry \(held by the model's transformers.cache_utils.DynamicCache\): "
                                           r"pass use_cache=False"):
        fx2xla.export(OddCache(), (torch.ones(1, 1, 2, 4),), str(tmp_path / "odd"))

    Local = collections.namedtuple("Local", ["a"])
    Local.__qualname__ = "nowhere.Local"

    class Named(torch.nn.Module):
        def forward(self, x):
            return Local(x + 1)

    with pytest.raises(PackageError, match=r"output, a .*Local, .*cannot be imported by name"):
        fx2xla.export(Named(), (torch.ones(3),), str(tmp_path / "named"))


def test_manifest_holds_the_plan_and_format_1_still_loads(tmp_path):
    """The manifest stores the graph's plan record (plan.plan_record: per input its layout and
    residency, the results, the written inputs, the seed); a package of format 1, which kept
    those fields beside the inputs, loads and runs the same (float32: rtol 1e-4, atol 1e-5)."""
    path, model, x = _package(tmp_path)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["format_version"] == 2
    plan = manifest["plan"]
    # The weight: [in, out] on a CPU, or as torch holds it where the few-row kernel takes its
    # 2-row matmul (tests/lowering/test_few_rows_matmul.py).
    weight = "tensor" if torch_kernels.available("few_rows_matmul") else "relaid"
    assert [(p["kind"], p["resident"]) for p in plan["inputs"]] == \
        [(weight, True), ("tensor", True), ("tensor", False)]  # weight, bias, x
    assert plan["mutations"] == [] and plan["seed"] is False and plan["results"] == 1
    inputs = [{**spec, "layout": p["kind"], "perm": p["perm"]} for spec, p in zip(manifest["inputs"], plan["inputs"])]
    del manifest["plan"]
    manifest.update(format_version=1, inputs=inputs, mutations=[], seed=False)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    run = fx2xla.load(path)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_linear_weights_laid_out_in_out_on_a_cpu(tmp_path, dynamic):
    """A package exported on a CPU lays float32 nn.Linear weights out [in, out], as a compiled
    CPU graph does (docs/benchmarks.md, "Linear weights laid out [in, out]"): the manifest records
    them (plan kind "relaid", perm [1, 0]); the loaded model holds each weight in that order once
    and passes it as a view (kind PERMUTED), and matches eager (float32 rtol 1e-4, atol 1e-5) and
    torch.compile's result (rtol 1e-6, atol 1e-6), at the example batch and, exported with a
    dynamic batch, at batches it lowers when called. bf16 weights stay as torch holds them.
    Exported with linear_weight_lhs=False, and compiled with it and without the few-row kernel:
    at 8 static rows they keep the weights as torch holds them (test_weights_on_the_left_in_a_package)."""
    from fx2xla.plan import InputKind

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(8, 16)
    shapes = ({0: torch.export.Dim("batch", min=2, max=64)},) if dynamic else None
    path = fx2xla.export(model, (x,), str(tmp_path / "pkg"), dynamic_shapes=shapes, linear_weight_lhs=False)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["linear_weights_kn"] is True
    kinds = [(p["kind"], p["perm"]) for p in manifest["plan"]["inputs"]]  # weight, bias, weight, bias, x
    assert kinds[:4] == [("relaid", [1, 0]), ("tensor", None), ("relaid", [1, 0]), ("tensor", None)], kinds
    run = fx2xla.load(path)
    assert [p.kind for p in run.plan.inputs[:4]] == [InputKind.PERMUTED, InputKind.TENSOR, InputKind.PERMUTED,
                                                     InputKind.TENSOR]
    with torch.no_grad():
        compiled = torch.compile(model, backend="fx2xla", options={"linear_weight_lhs": False, "torch_kernels": NO_FEW_ROWS})
        for n in ((8, 5, 40) if dynamic else (8,)):
            xn = torch.randn(n, 16)
            out = run(xn)
            torch.testing.assert_close(out, model(xn), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out, compiled(xn), rtol=1e-6, atol=1e-6)
    bf16 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh()).bfloat16()
    path = fx2xla.export(bf16, (x.bfloat16(),), str(tmp_path / "bf16"))
    with open(os.path.join(path, "manifest.json")) as f:
        assert [p["kind"] for p in json.load(f)["plan"]["inputs"]] == ["tensor", "tensor", "tensor"]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_weights_on_the_left_in_a_package(tmp_path, dynamic):
    """A package exported on a CPU at 8 static rows computes its float32 matmuls as a compiled CPU
    graph does (option linear_weight_lhs): where the kernel library is built, in its few-row
    matmul (the manifest counts both matmuls as "few_row_matmuls", and the loaded model calls
    the kernel twice), else with the weight on the dot's left (counted as "weight_lhs_matmuls");
    no weight is relaid, the portable StableHLO module computes the products [out, rows] between
    optimization barriers either way, and the loaded model's result matches eager (float32 rtol
    1e-4, atol 1e-5) and torch.compile's (rtol 1e-6, atol 1e-6). Exported with a dynamic batch,
    the rows are symbolic: none is counted, and batches 8, 5 and 40 match eager. A bad value is
    refused before anything is exported."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(8, 16)
    shapes = ({0: torch.export.Dim("batch", min=2, max=64)},) if dynamic else None
    path = fx2xla.export(model, (x,), str(tmp_path / "pkg"), dynamic_shapes=shapes)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    few = torch_kernels.available("few_rows_matmul") and not dynamic
    assert manifest["few_row_matmuls"] == (2 if few else 0)
    assert manifest["weight_lhs_matmuls"] == (0 if dynamic or few else 2)
    from jax.extend.mlir import ir
    from jaxlib.mlir.dialects import stablehlo

    with ir.Context() as context:  # the module's text, for a look at its ops (no dialect checks)
        context.allow_unregistered_dialects = True
        module = str(ir.Module.parse(stablehlo.deserialize_portable_artifact_str(
            (tmp_path / "pkg" / "module-0.stablehlo").read_bytes())))
    dots = re.findall(r"dot_general.*-> (tensor<[^>]*>)", module)
    assert ("optimization_barrier" in module and dots == ["tensor<32x8xf32>", "tensor<8x8xf32>"]) != dynamic, module
    if not dynamic:
        assert [p["kind"] for p in manifest["plan"]["inputs"]] == ["tensor"] * 5
    run = fx2xla.load(path)
    with torch.no_grad():
        if not dynamic:
            calls = torch_kernels.few_rows_calls()
            out = run(x)
            assert torch_kernels.few_rows_calls() - calls == (2 if few else 0)
            torch.testing.assert_close(out, torch.compile(model, backend="fx2xla")(x), rtol=1e-6, atol=1e-6)
        for n in ((8, 5, 40) if dynamic else (8,)):
            xn = torch.randn(n, 16)
            torch.testing.assert_close(run(xn), model(xn), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"linear_weight_lhs='yes'; expected True or False"):
        fx2xla.export(model, (x,), str(tmp_path / "bad"), linear_weight_lhs="yes")
    assert not (tmp_path / "bad").exists()


def test_linear_weights_as_torch_holds_them_on_request(tmp_path):
    """export(..., transposed_linear_weights=False): the manifest records no [in, out] layout,
    the loaded model passes the weights as they are, and matches eager (float32 rtol 1e-4, atol
    1e-5)."""
    from fx2xla.plan import InputKind

    path, model, x = _package(tmp_path)
    run = fx2xla.load(fx2xla.export(model, (x,), str(tmp_path / "as-is"), transposed_linear_weights=False))
    with open(os.path.join(str(tmp_path / "as-is"), "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["linear_weights_kn"] is False
    assert [p["kind"] for p in manifest["plan"]["inputs"]] == ["tensor", "tensor", "tensor"]
    assert all(p.kind is InputKind.TENSOR for p in run.plan.inputs)
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), rtol=1e-4, atol=1e-5)


def _conv_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 8, 3, stride=2), torch.nn.Flatten(), torch.nn.LazyLinear(4)).eval()


def _executables(path) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)["variants"][0]["executables"]


def _handled() -> int:
    """Convolution handler calls so far: served by the main thread, or cut into slices."""
    return fx2xla.torch_kernels.sliced_calls() + fx2xla.torch_kernels.served_calls()


@pytest.mark.skipif(not fx2xla.torch_kernels.available("convolution"), reason=fx2xla.torch_kernels.status())
def test_convolutions_run_torch_kernels_where_the_library_runs(tmp_path, monkeypatch):
    """Exported on a CPU with the kernel library, a package holds two executables: one with
    torch's convolutions as custom calls (keyed by the library's build) and the plain one, and
    records the convolution weights channels-last and pinned, as a compiled CPU inference graph
    has them. Loaded here, the model runs torch's convolutions (handler calls counted: served
    whole by the main thread, or cut into slices) with both weights pinned for them to pack and matches eager (float32 rtol 1e-4, atol 1e-5) and torch.compile's result (rtol
    1e-6, atol 1e-6); loaded with FX2XLA_TORCH_KERNELS=0, it runs the plain executable (no
    handler call, nothing compiled) with the same results. Exported without the library, the
    package holds the plain executable only. A dynamic batch lowers new sizes with the library
    where it runs."""
    from fx2xla import torch_kernels

    model = _conv_net()
    x = torch.randn(8, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="fx2xla")(x)
    path = fx2xla.export(model, (x,), str(tmp_path / "cnn"))
    assert len(_executables(path)) == 2
    with open(os.path.join(path, "manifest.json")) as f:
        weights = [p for p in json.load(f)["plan"]["inputs"] if p["perm"] == [0, 2, 3, 1]]
    assert len(weights) == 2 and all(p["kind"] == "relaid" and p["pinned"] for p in weights), weights
    run = fx2xla.load(path)
    gc.collect()  # earlier tests' executors in reference cycles unpin now, not during the call
    before, pinned = _handled(), torch_kernels.packing_counts()["pinned"]
    out = run(x)
    assert _handled() - before == 2 and not run.compiled_from_module
    assert torch_kernels.packing_counts()["pinned"] - pinned == 2  # for torch's convolution to pack
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, compiled, rtol=1e-6, atol=1e-6)

    monkeypatch.setenv("FX2XLA_TORCH_KERNELS", "0")
    plain = fx2xla.load(path)
    before = _handled()
    out = plain(x)
    assert _handled() == before and not plain.compiled_from_module
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert len(_executables(fx2xla.export(model, (x,), str(tmp_path / "plain")))) == 1
    monkeypatch.delenv("FX2XLA_TORCH_KERNELS")

    batch = torch.export.Dim("batch", min=2, max=32)
    run = fx2xla.load(fx2xla.export(model, (x,), str(tmp_path / "dynamic"), dynamic_shapes=({0: batch},)))
    x6 = torch.randn(6, 3, 16, 16)
    before = _handled()
    out = run(x6)
    assert _handled() - before == 2 and run.compiled_from_module
    with torch.no_grad():
        torch.testing.assert_close(out, model(x6), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not fx2xla.torch_kernels.available("convolution"), reason=fx2xla.torch_kernels.status())
def test_a_fresh_process_runs_torch_convolutions_from_a_package(tmp_path):
    """A fresh process that only loads the package registers the kernel library before it
    deserializes the executable that calls it: torch's convolutions run (handler calls counted),
    nothing compiles, and the result matches eager (float32 rtol 1e-4, atol 1e-5)."""
    model = _conv_net()
    x = torch.randn(8, 3, 16, 16)
    with torch.no_grad():
        expected = model(x)
    path = fx2xla.export(model, (x,), str(tmp_path / "cnn"))
    out, report = _load_in_fresh_process(tmp_path, path, x, "{'compiles': m['compiles'], "
                                         "'handled': torch_kernels.sliced_calls() + torch_kernels.served_calls(), "
                                         "'from_module': run.compiled_from_module}")
    assert report == {"compiles": 0, "handled": 2, "from_module": False}
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_channels_last_input_in_any_layout(tmp_path):
    """A model exported at a channels_last input passes it to the executable as a permuted dense
    view; the loaded model takes the input in that layout, contiguous, or as a non-contiguous
    slice, and matches eager each time (float32 conv: rtol 1e-4, atol 1e-4). The portable module
    holds XLA's convolution, not torch's kernel (fx2xla.torch_kernels), and so does one
    executable: they load where no build is; where the library runs, one more executable calls
    it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    path = fx2xla.export(model, (x,), str(tmp_path / "pkg"))
    with open(os.path.join(path, "manifest.json")) as f:
        kinds = [p["kind"] for p in json.load(f)["plan"]["inputs"]]
    assert kinds[-1] == "permuted", kinds
    calling = []
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            if b"fx2xla_torch_convolution" in f.read():
                calling.append(name)
    executables = [n for n in os.listdir(path) if n.startswith("executable-")]
    assert len(calling) == int(fx2xla.torch_kernels.available("convolution")) and len(executables) == 1 + len(calling)
    assert all(n.startswith("executable-") for n in calling), calling
    run = fx2xla.load(path)
    wide = torch.randn(2, 3, 8, 16)
    for arg in (x, x.contiguous(), wide[..., ::2]):
        with torch.no_grad():
            torch.testing.assert_close(run(arg), model(arg), rtol=1e-4, atol=1e-4)
