"""The OpInfo sweep's marker: `-m opinfo_full` selects the full sweep (also marked `slow`,
so the default run, `-m 'not slow'` from pyproject's addopts, leaves it out)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "opinfo_full: the full OpInfo sweep, every op/dtype/sample (hours; -m opinfo_full)"
    )
