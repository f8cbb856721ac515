"""The dispatch across processes with no host sync (harness/dispatch_peer.py), on the CPU: W real
processes over shm, the kernels in Triton's interpreter.

A GPU step is capturable only if no rank reads a device value on the host; the CPU has no
graphs, so NoHostReads guards the property: both systems' per-process layer steps run under it,
and the same step with an `.item()` added fails it. A dispatch that miscounts one expert's rows
fails the layer's check. (The harness's cells at W = 2-4: tests/test_shm_ranks.py.)
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from tests.multigpu import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="no triton")

T = torch.Tensor
#: what reads a tensor's value on the host (on a GPU: a stream sync, no capture)
HOST_READS = {T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.nonzero,
              torch.nonzero, T.unique, torch.unique, torch.masked_select,
              T.masked_select}  # fmt: skip


class NoHostReads(TorchFunctionMode):
    """Raises on any host read of a tensor value: HOST_READS, and a repeat_interleave by a
    tensor without output_size (its size is taken from data)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sized_by_data = func in (torch.repeat_interleave, T.repeat_interleave) and (
            len(args) > 1 and isinstance(args[1], T) and "output_size" not in kwargs
        )
        if func in HOST_READS or sized_by_data:
            raise AssertionError(f"a host read in the step: {func.__name__}")
        return func(*args, **kwargs)


def _init(rank: int, world: int, port: int) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["HARNESS_FUNCTIONAL"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip


def _guard_worker(
    rank: int, world: int, port: int, system: str, dispatch: str, item: bool, values
) -> None:
    """`system`'s per-process layer step (float32: torch._grouped_mm, no per-expert fallback)
    timed twice under NoHostReads; values[rank]: 1 if it read nothing on the host, 0 if the
    guard caught a read, and the step's error against the reference otherwise checked."""
    _init(rank, world, port)
    from harness.measure import cell_inputs
    from harness.system import RunContext
    from harness.workload import WorkloadSpec
    from systems.overlap.system import OverlapSystem
    from systems.serial import SerialSystem

    try:
        spec = WorkloadSpec(tokens_per_rank=8, hidden=32, out=32, experts_per_rank=2, top_k=2,
                            world_size=world, routing="stress_skew", dtype="float32",
                            ffn=64)  # fmt: skip
        ctx = RunContext(rank, world, torch.device("cpu"), None, "gloo")
        inputs, ref = cell_inputs(ctx, spec, [rank])
        make = OverlapSystem if system == "overlap" else SerialSystem
        params = {"tile_m": 64, "ccta": 2} if system == "overlap" else {}
        sys_ = make(ctx, {**params, "dispatch": dispatch})
        sys_.setup(inputs)
        step, clean = sys_.step, 1.0
        timed = step.timed
        if item:

            def timed_and_read():
                out = timed()
                out.sum().item()  # what would make the step uncapturable on a GPU
                return out

            step.timed = timed_and_read
        for _ in range(2):
            try:
                with NoHostReads():
                    out = step.timed()
            except AssertionError:
                clean, out = 0.0, timed()
        step.check()
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        values[rank] = clean if err < 1e-4 else -err
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("system", ["serial", "overlap"])
def test_the_per_process_layer_step_reads_nothing_on_the_host(system):
    assert run_ranks(_guard_worker, 2, 1, system, "device", False) == [[1.0], [1.0]]


@pytest.mark.parametrize("system", ["serial", "overlap"])
def test_the_guard_catches_the_nccl_dispatch_which_stays_right(system):
    """dispatch=nccl (the labelled variant: its split sizes' host read) is right, not clean."""
    assert run_ranks(_guard_worker, 2, 1, system, "nccl", False) == [[0.0], [0.0]]


def test_the_guard_catches_an_item_in_the_step():
    assert run_ranks(_guard_worker, 2, 1, "serial", "device", True) == [[0.0], [0.0]]


def _miscount_worker(rank: int, world: int, port: int, values) -> None:
    """OverlapMoE over shm at W=`world` where rank 0's dispatch says it sends one row fewer to
    rank 1's expert 0 than its routing does; values[rank]: the relative error against a plain
    torch layer (inf where a wait timed out)."""
    _init(rank, world, port)
    from harness import dispatch as ld
    from systems.overlap import OverlapMoE, OverlapParams

    try:
        H, F, E, k, n = 32, 64, 2, 2, 16
        if rank == 0:
            honest = ld.sort_meta_torch

            def miscount(*a):
                order, pos, token, meta = honest(*a)
                meta[1, 0] -= 1  # [W_dst, (count, offset) x E]: expert 0 of rank 1
                return order, pos, token, meta

            ld.sort_meta_torch = miscount
        g = torch.Generator().manual_seed(0)
        w1 = torch.randn(world * E, H, F, generator=g) / H**0.5
        w2 = torch.randn(world * E, F, H, generator=g) / F**0.5
        mine = slice(rank * E, (rank + 1) * E)
        moe = OverlapMoE(H, F, E, k, n, dtype=torch.float32, device="cpu", group=dist.group.WORLD,
                         params=OverlapParams(tile_m=64, ccta=2), w1=w1[mine].contiguous(),
                         w2=w2[mine].contiguous())  # fmt: skip
        gs = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(n, H, generator=gs)
        ids = torch.full((n, k), 2 * E - 1)
        ids[:, 0] = E  # every token: expert 0 of rank 1, and rank 1's last expert
        gate = torch.softmax(torch.randn(n, k, generator=gs), -1)
        try:
            y = moe(x, ids, gate)
            moe.check()
        except RuntimeError:
            values[rank] = float("inf")
            return
        h = torch.nn.functional.gelu(torch.einsum("th,tkhf->tkf", x, w1[ids]))
        ref = torch.einsum("tkf,tkfh,tk->th", h, w2[ids], gate)
        values[rank] = float((y - ref).norm() / ref.norm())
    finally:
        dist.destroy_process_group()


def test_a_dispatch_that_miscounts_one_expert_fails_the_check():
    errs = run_ranks(_miscount_worker, 2, 1)
    assert errs[1][0] < 1e-5 and errs[0][0] > 1e-2, errs  # rank 0 lost a row
