"""Errors a user can hit, each naming the op, its inputs and the user's source line."""
from __future__ import annotations


def describe_value(v) -> str:
    """`f32[4, 8]` for a tensor-like (FakeTensor or meta val), repr for anything else."""
    import torch

    if isinstance(v, torch.Tensor):
        from .lowering.dtypes import short_dtype_name

        return f"{short_dtype_name(v.dtype)}{list(v.shape)}"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(describe_value(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    return repr(v)


def describe_node_inputs(node) -> str:
    import torch.fx

    def val(a):
        if isinstance(a, torch.fx.Node):
            return a.meta.get("val", a.name)
        return a

    args = [describe_value(torch.fx.node.map_aggregate(a, val)) for a in node.args]
    args += [f"{k}={describe_value(torch.fx.node.map_aggregate(a, val))}" for k, a in node.kwargs.items()]
    return ", ".join(args)


def user_source_line(node) -> str:
    """The last frame of the node's recorded stack trace (the user's line), or a note."""
    st = node.meta.get("stack_trace")
    if not st:
        return "(no source line recorded for this node)"
    lines = [l for l in st.rstrip().splitlines() if l.strip()]
    # Keep the innermost 'File ..., line N' frame and the code line under it.
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith("File "):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{lines[i].strip()}\n    {code}"
    return lines[-1].strip()


class Fx2XlaError(RuntimeError):
    """Base class for fx2xla errors."""


class UnsupportedOpError(Fx2XlaError):
    """An ATen op in the graph has no lowering rule."""

    def __init__(self, node):
        self.op = node.target
        self.node = node
        super().__init__(
            f"fx2xla: no lowering rule for {node.target} "
            f"(inputs: {describe_node_inputs(node)})\n  at {user_source_line(node)}\n"
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
