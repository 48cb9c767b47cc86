"""Which layout of a large float32 nn.Linear weight CPU inference graphs import (runtime/
dot_layout.py, option transposed_linear_weights).

What these tests hold it to:
- weights up to SMALL_WEIGHT_BYTES are laid out [in, out] and larger ones read by more than
  MAX_TIMED_ROWS rows are not, both without timing anything;
- a larger weight at few rows is timed once per shape and rows bucket: the answer is what the
  stored times say (MARGIN), it is kept in memory and in `cpu-dot-layouts.json` under the cache
  folder, a new process (memory forgotten) reads it from there, a corrupt file is timed again
  and rewritten, and with the disk cache off nothing is written;
- four threads asking for one new shape at once time it once;
- compiled graphs follow the answer (RELAID or as torch holds it) and equal eager's result at
  float32 rtol 1e-4 / atol 1e-4 (K = 1024 sums in another order) either way, with the real
  timing too; "always" relays without asking; a bad option value is a clear error."""
from __future__ import annotations

import json
import threading

import pytest
import torch

from fx2xla.metrics import live_graphs
from fx2xla.plan import InputKind
from fx2xla.runtime import dot_layout

from tests.lowering.test_linear_weights import NO_FEW_ROWS

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FX2XLA_CACHE_DIR", str(tmp_path))
    dot_layout.forget()
    yield tmp_path / dot_layout.FILE_NAME
    dot_layout.forget()


def _stored(path) -> dict:
    data = json.loads(path.read_text())
    assert len(data) == 1  # one machine
    return next(iter(data.values()))


def test_small_and_many_rows_are_not_timed(cache):
    before = dot_layout.probes_run()
    assert dot_layout.prefer_kn(8, 256, 688) is True  # 688 KiB
    assert dot_layout.prefer_kn(2, 1024, 512) is True  # exactly 2 MiB
    assert dot_layout.prefer_kn(129, 1024, 4096) is False  # 16 MiB at 256 rows (bucket)
    assert dot_layout.probes_run() == before and not cache.exists()


def test_rows_bucket():
    assert [dot_layout.rows_bucket(r) for r in (1, 2, 3, 8, 9, 128, 129, 5000)] == [2, 2, 4, 8, 16, 128, 256, 1024]


def test_timed_once_kept_in_memory_and_on_disk(cache):
    before = dot_layout.probes_run()
    answer = dot_layout.prefer_kn(8, 1024, 768)  # 3 MiB
    assert dot_layout.probes_run() == before + 1
    nk, kn = _stored(cache)["f32 8x1024x768"]
    assert nk > 0 and kn > 0 and answer is (kn <= dot_layout.MARGIN * nk)
    assert dot_layout.prefer_kn(5, 1024, 768) is answer  # the same bucket: memory
    dot_layout.forget()  # a new process: the file
    assert dot_layout.prefer_kn(7, 1024, 768) is answer
    assert dot_layout.probes_run() == before + 1
    # Stored times decide: a file that says [in, out] is twice as fast is believed.
    data = json.loads(cache.read_text())
    machine = next(iter(data))
    data[machine]["f32 8x1024x768"] = [2e-3, 1e-3]
    cache.write_text(json.dumps(data))
    dot_layout.forget()
    assert dot_layout.prefer_kn(8, 1024, 768) is True
    data[machine]["f32 8x1024x768"] = [1e-3, 0.9e-3]  # within MARGIN: as torch holds it
    cache.write_text(json.dumps(data))
    dot_layout.forget()
    assert dot_layout.prefer_kn(8, 1024, 768) is False
    assert dot_layout.probes_run() == before + 1


def test_corrupt_file_is_timed_again(cache):
    cache.write_text("{not json")
    before = dot_layout.probes_run()
    dot_layout.prefer_kn(4, 768, 1024)
    assert dot_layout.probes_run() == before + 1
    assert "f32 4x768x1024" in _stored(cache)
    data = json.loads(cache.read_text())
    data[next(iter(data))]["f32 4x768x1024"] = ["fast", None]  # a malformed entry
    cache.write_text(json.dumps(data))
    dot_layout.forget()
    dot_layout.prefer_kn(4, 768, 1024)
    assert dot_layout.probes_run() == before + 2
    assert all(isinstance(t, float) for t in _stored(cache)["f32 4x768x1024"])


def test_disk_cache_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FX2XLA_CACHE_DIR", "")
    dot_layout.forget()
    before = dot_layout.probes_run()
    dot_layout.prefer_kn(2, 1024, 640)
    assert dot_layout.probes_run() == before + 1
    assert list(tmp_path.iterdir()) == []
    dot_layout.forget()


def test_threads_time_a_shape_once(cache):
    before = dot_layout.probes_run()
    answers, errors = [], []

    def ask():
        try:
            answers.append(dot_layout.prefer_kn(16, 640, 1024))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(answers) == 4 and len(set(answers)) == 1
    assert dot_layout.probes_run() == before + 1


class Wide(torch.nn.Module):
    """Two Linear layers with 4 MiB weights (1024 x 1024 float32)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(1024, 1024)
        self.b = torch.nn.Linear(1024, 1024)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _compiled(model, x, **options):
    """`model` compiled and called on x, eager's result checked: the new graphs. Option
    linear_weight_lhs is off and torch_kernels leaves out the few-row matmul unless given (at
    4-64 and 2-8 rows they keep the weights as torch holds them)."""
    torch._dynamo.reset()
    before = {id(g) for g in live_graphs}
    compiled = torch.compile(model, backend="fx2xla",
                             options={"linear_weight_lhs": False, "torch_kernels": NO_FEW_ROWS, **options})
    with torch.no_grad():
        out = compiled(x)
        expected = model(x)
    torch.testing.assert_close(out, expected, **TOL)
    return [g for g in live_graphs if id(g) not in before]


def _relaid(graphs) -> int:
    return sum(p.kind is InputKind.RELAID and p.perm == (1, 0) for g in graphs for p in g.plan.inputs)


@pytest.mark.parametrize("answer", [True, False])
def test_graphs_follow_the_answer(cache, monkeypatch, answer):
    torch.manual_seed(0)
    model, x = Wide().eval(), torch.randn(8, 1024)
    asked = []

    def prefer(rows, k, n):
        asked.append((rows, k, n))
        return answer

    monkeypatch.setattr(dot_layout, "prefer_kn", prefer)
    graphs = _compiled(model, x)
    assert sorted(asked) == [(8, 1024, 1024)] * 2
    assert _relaid(graphs) == (2 if answer else 0)


def test_always_does_not_ask(cache, monkeypatch):
    torch.manual_seed(0)
    model, x = Wide().eval(), torch.randn(8, 1024)

    def refuse(*_):
        raise AssertionError("prefer_kn asked under transposed_linear_weights='always'")

    monkeypatch.setattr(dot_layout, "prefer_kn", refuse)
    graphs = _compiled(model, x, transposed_linear_weights="always")
    assert _relaid(graphs) == 2
    graphs = _compiled(model, x, transposed_linear_weights=False)
    assert _relaid(graphs) == 0


def test_real_timing(cache):
    """Unpatched: the layout is what the stored times say, and the result is eager's."""
    torch.manual_seed(0)
    model, x = Wide().eval(), torch.randn(8, 1024)
    graphs = _compiled(model, x)
    nk, kn = _stored(cache)["f32 8x1024x1024"]
    assert _relaid(graphs) == (2 if kn <= dot_layout.MARGIN * nk else 0)


def test_bad_option_value():
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"option transposed_linear_weights='sometimes'; expected True, False or 'always'"):
        torch.compile(Wide(), backend="fx2xla", options={"transposed_linear_weights": "sometimes"})(torch.randn(2, 1024))


def test_export_takes_the_option(cache, tmp_path, monkeypatch):
    """fx2xla.export: "always" relays without asking and the loaded package gives eager's result
    (exported with linear_weight_lhs=False: at 8 rows that keeps the weights as torch holds them);
    a bad value is refused before anything is exported."""
    import fx2xla

    torch.manual_seed(0)
    model, x = Wide().eval(), torch.randn(8, 1024)

    def refuse(*_):
        raise AssertionError("prefer_kn asked under transposed_linear_weights='always'")

    monkeypatch.setattr(dot_layout, "prefer_kn", refuse)
    run = fx2xla.load(fx2xla.export(model, (x,), str(tmp_path / "pkg"), transposed_linear_weights="always",
                                    linear_weight_lhs=False))
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), **TOL)
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    assert manifest["linear_weights_kn"] == "always"
    kinds = [(p["kind"], p["perm"]) for p in manifest["plan"]["inputs"]]  # weight, bias, weight, bias, x
    assert kinds[:4] == [("relaid", [1, 0]), ("tensor", None), ("relaid", [1, 0]), ("tensor", None)], kinds
    with pytest.raises(ValueError, match=r"transposed_linear_weights='sometimes'; expected True, False or 'always'"):
        fx2xla.export(model, (x,), str(tmp_path / "bad"), transposed_linear_weights="sometimes")
    assert not (tmp_path / "bad").exists()
