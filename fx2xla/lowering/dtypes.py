"""torch <-> jax dtype mapping."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
}
JAX_TO_TORCH = {np.dtype(v): k for k, v in TORCH_TO_JAX.items()}

_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


def to_jax_dtype(dtype: torch.dtype):
    try:
        return np.dtype(TORCH_TO_JAX[dtype])
    except KeyError:
        raise TypeError(f"fx2xla: dtype {dtype} has no XLA equivalent") from None


def to_torch_dtype(dtype) -> torch.dtype:
    return JAX_TO_TORCH[np.dtype(dtype)]


def short_dtype_name(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, dtype_name(dtype))


def dtype_name(dtype: torch.dtype) -> str:
    """`float32` for torch.float32: the name users write, for error messages."""
    return str(dtype).removeprefix("torch.")
