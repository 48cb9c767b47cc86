"""Graph passes run by the backend before AOTAutograd (see manager.py): scan-folding."""
from . import scan_fold  # noqa: F401  (registers the pass)
from .manager import PASSES, PassResult, pass_options, register_pass, run_passes

__all__ = ["PASSES", "PassResult", "pass_options", "register_pass", "run_passes"]
