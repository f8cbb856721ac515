"""The serial baseline's operator step (systems/serial.py): its expert offsets are made once in
setup, on the device, so no step copies host counts to the device (a stream synchronisation on
a GPU every forward, which the tables before this check paid)."""

import torch
import torch.distributed as dist

from harness.check import check
from harness.layout import rank_layout
from harness.reference import dispatch_local, reference_local
from harness.system import CellInputs, RunContext
from harness.workload import WorkloadSpec, make_rank_weights, make_tokens
from systems import serial

CPU = torch.device("cpu")


def test_operator_step_passes_the_offsets_made_in_setup(monkeypatch):
    spec = WorkloadSpec(
        tokens_per_rank=16, hidden=8, out=8, experts_per_rank=3, top_k=2, world_size=1,
        routing="stress_skew", dtype="float32",
    )  # fmt: skip
    lay = rank_layout(spec, 0)
    inp = CellInputs(
        spec, lay, make_tokens(spec, 0, CPU), make_rank_weights(spec, 0, CPU),
        dispatch_local(spec, lay, CPU),
    )  # fmt: skip
    seen = []
    real = serial.expert_gemm

    def spy(x, counts, w, offs=None):
        seen.append(offs)
        return real(x, counts, w, offs)

    monkeypatch.setattr(serial, "expert_gemm", spy)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        ctx = RunContext(rank=0, world_size=1, device=CPU, group=dist.group.WORLD)
        system = serial.SerialSystem(ctx, {})
        system.setup([inp])
        out = system.forward()
        _, y = system.compute_only()
    finally:
        dist.destroy_process_group()
    offs = system.step.offs
    assert len(seen) == 3 and all(o is offs for o in seen)  # setup, forward, compute
    assert offs.dtype == torch.int32
    assert offs.tolist() == torch.cumsum(lay.expert_counts, 0).tolist()
    assert y.shape == (inp.x_recv.shape[0], spec.out)
    res = check(out, reference_local(spec, 0, CPU), 1e-5)
    assert res.ok, res.message
