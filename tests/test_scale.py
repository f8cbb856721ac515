"""The shared scale: the torch path against the reference's scale, bad shapes, and the fused
Triton kernel in the CPU interpreter (a subprocess: TRITON_INTERPRET must precede triton) and on
the GPU."""

import pytest
import torch

from harness.layout import rank_layout
from harness.scale import Scaler
from harness.workload import WorkloadSpec
from tests.interpreted import run_interpreted
from tests.oracle_cpu import scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_equals_the_reference_scale(dtype):
    spec = WorkloadSpec(48, 8, 24, 3, 2, 4, "moderate_skew", seed=1)
    lay = rank_layout(spec, 2)
    y = torch.randn(lay.send_pos.numel(), 24).to(dtype)
    got = Scaler.for_layout(lay, torch.device("cpu"))(y)
    want = scale(y.float(), lay, spec.tokens_per_rank)
    assert got.dtype == dtype and got.shape == (48, 24)
    assert torch.allclose(got.float(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match=r"pos and gate must both be \[T, k\]"):
        Scaler(torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 3), torch.device("cpu"))
    s = Scaler(torch.tensor([[0, 5]]), torch.ones(1, 2), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"y_back must be \[S >= 6, N\]"):
        s(torch.zeros(3, 4))


_INTERP = r"""
import torch
from harness.kernels.scale import VARIANTS, launch_scale
gen = torch.Generator().manual_seed(0)
for variant in [None, *VARIANTS]:
    for dtype, N in ((torch.float32, 40), (torch.float16, 3000)):
        T, k, S = 7, 3, 30  # T=7: a partial token block for every block_t > 1
        y = torch.randn(S, N, generator=gen).to(dtype)
        pos = torch.randint(0, S, (T, k), generator=gen)
        gate = torch.rand(T, k, generator=gen)
        out = launch_scale(y, pos, gate, torch.empty(T, N, dtype=dtype), variant=variant)
        want = (y.float()[pos] * gate[..., None]).sum(1)
        err = ((out.float() - want).norm() / want.norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-3), (variant, dtype, err)
        print("SCALE_OK", variant, dtype, N)
"""


def test_fused_kernel_in_the_interpreter():
    """Runs anywhere: a subprocess with CPU tensors, so a GPU in this process does not matter."""
    pytest.importorskip("triton")
    out = run_interpreted(_INTERP)
    from harness.kernels.scale import VARIANTS

    # N=3000 spans several column blocks in every variant; each variant and the default
    assert out.count("SCALE_OK") == 2 * (len(VARIANTS) + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_kernel_on_the_gpu(dtype):
    spec = WorkloadSpec(4096, 8, 8192, 4, 2, 2, "stress_skew", seed=3)
    lay = rank_layout(spec, 1)
    y = torch.randn(lay.send_pos.numel(), 8192, device="cuda").to(dtype)
    fused = Scaler.for_layout(lay, torch.device("cuda"))
    assert fused.fused
    got = fused(y)
    want = scale(y.float(), lay, spec.tokens_per_rank)
    assert got.dtype == dtype
    assert ((got.float() - want).norm() / want.norm()).item() < 4e-3
