"""Installing fx2xla never replaces a user's torch or jax: pyproject.toml states ranges that
admit both the CPU wheels `make` tests (torch 2.13.0, jax 0.10.2) and the CUDA machine's own
builds (torch 2.11, jax 0.11.2), while the Makefile pins the CPU wheels for development."""
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def _requirements() -> dict:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {r.name: r for r in map(Requirement, project["dependencies"])}, project["optional-dependencies"]


def test_ranges_admit_the_cpu_and_cuda_environments():
    deps, extras = _requirements()
    for version in ("2.11.0", "2.13.0"):
        assert deps["torch"].specifier.contains(version), (deps["torch"], version)
    for name in ("jax", "jaxlib"):
        for version in ("0.10.2", "0.11.2"):
            assert deps[name].specifier.contains(version), (deps[name], version)
    assert not deps["torch"].specifier.contains("2.14.0")  # untested releases are not admitted
    cuda13 = [Requirement(r) for r in extras["cuda13"]]
    assert any(r.name == "jax" and "cuda13" in r.extras for r in cuda13)


def test_makefile_pins_the_cpu_wheels():
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile and "jax==0.10.2" in makefile and "jaxlib==0.10.2" in makefile
