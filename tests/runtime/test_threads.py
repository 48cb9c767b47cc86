"""Many Python threads calling compiled functions at once, on the private fast path (default):
every result equals the single-threaded one exactly (the same executables, deterministic on
the CPU), concurrent first calls of a new shape compile it once, and compiles, warm-ups and
calls racing each other neither fail nor corrupt the caches."""
import threading

import pytest
import torch

import fx2xla
from fx2xla.runtime.executor import make_traceback_pause

THREADS = 4


def _run_threads(work, n=THREADS):
    """Run work(i) in n threads started together; re-raise the first failure."""
    errors, barrier = [], threading.Barrier(n)

    def body(i):
        try:
            barrier.wait()
            work(i)
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()


class _Wrapped(torch.nn.Module):
    """A module whose forward is a code object of its own, so that Dynamo keeps its graphs apart
    from those of a bare Sequential."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _gpt2():
    from fx2xla.testing import LogitsOnly, gpt2

    torch.manual_seed(0)
    return LogitsOnly(gpt2(layers=1, hidden=64, heads=2, vocab=100, positions=64)).eval()


def test_threads_times_calls_times_models():
    torch._dynamo.reset()
    models = [(_mlp(), lambda i: torch.randn(4, 32, generator=torch.Generator().manual_seed(i))),
              (_gpt2(), lambda i: torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(i)))]
    compiled = [torch.compile(m, backend="fx2xla") for m, _ in models]
    inputs = [[make(i) for i in range(THREADS)] for _, make in models]
    with torch.no_grad():
        expected = [[c(x) for x in xs] for c, xs in zip(compiled, inputs)]  # single-threaded
        for (model, _), xs, want in zip(models, inputs, expected):
            torch.testing.assert_close(want[0], model(xs[0]), rtol=1e-4, atol=1e-4)

    def work(i):
        with torch.no_grad():
            for call in range(50):
                k = (i + call) % len(compiled)
                assert torch.equal(compiled[k](inputs[k][i]), expected[k][i])

    _run_threads(work)


def test_concurrent_first_calls_of_a_new_shape_compile_it_once():
    torch._dynamo.reset()
    model = _mlp()
    compiled = torch.compile(model, backend="fx2xla", dynamic=True)
    with torch.no_grad():
        compiled(torch.randn(3, 32))  # the dynamic graph exists; batch 5 is new to it
        before = fx2xla.metrics()["specializations"]
        x = torch.randn(5, 32)
        want = model(x)
        results = [None] * THREADS

        def work(i):
            with torch.no_grad():
                results[i] = compiled(x)

        _run_threads(work)
    assert fx2xla.metrics()["specializations"] - before == 1
    for r in results:
        torch.testing.assert_close(r, want, rtol=1e-4, atol=1e-5)


def test_a_compile_and_a_warmup_racing_calls():
    """One thread compiles a new model and another warms a third one up while two threads
    serve a warm model: nothing fails, every result is right. The third model is wrapped in a
    module of its own class: Dynamo keys compiled graphs by code and guards, not by module, so a
    bare Sequential warmed at batch 6 (of any width) would leave a graph with dynamic sizes that
    then serves the warm model too, whose program (no weight on the dot's left at a dynamic row
    count) differs from its own by rounding."""
    torch._dynamo.reset()
    warm, fresh, warmed = _mlp(), _gpt2(), _Wrapped(_mlp())
    serve = torch.compile(warm, backend="fx2xla")
    x = torch.randn(4, 32)
    with torch.no_grad():
        want = serve(x)
    ids = torch.randint(0, 100, (2, 16))
    with torch.no_grad():
        fresh_want = fresh(ids)
        warmed_want = warmed(torch.zeros(6, 32))

    def work(i):
        with torch.no_grad():
            if i == 0:
                torch.testing.assert_close(torch.compile(fresh, backend="fx2xla")(ids), fresh_want, rtol=1e-4, atol=1e-4)
            elif i == 1:
                compiled = torch.compile(warmed, backend="fx2xla")
                fx2xla.warmup(compiled, [fx2xla.TensorSpec((6, 32))], progress=False)
                torch.testing.assert_close(compiled(torch.zeros(6, 32)), warmed_want, rtol=1e-4, atol=1e-5)
            else:
                for _ in range(100):
                    assert torch.equal(serve(x), want)

    _run_threads(work)


@pytest.mark.parametrize("public", [False, True])
def test_traceback_pause_never_flips_under_another_thread(public):
    """The private pause turns jaxlib's global traceback switch off when the first call starts
    and back on when the last call in flight ends, whichever thread ends last, so no call runs
    under a flip; the public one never touches it."""
    from jax._src.lib import _jax

    pause, resume = make_traceback_pause(public)
    assert _jax.tracebacks_enabled()
    if public:
        assert pause() is False and _jax.tracebacks_enabled()
        return
    assert pause() is True and pause() is True and not _jax.tracebacks_enabled()  # nested: counted
    resume()
    assert not _jax.tracebacks_enabled()  # one paused call is still in flight
    resume()
    assert _jax.tracebacks_enabled()
    # Thread A pauses, thread B pauses, A ends first: the switch stays off until B ends.
    a_paused, b_paused, a_done = threading.Event(), threading.Event(), threading.Event()
    states = {}

    def a():
        states["a"] = pause()
        a_paused.set()
        b_paused.wait()
        resume()
        a_done.set()

    def b():
        a_paused.wait()
        states["b"] = pause()
        b_paused.set()
        a_done.wait()
        states["during_b"] = _jax.tracebacks_enabled()
        resume()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert states == {"a": True, "b": True, "during_b": False}
    assert _jax.tracebacks_enabled()


def test_recording_waits_for_paused_calls_and_new_calls_run_recorded():
    """A compile (or a sharded call keeping its shards) needs jaxlib's traceback recording on
    from start to end: `recording()` waits until no paused call is in flight, and while it
    lasts new calls run recorded instead of turning the switch off under it; the switch goes
    off again only once every recorded call has ended too."""
    from jax._src.lib import _jax

    from fx2xla.runtime.executor import RECORDED, make_recording

    pause, resume = make_traceback_pause(False)
    recording = make_recording(False)
    inside, release, states = threading.Event(), threading.Event(), {}

    def compile_like():
        with recording():
            states["on_inside"] = _jax.tracebacks_enabled()
            inside.set()
            release.wait(30)

    assert pause() is True and not _jax.tracebacks_enabled()  # a call in flight
    t = threading.Thread(target=compile_like)
    t.start()
    assert not inside.wait(0.3)  # the compile waits for the paused call
    resume()
    assert inside.wait(30) and states["on_inside"]
    kind = pause()  # a new call runs recorded meanwhile, as a member of the recorded group
    assert kind is RECORDED and _jax.tracebacks_enabled()
    release.set()
    t.join(30)
    second = pause()  # the recorded call is still in flight: this one runs recorded too
    assert second is RECORDED and _jax.tracebacks_enabled()
    resume(second)
    resume(kind)
    assert pause() is True and not _jax.tracebacks_enabled()  # and pauses again afterwards
    resume()
    assert _jax.tracebacks_enabled()
    with make_recording(True)():  # the public form: nothing to wait for
        assert _jax.tracebacks_enabled()


def test_warmed_up_in_the_served_mode_many_threads_make_no_graph():
    """Dynamo itself retraces once per thread when several threads miss its cache at once (its
    compile lock is taken after the miss; pytorch/pytorch#123177), and with fullgraph=True the
    thread past its recompile limit raises. Warmed up under the threads' grad mode, as
    docs/serving.md advises, twelve threads of a fullgraph model make no new graph, none raises,
    and each result equals the single-threaded one exactly."""
    torch._dynamo.reset()
    model = _Wrapped(_mlp())
    compiled = torch.compile(model, backend="fx2xla", fullgraph=True)
    inputs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    with torch.no_grad():
        expected = [compiled(x) for x in inputs]
        torch.testing.assert_close(expected[0], model(inputs[0]), rtol=1e-4, atol=1e-5)
    graphs = fx2xla.metrics()["graphs"]

    def work(i):
        with torch.no_grad():
            for _ in range(10):
                assert torch.equal(compiled(inputs[i]), expected[i])

    _run_threads(work, n=12)
    assert fx2xla.metrics()["graphs"] == graphs


class _Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.count.add_(1)
        return x * 2 + self.count


@pytest.mark.parametrize("in_place", ["1", "0"], ids=["in_place", "swapped"])
def test_threads_calling_a_graph_that_writes_its_input(in_place, monkeypatch):
    """Six threads call one compiled module that increments a buffer, 40 calls each: calls of a
    graph that writes its inputs run one at a time, so none fails, every output is x * 2 plus a
    count between 2 and 241 (int64, exact), no two calls see the same count, and the buffer ends
    at 241, as a single thread would leave it. Whether XLA writes the buffer in place or a new
    storage is swapped in (FX2XLA_INPLACE)."""
    monkeypatch.setenv("FX2XLA_INPLACE", in_place)
    torch._dynamo.reset()
    m = _Counter()
    c = torch.compile(m, backend="fx2xla")
    with torch.no_grad():
        c(torch.zeros(3, 4))
    seen, lock, calls = [], threading.Lock(), 40

    def work(i):
        for _ in range(calls):
            with torch.no_grad():
                y = c(torch.ones(3, 4))
            count = y[0, 0].item() - 2
            assert torch.equal(y, torch.full((3, 4), 2.0 + count)), y
            with lock:
                seen.append(count)

    _run_threads(work, n=6)
    assert m.count.item() == 6 * calls + 1
    assert sorted(seen) == list(range(2, 6 * calls + 2))
