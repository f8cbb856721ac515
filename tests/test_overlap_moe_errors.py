"""OverlapMoE refuses bad knobs and dtypes with a one-line ValueError before it allocates its
context (no interpreter needed: nothing runs)."""

from __future__ import annotations

import pytest
import torch

from harness.workload import WorkloadSpec
from systems.overlap import OverlapMoE
from systems.overlap.params import OverlapParams


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(params=OverlapParams(tile_m=32)), r"tile_m must be one of \(64, 128\), got 32"),
        (dict(params=OverlapParams(ccta=0)), r"ccta=0 must be in \[1, SMs\)"),
        (dict(params=OverlapParams(mgb=0)), "mgb must be >= 1, got 0"),
        (dict(params=OverlapParams(layout="dense")), "layout must be one of aligned, compact"),
        (dict(params=OverlapParams(transport="p2p")), "transport p2p with W=1"),
        (dict(dtype=torch.float64), "unknown dtype 'float64'"),
        (dict(hidden=36), "K and N must be multiples of 8"),
    ],
)
def test_bad_input_is_a_one_line_error(kw, match):
    args = dict(hidden=32, ffn=64, experts_per_rank=4, top_k=2, max_tokens=16)
    args |= dict(dtype=torch.float16, device="cpu")
    with pytest.raises(ValueError, match=match) as err:
        OverlapMoE(**(args | kw))
    assert "\n" not in str(err.value)


def test_float32_is_for_the_interpreter_only():
    """The GPU kernels take float16 / bfloat16; OverlapMoE on the CPU also allows float32."""
    spec = WorkloadSpec(16, 32, 32, 4, 2, 1, "balanced", "float32", ffn=64)
    with pytest.raises(ValueError, match="dtype must be float16 or bfloat16, got float32"):
        OverlapParams().validate(spec, 132)
    OverlapParams().validate(spec, 0, ("float16", "bfloat16", "float32"))
