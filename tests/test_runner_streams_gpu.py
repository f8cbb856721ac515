"""GPU tier, one GPU: the runner's `before_consume` hook (the handshake at
handshake_stream=consumer) runs on the consumer's stream, ahead of the consumer, and the
producer does not wait for it; the rows delivered are those of a run without the hook."""

import pytest
import torch

from harness.layout import rank_layout
from harness.workload import WorkloadSpec

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 100_000_000  # ~50 ms at the H200's ~2 GHz


def test_before_consume_delays_the_consumer_not_the_producer():
    from systems.overlap.system import _Rank
    from systems.overlap.transport import LoopbackFabric

    spec = WorkloadSpec(
        tokens_per_rank=512,
        hidden=256,
        out=512,
        experts_per_rank=4,
        top_k=2,
        world_size=2,
        routing="balanced",
        dtype="bfloat16",
    )
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    rows = spec.tokens_per_rank * spec.top_k
    fabric = LoopbackFabric([rows] * 2, spec.out, torch.bfloat16, dev)
    lay = rank_layout(spec, 0)
    x = torch.randn(lay.recv_src.numel(), spec.hidden, generator=gen).bfloat16().to(dev)
    w = (torch.randn(4, spec.hidden, spec.out, generator=gen) / 16).bfloat16().to(dev)
    rk = _Rank(spec, lay, x, w, 128, 1, fabric.transport(0), 8, {"local_direct": True})
    runner = rk.runner

    rk.step()  # compile, then the reference delivery
    torch.cuda.synchronize()
    runner.check()
    want = [fabric.recv(d).clone() for d in range(2)]

    seen = {}

    def hook():
        seen["stream"] = torch.cuda.current_stream()
        torch.cuda._sleep(SLEEP_CYCLES)

    fabric.reset()
    ev = {k: torch.cuda.Event(enable_timing=True) for k in ("start", "prod", "cons", "sleep")}
    ev["start"].record()
    rk.step(before_consume=hook)
    ev["prod"].record(runner.prod_stream)  # the producer is all that stream holds
    ev["cons"].record()  # the current stream joined both
    sleep_stream = torch.cuda.Stream()
    with torch.cuda.stream(sleep_stream):  # the hook's sleep alone: its length on this GPU
        ev["sleep"].record()
        torch.cuda._sleep(SLEEP_CYCLES)
        done = torch.cuda.Event(enable_timing=True)
        done.record()
    torch.cuda.synchronize()
    runner.check()
    assert seen["stream"] == runner.cons_stream
    sleep_ms = ev["sleep"].elapsed_time(done)
    assert ev["start"].elapsed_time(ev["prod"]) < 0.5 * sleep_ms
    assert ev["start"].elapsed_time(ev["cons"]) >= 0.9 * sleep_ms
    for d in range(2):
        assert torch.equal(fabric.recv(d), want[d])
