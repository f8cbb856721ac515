import pytest
import torch

from harness.check import check
from harness.experts import expert_gemm
from harness.layout import RankLayout, counts_matrix, rank_layout
from harness.reference import dispatch_local, reference_local
from harness.workload import WorkloadSpec, make_rank_weights, make_tokens, routing_of
from tests.oracle_cpu import scale

CPU = torch.device("cpu")


def expert_step(x_recv: torch.Tensor, lay: RankLayout, weights: torch.Tensor) -> torch.Tensor:
    """Step 3: rows grouped by source -> sorted by local expert -> experts -> back.
    [R, K] -> [R, N], weights [E, K, N]."""
    perm = torch.sort(lay.recv_expert, stable=True).indices.to(x_recv.device)
    y_sorted = expert_gemm(x_recv.index_select(0, perm), lay.expert_counts.tolist(), weights)
    y = torch.empty_like(y_sorted)
    y[perm] = y_sorted
    return y


def _spec(routing="stress_skew", W=3, E=3):
    return WorkloadSpec(
        tokens_per_rank=40,
        hidden=16,
        out=24,
        experts_per_rank=E,
        top_k=2,
        world_size=W,
        routing=routing,
    )


def test_layout_counts_are_consistent():
    spec = _spec()
    C = counts_matrix(spec)
    assert int(C.sum()) == spec.world_size * spec.tokens_per_rank * spec.top_k
    for r in range(spec.world_size):
        lay = rank_layout(spec, r)
        assert torch.equal(lay.send_counts, C[r])
        assert torch.equal(lay.recv_counts, C[:, r])
        assert int(lay.expert_counts.sum()) == lay.recv_src.numel()


def test_recv_dst_index_points_at_the_same_row_in_the_owner_send_order():
    spec = _spec()
    ids = routing_of(spec).expert_ids
    for r in range(spec.world_size):
        lay = rank_layout(spec, r)
        for s in range(spec.world_size):
            owner = rank_layout(spec, s)
            sel = lay.recv_src == s
            pos = lay.recv_dst_index[sel]
            assert torch.equal(owner.send_token[pos], lay.recv_token[sel])
            g = ids[s, owner.send_token[pos], owner.send_slot[pos]]
            assert torch.equal(g, r * spec.experts_per_rank + lay.recv_expert[sel])


@pytest.mark.parametrize("routing", ["balanced", "moderate_skew", "stress_skew"])
def test_local_five_steps_equal_the_oracle(routing):
    """Dispatch, expert and scale computed per rank with local stand-ins for the all-to-alls."""
    spec = _spec(routing)
    lays = [rank_layout(spec, r) for r in range(spec.world_size)]
    y_recv = [
        expert_step(dispatch_local(spec, lay, CPU), lay, make_rank_weights(spec, lay.rank, CPU))
        for lay in lays
    ]
    for r in range(spec.world_size):
        y_back = torch.empty(int(lays[r].send_counts.sum()), spec.out)
        for d in range(spec.world_size):
            sel = lays[d].recv_src == r
            y_back[lays[d].recv_dst_index[sel]] = y_recv[d][sel]
        out = scale(y_back, lays[r], spec.tokens_per_rank)
        res = check(out, reference_local(spec, r, CPU), 1e-5)
        assert res.ok, res.message


def test_oracle_matches_a_dense_computation():
    spec = _spec("balanced", W=2, E=2)
    r = 1
    ref = reference_local(spec, r, CPU)
    x = make_tokens(spec, r, CPU).double()
    ws = torch.cat([make_rank_weights(spec, q, CPU) for q in range(2)]).double()  # [4, K, N]
    rt = routing_of(spec)
    dense = torch.einsum("tk,gkn->tgn", x, ws)  # [T, 4, N]
    pick = dense.gather(1, rt.expert_ids[r][..., None].expand(-1, -1, spec.out))
    want = (pick * rt.gate_weights[r].double()[..., None]).sum(1)
    torch.testing.assert_close(ref.double(), want, rtol=1e-4, atol=1e-5)
