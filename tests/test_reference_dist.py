"""The reference layer over a real gloo process group (W=4) equals the single-process oracle."""

import torch
import torch.distributed as dist

from harness.check import check
from harness.layout import rank_layout
from harness.reference import combine, dispatch, reference_local
from harness.workload import WorkloadSpec, make_rank_weights, make_tokens
from tests import ranks
from tests.oracle_cpu import scale
from tests.test_reference import expert_step

W = 4


def reference_distributed(spec, lay, x, weights, group):
    """The reference's five steps over a real process group: x [T, K], weights [E, K, N] ->
    out [T, N]."""
    y_recv = expert_step(dispatch(x, lay, group), lay, weights)
    return scale(combine(y_recv, lay, group), lay, spec.tokens_per_rank)


def _worker(rank, init, q):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=W)
    cpu = torch.device("cpu")
    try:
        for routing in ("balanced", "moderate_skew", "stress_skew"):
            spec = WorkloadSpec(
                tokens_per_rank=64,
                hidden=32,
                out=48,
                experts_per_rank=3,
                top_k=2,
                world_size=W,
                routing=routing,
            )
            lay = rank_layout(spec, rank)
            out = reference_distributed(
                spec, lay, make_tokens(spec, rank, cpu), make_rank_weights(spec, rank, cpu), None
            )
            res = check(out, reference_local(spec, rank, cpu), 1e-5)
            q.put((rank, routing, res.ok, res.message))
    finally:
        dist.destroy_process_group()


def test_distributed_reference_equals_oracle():
    q = ranks.context().SimpleQueue()
    ranks.run_ranks(_worker, (f"tcp://127.0.0.1:{ranks.free_port()}", q), W)
    results = [q.get() for _ in range(3 * W)]
    assert len(results) == 3 * W
    assert all(ok for _, _, ok, _ in results), [r for r in results if not r[2]]
