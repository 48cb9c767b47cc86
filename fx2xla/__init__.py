"""fx2xla: a torch.compile backend that lowers FX graphs to StableHLO and runs them on PJRT.

    compiled = torch.compile(model, backend="fx2xla")   # registered by entry point
"""
from .runtime import client as _client  # noqa: F401  (its memory policy applies before any jax client starts)
from .errors import Fx2XlaError, IndexOutOfRangeError, InvalidInputError, InvalidValueError, LinAlgError
from .lowering import rules as _rules  # noqa: F401  (registers every lowering rule, once)
from . import distributed  # noqa: F401  (fx2xla.distributed: many processes, one global mesh; starts nothing)
from .metrics import metrics, metrics_report
from .offload import OffloadError, explain_memory, place_to_device, place_to_host
from .package import LoadedModel, PackageError, export, load
from .runtime.host_memory import release as release_host_memory
from .scan import scan, scan_layers
from .serving import RecompileError, TensorSpec, no_recompile, warmup
from .passes.auto_sharding import InfeasibleBudget
from .sharding import Mesh, ShardedTensor, ShardingError, clear_sharding, explain_sharding, fsdp, mark_sharding, shard_module

from .version import __version__
__all__ = ["metrics", "metrics_report", "scan", "scan_layers", "warmup", "no_recompile", "TensorSpec", "RecompileError",
           "Fx2XlaError", "IndexOutOfRangeError", "InvalidInputError", "InvalidValueError", "LinAlgError",
           "export", "load", "LoadedModel",
           "PackageError", "place_to_host", "place_to_device", "explain_memory", "OffloadError", "Mesh", "ShardedTensor", "mark_sharding", "clear_sharding", "explain_sharding", "shard_module", "fsdp", "ShardingError", "InfeasibleBudget",
           "release_host_memory",
           "__version__"]
