"""harness/kernels/activation.py: GELU in place over the first n rows (n on the device)."""

from __future__ import annotations

import pytest
import torch

from tests.interpreted import run_interpreted

_INTERP = r"""
import torch
from harness.kernels.activation import blocks, gelu_rows_
gen = torch.Generator().manual_seed(0)
BR, BF = blocks(2048)
for P, F, n in ((40, 24, 21), (BR * 3, BF + 7, BR * 2), (9, 8, 0), (9, 8, 9)):
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(P, F, generator=gen).to(dtype)
        before = h.clone()
        out = gelu_rows_(h, torch.tensor([n]))
        assert out is h
        want = torch.nn.functional.gelu(before[:n].float())
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert torch.allclose(h[:n].float(), want, rtol=tol, atol=tol), (P, F, n, dtype)
        assert torch.equal(h[n:], before[n:]), (P, F, n, dtype)  # rows past n untouched
        print("GELU_OK", P, F, n, dtype)
"""


def test_gelu_rows_in_the_interpreter():
    """Partial row blocks, several column steps, no real row, every row; past n untouched."""
    pytest.importorskip("triton")
    assert run_interpreted(_INTERP).count("GELU_OK") == 8


def test_activation_needs_a_contiguous_matrix():
    from harness.kernels.activation import gelu_rows_

    with pytest.raises(ValueError, match="contiguous"):
        gelu_rows_(torch.zeros(4, 6).t(), torch.tensor([2]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gelu_rows_on_the_gpu_equals_torch(dtype):
    from harness.experts import activation

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    h = torch.randn(5000, 2048, device="cuda").to(dtype)
    before = h.clone()
    for n in (4999, 1234):  # the second relaunches the remembered launch
        h.copy_(before)
        out = activation(h, torch.tensor([n], device="cuda"))
        assert out is h
        want = torch.nn.functional.gelu(before[:n])
        assert (h[:n].float() - want.float()).abs().max().item() <= 2e-2
        assert torch.equal(h[n:], before[n:])
