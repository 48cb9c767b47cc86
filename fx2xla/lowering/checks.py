"""Run-time checks of data a graph reads as indices: eager raises on an out-of-range index,
XLA would clamp a gather or drop a scatter instead, so every such rule records a check. Linear
algebra records checks of the same kind where eager raises LinAlgError (a singular matrix, one
that is not positive-definite): a record says which error its failure raises.

A rule calls `ctx.check_index(...)`; the lowering collects one boolean per check and folds
them into ONE int32 result of the executable: 0 when every check passed, else the number of
the first check that failed (a record says which op, which inputs and which source line).
Loop bodies carry their code out of the loop (`RuntimeChecks.nested`), so checks inside a
scanned layer are reported like the others. `options={"check_indices": False}` lowers no check.

The traced computation returns its verdict as data: a `CheckVerdict`, a jax pytree whose one
child is the code and whose static aux data are the records, so `lower_graph` reads the records
from the traced output's tree (nothing outside the trace is written while jax traces it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

CODE_DTYPE = jnp.int32


# The errors a failed check raises (CheckRecord.error): fx2xla.IndexOutOfRangeError,
# fx2xla.LinAlgError (a torch.linalg.LinAlgError, as eager's linear algebra raises), and
# fx2xla.InvalidValueError (another value eager rejects: a negative repeat count, a NaN
# probability).
INDEX, LINALG, VALUE = "index", "linalg", "value"


@dataclass(frozen=True)
class CheckRecord:
    """What one check guards: the error message raised when it fails, and which error."""

    message: str
    error: str = INDEX


@dataclass(frozen=True)
class CheckVerdict:
    """The checks' result of a traced computation, returned by it as a jax pytree: `code` (its
    one child) is the int32 code, or None where nothing is checked (then no result at all);
    `records` (static aux data, kept in the traced output's tree) are what codes 1, 2, ... name."""

    code: Any = None
    records: tuple[CheckRecord, ...] = ()


jax.tree_util.register_dataclass(CheckVerdict, data_fields=["code"], meta_fields=["records"])


class RuntimeChecks:
    """The checks of one traced computation. `records` is shared by a graph and its nested
    bodies (a code numbers a record graph-wide); `codes` are this trace level's int32 values.
    Each trace of a graph makes its own (a body's trace, a nested one): nothing outlives the
    trace but the `verdict()` the traced function returns."""

    def __init__(self, records: list | None = None):
        self.records: list[CheckRecord] = [] if records is None else records
        self.codes: list = []

    def add(self, record: CheckRecord, failed) -> None:
        """Record a check; `failed` is a traced boolean scalar (True: the check failed)."""
        self.records.append(record)
        self.codes.append(lax.select(failed, jnp.asarray(len(self.records), CODE_DTYPE), no_failure()))

    def add_code(self, code) -> None:
        """Fold in a nested body's code (a loop's, carried out of it)."""
        self.codes.append(code)

    def nested(self) -> "RuntimeChecks":
        """A collector for a body traced at an inner level (a loop or branch body)."""
        return RuntimeChecks(self.records)

    def code(self):
        """The first nonzero code of this level (in graph order), or 0; None if no checks."""
        if not self.codes:
            return None
        return first_failure(self.codes)

    def verdict(self) -> CheckVerdict:
        """The graph's result for the traced function to return: its code and its records,
        or an empty verdict (no result) where no check was recorded."""
        if not self.records:
            return CheckVerdict()
        return CheckVerdict(self.code(), tuple(self.records))


def no_failure():
    """The code of a computation whose checks all passed (or that has none)."""
    return jnp.zeros((), CODE_DTYPE)


def first_failure(codes):
    """The first nonzero of the int32 scalars `codes`, or 0."""
    out = codes[-1]
    for c in reversed(codes[:-1]):
        out = lax.select(c != 0, c, out)
    return out


def out_of_range(index, low: int, high: int):
    """A boolean scalar: some element of `index` lies outside [low, high); None for an empty
    index. (On literal indices XLA folds the whole check to a constant.)"""
    if index.size == 0:
        return None
    return jnp.any((index < low) | (index >= high))
