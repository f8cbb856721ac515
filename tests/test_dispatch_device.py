"""The host-free dispatch of the ranks one process plays (harness/dispatch_device.py) against the
harness's layout (harness/layout.py) and its communication-free dispatch, on the CPU."""

import pytest
import torch

from harness.dispatch_device import PlayedDispatch, dispatch_used, recv_bytes
from harness.layout import rank_layout
from harness.reference import dispatch_local
from harness.workload import WorkloadSpec, make_tokens, routing_of

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "W,E,routing", [(1, 4, "balanced"), (3, 2, "stress_skew"), (4, 1, "moderate_skew")]
)
def test_every_rank_receives_the_layout_rows_labels_and_counts(W, E, routing):
    spec = WorkloadSpec(40, 16, 16, E, 2, W, routing, ffn=8, seed=5)
    xs = [make_tokens(spec, r, CPU) for r in range(W)]
    ids = [routing_of(spec).expert_ids[r] for r in range(W)]
    played = PlayedDispatch(W, E, 40, 2, xs[0])
    assert played.bound == W * 40 * 2 and played.x_recv.shape == (W, W * 80, 16)
    for r, d in enumerate(played(xs, ids)):
        lay = rank_layout(spec, r)
        R = lay.recv_src.numel()
        assert int(d.received.n_rows) == R and d.recv_src.numel() == played.bound
        assert torch.equal(d.recv_src[:R], lay.recv_src)
        assert torch.equal(d.recv_expert[:R], lay.recv_expert)
        assert torch.equal(d.recv_dst_index[:R], lay.recv_dst_index)
        assert (d.recv_src[R:] == -1).all() and (d.recv_dst_index[R:] == -1).all()
        assert torch.equal(d.x_recv[:R], dispatch_local(spec, lay, CPU))
        assert torch.equal(d.send_counts, lay.send_counts)
        assert torch.equal(d.pos, lay.send_pos)
        counts = torch.bincount(lay.recv_expert, minlength=E)
        assert torch.equal(d.offs.long(), counts.cumsum(0))
        if d.expert_pos is not None:  # rows grouped by expert, then source: a permutation
            assert torch.equal(d.expert_pos[:R].sort().values, torch.arange(R))
            grouped = torch.empty(R, dtype=torch.long)
            grouped[d.expert_pos[:R]] = lay.recv_expert
            assert (grouped.diff() >= 0).all()


def test_the_dispatch_choice_and_its_errors():
    assert dispatch_used("auto", 1, True) == "device"
    assert dispatch_used("auto", 4, False) == "device"  # harness/dispatch_peer.py
    assert dispatch_used("device", 2, False) == "device"
    assert dispatch_used("auto", 2, False, triton=False) == "nccl"  # CPU, no interpreter
    with pytest.raises(ValueError, match="runs Triton kernels"):
        dispatch_used("device", 2, False, triton=False)
    assert dispatch_used("nccl", 1, True) == "nccl"  # the old path, to compare at W=1
    with pytest.raises(ValueError, match="one process per rank"):
        dispatch_used("nccl", 2, True)
    with pytest.raises(ValueError, match="dispatch must be one of"):
        dispatch_used("fast", 1, True)
    assert recv_bytes(8, 8192, 2, 4096, 2) == 8 * 8 * 8192 * 2 * 4096 * 2
