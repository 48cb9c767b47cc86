"""bench/gpu_waits.py's witnesses, on the CPU: the stack of a call that is still running after
the given time names the function it waits in (read by faulthandler), and none is taken from a
call that returns in time; the long host calls of a profile are the events over the threshold,
longest first, without the profiler's step ranges."""
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import gpu_waits  # noqa: E402


def _waits_here():
    time.sleep(0.3)


def test_stack_of_a_waiting_call_names_where_it_waits():
    stack = gpu_waits.stack_while_waiting(_waits_here, 0.05)
    assert stack is not None and "_waits_here" in stack and "most recent call first" in stack
    assert gpu_waits.stack_while_waiting(lambda: None, 0.2) is None


def test_long_host_calls_are_the_events_over_the_threshold():
    a = torch.randn(800, 800)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a = a @ a / 800
        time.sleep(0.01)
    rows = gpu_waits.long_host_calls(prof, min_us=0.0)
    assert rows and any(r["name"] == "aten::mm" for r in rows)
    assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)
    assert not any(r["name"].startswith("ProfilerStep") for r in rows)
    longest = rows[0]["ms"]
    assert gpu_waits.long_host_calls(prof, min_us=(longest + 0.01) * 1e3) == []  # ms are rounded to 0.01
