"""Complex numbers: magnitudes, phases, signs and spectra match eager, and no complex value is
ever cast to real silently (no jax ComplexWarning reaches the user; a rule that would drop an
imaginary part fails loudly instead). Tolerances: conftest's per dtype (complex64 rtol 1e-4,
atol 1e-5; complex128 1e-7)."""
import warnings

import numpy as np
import pytest
import torch

from fx2xla.lowering.registry import complex_to_real

DTYPES = [torch.complex64, torch.complex128]


def _z(*shape, dtype=torch.complex64):
    torch.manual_seed(0)
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_magnitude_sign_phase_parts(check, dtype):
    z = _z(4, 5, dtype=dtype)
    z[0, 0] = 0  # sgn(0) = 0, abs(0) = 0
    check(lambda z: (z.abs(), z.sgn(), z.real * 2, z.imag - 1, torch.view_as_real(z), z.conj() * z), z)


@pytest.mark.parametrize("dtype", DTYPES)
def test_spectrum_magnitude(check, dtype):
    real = torch.float32 if dtype == torch.complex64 else torch.float64
    x = torch.randn(3, 16, dtype=real)
    check(lambda x: (torch.fft.rfft(x).abs(), torch.fft.fft(x).abs().pow(2), torch.fft.rfft(x).angle()), x,
          tol_scale=10)


def test_complex_to_real_cast_keeps_the_real_part(check):
    z = _z(6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's own "discards the imaginary part"
        check(lambda z: (z.to(torch.float32), z.real.to(torch.float64)), z)


def test_no_complex_warning_reaches_the_user():
    z = _z(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(lambda z: z.abs() + z.sgn().real, backend="fx2xla", fullgraph=True)(z)
    torch.testing.assert_close(out, z.abs() + z.sgn().real)
    assert not [w for w in caught if issubclass(w.category, np.exceptions.ComplexWarning)]


def test_complex_to_real_in_a_rule_is_an_error():
    import jax.numpy as jnp

    with pytest.raises(TypeError, match="cast to real"):
        complex_to_real(jnp.ones(2, jnp.complex64), jnp.float32)
    complex_to_real(jnp.ones(2, jnp.complex64), jnp.complex128)  # complex -> complex is fine
    complex_to_real(jnp.ones(2, jnp.float32), jnp.float16)
