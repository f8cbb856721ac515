"""The CUTLASS producer on an sm_90 GPU (marked gpu; skipped without one or without its library,
`make cutlass`): Y of every band equals the float32 reference, every remote band's counter
grows by band_increment(N) per run, local bands are never signalled, for both groupings and
every cluster, fp16 and bf16, host and device signal counts."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from systems.overlap import cutlass_producer as cp  # noqa: E402
from systems.overlap.plan import producer_order  # noqa: E402
from systems.overlap.testing import reference_y, synthetic_plan  # noqa: E402

try:
    cp.load()
except cp.CutlassUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

DEV = torch.device("cuda")
# rows[e][s]: rows owner s sends to rank `rank`'s expert e (partial bands, empty groups, W=3)
CASES = {
    "w2": ([[100, 300], [0, 129], [5, 7], [200, 0], [0, 0]], 0),
    "w3_rank1": ([[100, 300, 20], [0, 129, 5], [5, 7, 300]], 1),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "grouping,cluster", [("band", (1, 2)), ("band", (1, 1)), ("expert", (2, 1)), ("expert", (1, 2))]
)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", ["aligned", "compact"])
def test_cutlass_producer_rows_and_flags(dtype, grouping, cluster, case, layout):
    # compact: no zero rows, mixed bands (remote rows, then local rows) are signalled
    rows, rank = CASES[case]
    plan = synthetic_plan(rows, rank=rank, tile_m=128, device=DEV, layout=layout)
    k, n = 256, 512
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(plan.n_padded, k, generator=g, device=DEV).to(dtype)
    x[plan.gather_index < 0] = 0
    w = (torch.randn(len(rows), k, n, generator=g, device=DEV) / 16).to(dtype)
    y = torch.zeros(plan.n_padded, n, dtype=dtype, device=DEV)
    ready = torch.zeros(plan.n_bands, dtype=torch.int32, device=DEV)
    prod = cp.CutlassProducer(cluster, grouping)
    order = producer_order(plan) if grouping == "band" else None
    sig = torch.tensor([plan.n_remote_bands], device=DEV)  # a device count, as a DevicePlan's
    for run in (1, 2):
        n_signal = sig if run == 2 else None
        prod.launch(x, w, y, plan, ready, num_programs=100, order=order, n_signal=n_signal)
        torch.cuda.synchronize()
        remote = plan.schedule[: plan.n_remote_bands]
        local = plan.schedule[plan.n_remote_bands :]
        assert torch.all(ready[remote] == run * cp.band_increment(n)), ready.tolist()
        assert torch.all(ready[local] == 0), ready.tolist()
    valid = plan.gather_index >= 0
    ref = reference_y(plan, x, w)[valid]
    err = (y[valid].float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, float(err)
