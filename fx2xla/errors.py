"""Errors a user can hit, each naming the op, its inputs and the user's source line."""
from __future__ import annotations

import os
import re

import torch
import torch.fx

from .lowering.dtypes import short_dtype_name


def describe_value(v) -> str:
    """`f32[4, 8]` for a tensor-like (FakeTensor or meta val), repr for anything else."""
    if isinstance(v, torch.Tensor):
        return f"{short_dtype_name(v.dtype)}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(describe_value(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    return repr(v)


def describe_node_inputs(node) -> str:
    def val(a):
        if isinstance(a, torch.fx.Node):
            return a.meta.get("val", a.name)
        return a

    wrapped = node.target is torch.ops.higher_order.with_effects  # (token, op, *op's arguments)
    args = [describe_value(torch.fx.node.map_aggregate(a, val)) for a in node.args[2 if wrapped else 0:]]
    args += [f"{k}={describe_value(torch.fx.node.map_aggregate(a, val))}" for k, a in node.kwargs.items()]
    return ", ".join(args)


def user_source_line(node) -> str:
    """The last frame of the node's recorded stack trace (the user's line); where Dynamo
    recorded none (an op torch.nn's own code calls from a module the user compiled), the
    innermost module it ran in; else a note."""
    st = node.meta.get("stack_trace")
    if not st:
        return _module_of(node) or "(no source line recorded for this node)"
    lines = [l for l in st.rstrip().splitlines() if l.strip()]
    # The innermost 'File ..., line N' frame outside torch's own code, and the code line under
    # it; torch's innermost frame where every frame is torch's. (An op of a function torch's
    # Python code traces for the user, e.g. flex_attention's score_mod, records the user's call
    # and then torch's line that traced it.)
    frames = [i for i, l in enumerate(lines) if l.lstrip().startswith("File ")]
    if not frames:
        return lines[-1].strip()
    theirs = [i for i in frames if not _in_torch(lines[i])]
    i = (theirs or frames)[-1]
    code = lines[i + 1].strip() if i + 1 < len(lines) and i + 1 not in frames else ""
    return f"{lines[i].strip()}\n    {code}"


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _in_torch(frame_line: str) -> bool:
    """Whether a 'File "path", line N, in f' line names a file of torch's package."""
    m = re.match(r'\s*File "([^"]+)"', frame_line)
    return bool(m) and os.path.abspath(m.group(1)).startswith(_TORCH_DIR)


def _module_of(node) -> str | None:
    """`module 1.pool (torch.nn.modules.pooling.FractionalMaxPool2d)`: the innermost entry of
    the node's nn_module_stack, its path relative to the compiled module (Dynamo's `L['fn']`
    or `L['self']` root dropped)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1][:2]
    path = re.sub(r"^L\['[^']*'\]\.?", "", str(path)) or "(the compiled module)"
    name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)
    return f"module {path} ({name}); no line of yours calls the op, torch's code does"


def passthrough_base(public: bool | None = None) -> type:
    """The base class of fx2xla's errors. Dynamo wraps whatever a backend raises while compiling
    in BackendCompilerFailed, except subclasses of its private `ShortenTraceback` (a
    RuntimeError), which reach the user as themselves: `except fx2xla.RecompileError` then works.
    Public fallback (absent class, or FX2XLA_PUBLIC_ERRORS=1): RuntimeError, which Dynamo wraps
    (the fx2xla error is then the wrapper's `inner_exception`)."""
    import os

    if public is None:
        public = os.environ.get("FX2XLA_PUBLIC_ERRORS", "") not in ("", "0")
    if not public:
        try:
            from torch._dynamo.exc import ShortenTraceback

            return ShortenTraceback
        except ImportError:
            pass
    return RuntimeError


_Base = passthrough_base()


class Fx2XlaError(_Base):
    """Base class for fx2xla errors (a RuntimeError)."""

    def __init__(self, *args):
        if _Base is RuntimeError:
            super().__init__(*args)
        else:  # ShortenTraceback's own argument: no frame to cut the traceback at
            super().__init__(*args, first_useful_frame=None)


class InvalidInputError(Fx2XlaError):
    """An input eager PyTorch rejects (e.g. `mm` of int64 by float32), found while compiling:
    a RuntimeError like eager's, naming the op, the inputs and the user's source line."""

    def __init__(self, node, message: str):
        """`node`: the FX node whose op rejects its inputs, or the op's name where no node is at
        hand (a decomposition checking its arguments while AOTAutograd traces)."""
        if isinstance(node, torch.fx.Node):
            self.op, self.node = node.target, node
            super().__init__(f"fx2xla: {op_name(node)}: {message}\n  inputs: {describe_node_inputs(node)}\n"
                             f"  at {user_source_line(node)}")
        else:
            self.op, self.node = node, None
            super().__init__(f"fx2xla: {node}: {message}")


class IndexOutOfRangeError(Fx2XlaError, IndexError):
    """An index out of range, found when the compiled graph ran. Both an IndexError and a
    RuntimeError: eager raises one or the other depending on the op (embedding and x[i]:
    IndexError; gather and scatter: RuntimeError), and either `except` catches this."""


class LinAlgError(Fx2XlaError, torch.linalg.LinAlgError):
    """A matrix eager's linear algebra rejects (singular, not positive-definite), found when the
    compiled graph ran: a torch.linalg.LinAlgError, as eager raises for that input."""


class InvalidValueError(Fx2XlaError):
    """An input value eager rejects other than an index or a matrix (a negative repeat count, a
    probability that is NaN or negative), found when the compiled graph ran: a RuntimeError,
    as eager raises for that input."""


def op_name(node) -> str:
    """The op the user called: the ATen op before decomposition where AOTAutograd recorded it
    (`index_add` rather than the `index_put` it became), else the node's own target."""
    return str(node.meta.get("original_aten") or node_op(node))


def node_op(node):
    """The op a node calls: for `with_effects(token, op, ...)`, the effectful op it wraps."""
    if node.target is torch.ops.higher_order.with_effects and len(node.args) > 1:
        return node.args[1]
    return node.target


class UnsupportedOpError(Fx2XlaError):
    """An ATen op in the graph has no lowering rule."""

    def __init__(self, node, why: str | None = None):
        """`why`: where the op has a rule, why it cannot lower this node."""
        self.op = node_op(node)
        self.node = node
        head = f"fx2xla: {self.op} cannot be lowered: {why}" if why else f"fx2xla: no lowering rule for {self.op}"
        super().__init__(
            f"{head} (inputs: {describe_node_inputs(node)})\n  at {user_source_line(node)}\n"
            "Rewrite that line with supported ops, or run the region eagerly "
            "(torch.compiler.disable), and please report the op."
        )


class LoweringError(Fx2XlaError):
    """A rule failed while lowering one node."""

    def __init__(self, node, cause: BaseException):
        self.op = node.target
        self.node = node
        super().__init__(
            f"fx2xla: lowering {node.target} failed: {type(cause).__name__}: {cause}\n"
            f"  inputs: {describe_node_inputs(node)}\n  at {user_source_line(node)}"
        )
