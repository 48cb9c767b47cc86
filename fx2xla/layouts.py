"""Dense layouts as permutations: which permutation makes a strided tensor row-major, and
permutation algebra. Plans and lowering rules both read them."""
from __future__ import annotations

import torch


def dense_permutation(shape, stride) -> tuple[int, ...] | None:
    """The permutation `perm` such that `t.permute(perm)` is row-major contiguous, if `t` is
    dense (no gaps, no overlap); None otherwise. Identity means already contiguous."""
    dims = [d for d in range(len(shape))]
    perm = tuple(sorted(dims, key=lambda d: -stride[d]))  # stable: ties keep their order
    expected = 1
    for d in reversed(perm):
        if shape[d] != 1 and stride[d] != expected:
            return None
        expected *= shape[d]
    return perm


def is_identity(perm) -> bool:
    return perm == tuple(range(len(perm)))


def inverse(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def symbolic(shape) -> bool:
    return any(isinstance(s, torch.SymInt) for s in shape)
