"""fft lowerings (fx2xla/lowering/fft.py) against eager PyTorch: _fft_r2c, _fft_c2r and
_fft_c2c through torch.fft's fft/rfft/irfft families, with complex64/complex128 values both
inside the graph and handed across the graph boundary (inputs and outputs)."""
from __future__ import annotations

import pytest
import torch

import fx2xla.lowering.fft  # noqa: F401  (registers the rules until lowering/__init__ imports it)
from tests.conftest import tolerance

aten = torch.ops.aten
# A missing rule would silently run eagerly; make that a failure.
pytestmark = pytest.mark.filterwarnings("error:fx2xla:UserWarning")
NORMS = [None, "forward", "ortho"]  # torch.fft's names for the three normalization modes


def make(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def compare(fn, *args):
    """Compile `fn` with fx2xla and compare with eager; complex results are compared with the
    tolerance of their real dtype (conftest's table has none for complex dtypes)."""
    torch._dynamo.reset()
    expected = fn(*args)
    actual = torch.compile(fn, backend="fx2xla", fullgraph=True)(*args)
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, a.shape, e.dtype, e.shape)
        real = e.real.dtype if e.is_complex() else e.dtype
        torch.testing.assert_close(a, e, **tolerance(real, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rfft_outputs(dtype):
    # Complex outputs (complex64 / complex128) handed back to torch.
    x = make(3, 8, 10, dtype=dtype)
    compare(lambda x: tuple(f(x, norm=n) for n in NORMS for f in (torch.fft.rfft, torch.fft.rfft2))
            + (torch.fft.rfft(x, dim=1), torch.fft.rfftn(x, dim=(0, 2)), torch.fft.rfft(x, n=7),
               torch.fft.rfft(x.transpose(1, 2)), torch.fft.rfft(x[:, :, :9])), x)


def test_fft_of_real_input_two_sided():
    # torch.fft.fft of a real tensor is _fft_r2c with onesided=False; fft2/ifft add _fft_c2c.
    x = make(4, 6)
    compare(lambda x: (torch.fft.fft(x), torch.fft.fft2(x, norm="ortho"),
                       torch.fft.fft(x, dim=0, norm="forward"), torch.fft.ifft(torch.fft.fft(x)),
                       torch.fft.ifft2(torch.fft.fft2(x), norm="forward")), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_irfft_round_trip_inside_graph(dtype):
    # The complex value never leaves the graph: irfft(rfft(x) * w) and friends.
    x, w = make(3, 8, 10, dtype=dtype), make(6, dtype=dtype, seed=1)
    compare(lambda x, w: tuple(torch.fft.irfft(torch.fft.rfft(x, norm=n) * w, n=10, norm=n) for n in NORMS)
            + (torch.fft.irfft2(torch.fft.rfft2(x)),
               torch.fft.irfft(torch.fft.rfft(x)),  # default n = 2 * (bins - 1)
               torch.fft.irfftn(torch.fft.rfftn(x, dim=(0, 2)), s=(3, 10), dim=(0, 2))), x, w)


def test_irfft_complex_inputs():
    # Complex64 inputs handed in from torch, including odd output sizes and a strided view.
    z = torch.fft.rfft(make(4, 9))
    compare(lambda z: (torch.fft.irfft(z), torch.fft.irfft(z, n=9), torch.fft.irfft(z, norm="ortho"),
                       torch.fft.irfft2(z, norm="forward"), torch.fft.irfft(z.t(), dim=0),
                       torch.fft.irfft(z, n=4)), z)
