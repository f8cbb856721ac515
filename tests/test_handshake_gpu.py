"""GPU tier, 2+ GPUs: the overlap system's epoch handshake against a deliberately slow receiver.

One process per GPU (p2p), every visible GPU (up to 8). Every step scales every rank's input by
2^(step % 3), exact in bf16, so each step's output must equal the reference times that factor. Rank
1 sleeps ~20 ms on its stream before reading its receive buffer (its scale). With the handshake
(a one-element NCCL all-reduce on the step's stream), rank 0's next step cannot start its puts
before rank 1 passed that read: every step is exact. Without it, rank 0's next puts land in rank
1's buffer while rank 1 still sleeps, and rank 1 reads rows of the wrong step: the same check
fails. The run without shows the test can fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.multigpu import gpu_world, init_nccl, run_ranks

pytestmark = pytest.mark.gpu

STEPS = 6
SLEEP_CYCLES = 40_000_000  # ~20 ms at the H200's ~2 GHz


def _worker(rank: int, world: int, port: int, handshake: bool, errs) -> None:
    from harness.measure import cell_inputs
    from harness.system import RunContext
    from harness.workload import WorkloadSpec
    from systems.overlap.system import OverlapSystem

    dev = init_nccl(rank, world, port)
    try:
        spec = WorkloadSpec(
            tokens_per_rank=2048,
            hidden=1024,
            out=2048,
            experts_per_rank=4,
            top_k=2,
            world_size=world,
            routing="balanced",
            dtype="bfloat16",
        )
        ctx = RunContext(rank, world, dev, dist.group.WORLD, "nccl")
        inputs, ref = cell_inputs(ctx, spec, [rank])
        system = OverlapSystem(ctx, {"transport": "p2p"})
        system.setup(inputs)
        step = system.step
        step.handshake = handshake  # False: no handshake at all (the racy run)
        rk = step.rk
        x0 = rk.x.clone()
        if rank == 1:  # the slow receiver: a sleep on its stream before it reads its buffer
            scaled = rk.scaled

            def slow_scaled() -> torch.Tensor:
                torch.cuda._sleep(SLEEP_CYCLES)
                return scaled()

            rk.scaled = slow_scaled
        outs = []
        for step in range(STEPS):
            rk.x.copy_(x0 * 2.0 ** (step % 3))
            outs.append(system.timed().clone())
        torch.cuda.synchronize()
        step.check()
        ref = ref.float()
        for step, out in enumerate(outs):
            want = ref * 2.0 ** (step % 3)
            errs[rank * STEPS + step] = float((out.float() - want).norm() / want.norm())
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(handshake: bool) -> list[list[float]]:
    return run_ranks(_worker, gpu_world(), STEPS, handshake)


@pytest.mark.skipif(gpu_world() < 2, reason="needs 2 GPUs (one process per GPU)")
def test_epoch_handshake_protects_a_slow_receiver():
    errs = _run(True)
    assert max(max(e) for e in errs) < 8e-3, errs


@pytest.mark.skipif(gpu_world() < 2, reason="needs 2 GPUs (one process per GPU)")
def test_without_handshake_the_slow_receiver_reads_the_next_step():
    """The same run with no handshake: the slow receiver reads rows of the next step."""
    racy = _run(False)
    assert max(racy[1]) > 0.1, racy
