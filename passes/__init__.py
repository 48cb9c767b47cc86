"""Graph passes run by the backend before AOTAutograd (see manager.py): scan-folding, then
sharding annotations (sharding.py also holds the propagation the plan runs on AOTAutograd's graphs)."""
from . import scan_fold  # noqa: F401  (registers the pass; runs first)
from . import sharding  # noqa: F401  (registers sharding_annotations)
from .manager import PASSES, PassResult, pass_options, register_pass, run_passes

__all__ = ["PASSES", "PassResult", "pass_options", "register_pass", "run_passes"]
