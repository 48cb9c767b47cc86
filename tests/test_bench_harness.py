"""The benchmark harness interleaves contenders in balanced orders: each runs first equally
often and right after each other contender equally often (a plain rotation does not, and the
contender that follows eager's still-spinning OpenMP threads more often measured 10-25% slower)."""
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from harness import balanced_orders, interleaved_medians  # noqa: E402


@pytest.mark.parametrize("n", range(1, 8))
def test_orders_are_balanced(n):
    rows = balanced_orders(n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    assert len(set(Counter(row[0] for row in rows).values())) == 1
    follows = Counter((row[i], row[i + 1]) for row in rows for i in range(n - 1))
    assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1


def test_interleaved_medians_runs_every_contender_every_round():
    calls = Counter()

    def contender(name):
        def run():
            calls[name] += 1
        return run

    med = interleaved_medians({k: contender(k) for k in "abc"}, (), rounds=6)
    assert set(med) == set("abc") and all(v >= 0 for v in med.values())
    assert calls == {"a": 6, "b": 6, "c": 6}
