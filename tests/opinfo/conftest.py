"""The OpInfo sweep's marker: `-m opinfo_full` selects the full sweep (also marked `slow`,
so the default run, `-m 'not slow'` from pyproject's addopts, leaves it out)."""
import pytest


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "opinfo_full: the full OpInfo sweep, every op/dtype/sample (hours; -m opinfo_full)"
    )


@pytest.fixture(autouse=True)
def _rules_not_constant_folding(monkeypatch):
    """Factory ops' samples (arange, full, eye, linspace ...) take no tensor input, so their
    whole graph is input-independent and the lowering would fold it into a literal computed
    by torch. The sweep tests the lowering rules themselves: no folding here."""
    import fx2xla.plan as plan

    monkeypatch.setattr(plan, "CONSTANT_FOLD_MAX_ELEMENTS", 0)
