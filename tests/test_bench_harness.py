"""The benchmark harness interleaves contenders in balanced orders: each runs first equally
often and right after each other contender equally often (a plain rotation does not, and the
contender that follows eager's still-spinning OpenMP threads more often measured 10-25% slower).
Back to back, each contender's timed calls follow an untimed call of its own."""
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from harness import back_to_back_medians, balanced_orders, interleaved_medians  # noqa: E402


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


def test_back_to_back_medians_times_runs_of_one_contender():
    """Every round calls each contender 1 + `calls` times in a row (the first untimed), in the
    balanced orders; the median is per call: a contender that sleeps 2 ms a call gives about
    2 ms whatever `calls` is, and one that sleeps only on its untimed call gives far less."""
    import time

    log = []
    slow_first = {"n": 0}

    def contender(name):
        def run():
            log.append(name)
            if name == "s":
                time.sleep(0.002)
            if name == "w":
                slow_first["n"] += 1
                if slow_first["n"] % 4 == 1:  # the untimed call of each round (1 + 3 calls)
                    time.sleep(0.02)
        return run

    med = back_to_back_medians({k: contender(k) for k in "sw"}, (), rounds=4, calls=3)
    assert len(log) == 4 * 2 * 4
    runs = [log[i:i + 4] for i in range(0, len(log), 4)]
    assert all(len(set(run)) == 1 for run in runs)
    orders = balanced_orders(2)
    for r in range(4):
        assert [run[0] for run in runs[2 * r:2 * r + 2]] == [["s", "w"][i] for i in orders[r % len(orders)]]
    assert 0.0019 < med["s"] < 0.01
    assert med["w"] < 0.005
