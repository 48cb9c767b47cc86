"""`make demo`: compile GPT-2 (4 layers, hidden 256, random weights) with backend="fx2xla",
check it against eager, print the error and the latency ratio."""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import interleaved_medians  # noqa: E402

from fx2xla.testing import LogitsOnly, gpt2, token_ids  # noqa: E402


def main() -> None:
    torch.manual_seed(0)
    model = LogitsOnly(gpt2(layers=4, hidden=256)).eval()
    ids = token_ids(batch=4, seq=128)
    with torch.no_grad():
        expected = model(ids)
        compiled = torch.compile(model, backend="fx2xla", fullgraph=True)  # no fx2xla import needed
        t0 = time.perf_counter()
        out = compiled(ids)
        first = time.perf_counter() - t0
        err = (out - expected).abs().max().item()
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        med = interleaved_medians({"eager": model, "fx2xla": compiled}, (ids,), rounds=15)
    print(f"GPT-2 (4 layers, hidden 256), batch 4 x seq 128, float32, logits {tuple(out.shape)}")
    print(f"  first call (compile)   {first:.2f} s")
    print(f"  max |fx2xla - eager|   {err:.2e}")
    print(f"  latency eager          {med['eager'] * 1e3:.2f} ms")
    print(f"  latency fx2xla         {med['fx2xla'] * 1e3:.2f} ms")
    print(f"  fx2xla / eager         {med['fx2xla'] / med['eager']:.2f}x")


if __name__ == "__main__":
    main()
