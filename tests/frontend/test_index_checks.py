"""Out-of-range indices raise as in eager, never a silent answer (and in-range ones match eager).

Each case runs eager first: it must raise, and then the compiled call must raise an exception
of a type eager's `except` would catch (fx2xla.IndexOutOfRangeError is both an IndexError and
a RuntimeError), whose message names the op and the user's source line. The same compiled
function given in-range indices matches eager exactly (every output here is a gather or a
scatter of float32 values: no rounding, so tolerance 0 where not stated).
"""
import pytest
import torch
import torch.nn.functional as F

import fx2xla
from fx2xla.plan_executor import make_check_raiser
from fx2xla.lowering.checks import CheckRecord

X = torch.arange(15, dtype=torch.float32).reshape(5, 3)
W = torch.randn(10, 3)


def _compiled(fn, **options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="fx2xla", fullgraph=True, options={"fallback": "error", **options})


def _raises_like_eager(fn, *args, op: str):
    with pytest.raises((IndexError, RuntimeError)) as eager:
        fn(*args)
    with pytest.raises(fx2xla.IndexOutOfRangeError) as info:
        _compiled(fn)(*args)
    assert isinstance(info.value, type(eager.value)), (type(eager.value), type(info.value))
    msg = str(info.value)
    assert op in msg and "out of range" in msg
    assert "test_index_checks.py" in msg  # the user's source line
    return msg


# (name, fn, bad args, good args, op named in the error)
CASES = [
    ("embedding", lambda i: F.embedding(i, W), (torch.tensor([1, 12]),), (torch.tensor([[0, 9], [3, 3]]),), "aten.embedding"),
    ("embedding_negative", lambda i: F.embedding(i, W), (torch.tensor([-1]),), (torch.tensor([2]),), "aten.embedding"),
    ("embedding_bag", lambda i: F.embedding_bag(i, W, torch.tensor([0])), (torch.tensor([1, 10]),),
     (torch.tensor([1, 9]),), "embedding_bag"),
    ("gather", lambda i: X.gather(0, i), (torch.tensor([[5, 0, 0]]),), (torch.tensor([[4, 0, 2]]),), "aten.gather"),
    ("gather_negative", lambda i: X.gather(1, i), (torch.tensor([[-1]]),), (torch.tensor([[2]]),), "aten.gather"),
    ("index_select", lambda i: X.index_select(0, i), (torch.tensor([7]),), (torch.tensor([4, 0]),), "aten.index_select"),
    ("index_select_negative", lambda i: X.index_select(1, i), (torch.tensor([-1]),), (torch.tensor([2]),),
     "aten.index_select"),
    ("getitem", lambda i: X[i], (torch.tensor([5]),), (torch.tensor([-5, 4]),), "aten.index"),
    ("getitem_negative", lambda i: X[i], (torch.tensor([-6]),), (torch.tensor([-1]),), "aten.index"),
    ("getitem_second_dim", lambda i: X[:, i], (torch.tensor([3]),), (torch.tensor([-3, 2]),), "aten.index"),
    ("take", lambda i: X.take(i), (torch.tensor([15]),), (torch.tensor([-15, 14]),), "aten.take"),
    ("index_put", lambda i: X.index_put((i,), torch.ones(3)), (torch.tensor([5]),), (torch.tensor([-1]),),
     "aten.index_put"),
    ("index_add", lambda i: X.index_add(0, i, torch.ones(1, 3)), (torch.tensor([-1]),), (torch.tensor([4]),),
     "aten.index_add"),
    ("index_copy", lambda i: X.index_copy(0, i, torch.ones(1, 3)), (torch.tensor([5]),), (torch.tensor([0]),),
     "aten.index_copy"),
    ("index_fill", lambda i: X.index_fill(0, i, 1.0), (torch.tensor([-6]),), (torch.tensor([-5]),), "aten.index_fill"),
    ("scatter", lambda i: X.scatter(0, i, 1.0), (torch.tensor([[5, 0, 0]]),), (torch.tensor([[4, 0, 0]]),),
     "aten.scatter"),
    ("scatter_add", lambda i: X.scatter_add(0, i, torch.ones(1, 3)), (torch.tensor([[0, -1, 0]]),),
     (torch.tensor([[0, 1, 0]]),), "aten.scatter_add"),
    ("scatter_reduce", lambda i: X.scatter_reduce(1, i, torch.ones(5, 1), "amax"), (torch.tensor([[3]] * 5),),
     (torch.tensor([[2]] * 5),), "aten.scatter_reduce"),
    ("nll_loss", lambda t: F.nll_loss(X, t), (torch.tensor([0, 1, 3, 0, 1]),), (torch.tensor([0, 1, 2, -100, 1]),),
     "nll_loss"),
]


@pytest.mark.parametrize("name,fn,bad,good,op", CASES, ids=[c[0] for c in CASES])
def test_out_of_range_raises_and_in_range_matches(name, fn, bad, good, op):
    _raises_like_eager(fn, *bad, op=op)
    torch.testing.assert_close(_compiled(fn)(*good), fn(*good), rtol=0, atol=0)


def test_gpt2_with_a_token_beyond_its_vocabulary_raises():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    compiled = _compiled(model)
    with torch.no_grad():
        ok = torch.tensor([[1, 99, 5]])
        torch.testing.assert_close(compiled(ok).logits, model(ok).logits, rtol=1e-4, atol=1e-5)
        with pytest.raises(IndexError, match="embedding"):
            compiled(torch.tensor([[1, 150, 5]]))


def test_failed_check_writes_no_input():
    """A step that writes its input and then reads an index out of range leaves the input as
    it was: the check is read before write-backs are installed."""
    def step(x, i):
        x.add_(1)
        return x[i]

    x = torch.zeros(4)
    with pytest.raises(IndexError):
        _compiled(step)(x, torch.tensor([9]))
    assert torch.equal(x, torch.zeros(4))


def test_checks_inside_a_scanned_loop_body():
    """A gather in a loop body is checked at every iteration; the error names the body's op."""
    table = torch.randn(6, 4)

    def run(ids):  # ids: [steps, 1], one row index per step
        def body(carry, i):
            return carry + table[i][0], carry.sum()
        return fx2xla.scan(body, torch.zeros(4), ids)

    good = torch.tensor([[0], [5], [2], [-6]])
    expected = run(good)
    torch.testing.assert_close(_compiled(run)(good), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexError, match="out of range"):
        _compiled(run)(torch.tensor([[0], [1], [6], [2]]))  # only the third step is out of range


def test_checks_inside_cond_branches():
    def f(pred, x, i):
        return torch.cond(pred, lambda x, i: x[i] * 2, lambda x, i: x[:1] + 1, (x, i))

    x = torch.arange(4.0)
    compiled = _compiled(f)
    torch.testing.assert_close(compiled(torch.tensor(True), x, torch.tensor([3])), torch.tensor([6.0]))
    # The branch not taken reads no index: no error even with an index out of range.
    torch.testing.assert_close(compiled(torch.tensor(False), x, torch.tensor([7])), torch.tensor([1.0]))
    with pytest.raises(IndexError, match="out of range"):
        compiled(torch.tensor(True), x, torch.tensor([7]))


def test_graphs_without_index_ops_keep_the_direct_path():
    """No index op, no check: the executable has no verdict result and its outputs are
    returned as they are (the per-call fast path)."""
    from fx2xla.metrics import live_graphs

    older = set(live_graphs)  # graphs of earlier tests may still be alive
    compiled = _compiled(lambda x: x * 2 + 1)
    x = torch.randn(4)
    torch.testing.assert_close(compiled(x), x * 2 + 1)
    (graph,) = [g for g in live_graphs if g not in older]
    assert not graph.static.checks and graph.static.direct


def test_check_indices_false_skips_the_checks():
    """Documented risk: with the checks off, an out-of-range gather reads a clamped element."""
    compiled = _compiled(lambda i: X.index_select(0, i), check_indices=False)
    out = compiled(torch.tensor([7]))  # no error: XLA clamps to the last row
    torch.testing.assert_close(out, X[4:5])


def test_check_raisers_private_and_public():
    """Both ways of reading a verdict raise on a failed check and pass an all-clear one. The
    private one (torch._assert_async, the accelerator path) raises synchronously on CPU."""
    records = (CheckRecord("fx2xla: aten.gather.default: index out of range"),)
    public, private = make_check_raiser("cuda", public=True), make_check_raiser("cuda", public=False)
    assert make_check_raiser("cpu") is public and private is not public
    for raiser in (public, private):
        raiser(torch.tensor(0, dtype=torch.int32), records)  # all clear
        with pytest.raises(RuntimeError, match="index out of range"):
            raiser(torch.tensor(1, dtype=torch.int32), records)
    with pytest.raises(IndexError, match="aten.gather"):
        public(torch.tensor(1, dtype=torch.int32), records)


def test_async_check_message_fits_torchs_limit():
    """The accelerator path (torch._assert_async, whose message torch caps at 254 characters)
    takes any number of long check records: it passes a clean verdict, and a failed one
    raises naming the ops (run here on CPU tensors; CUDA enqueues the same call)."""
    _assert_async_private = make_check_raiser("cuda", public=False)
    records = tuple(CheckRecord(f"fx2xla: aten.embedding.default: embedding index out of range: {'x' * 300}")
                    for _ in range(3)) + (CheckRecord("fx2xla: aten.gather.default: index out of range: y"),)
    _assert_async_private(torch.tensor(0, dtype=torch.int32), records)
    with pytest.raises(RuntimeError, match=r"aten.embedding.default, aten.gather.default"):
        _assert_async_private(torch.tensor(2, dtype=torch.int32), records)


@pytest.mark.parametrize("bad, message", [([1, 7, 4], "smaller than num_classes"), ([-1, 0, 1], "non-negative")])
def test_one_hot_class_values_checked_as_in_eager(bad, message):
    """F.one_hot with num_classes: its decomposition asserts the class values lie in
    [0, num_classes) (`aten._assert_async.msg`), which fx2xla lowers as a run-time check
    (no eager island under fallback="error"): in-range values match eager exactly, values out of
    range raise fx2xla.InvalidValueError (a RuntimeError, as eager's) with eager's message, the
    op and the user's source line; check_indices=False skips the check as for index checks."""
    def fn(x):
        return F.one_hot(x, 5) * 2

    good = torch.tensor([[1, 2], [4, 0]])
    torch.testing.assert_close(_compiled(fn)(good), fn(good), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=message):
        fn(torch.tensor(bad))
    with pytest.raises(fx2xla.InvalidValueError) as info:
        _compiled(fn)(torch.tensor(bad))
    assert isinstance(info.value, RuntimeError)
    msg = str(info.value)
    assert message in msg and "_assert_async" in msg and "test_index_checks.py" in msg
    _compiled(fn, check_indices=False)(torch.tensor(bad))   # no check, no error
