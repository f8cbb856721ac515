"""An observer of the producer's readiness flags (GPU only; benchmarks/band_times.py): ONE CTA
that polls every band's counter until each reaches its target and records the %globaltimer
nanoseconds at which it first saw it there. It changes nothing the producer reads.

Launched BEFORE the producer, on another stream, with the producer on SMs - 1 programs: the
observer holds no shared memory, so an SM it sits on may lack the producer's shared-memory
carve-out (systems/overlap/kernels/consumer.py says why), and a producer CTA queued behind it
would wait for the observer's time-out. Resolution: one poll of all B counters (volatile loads,
L1 bypassed) per loop, about a microsecond. Bounded: it stops after `timeout_ns`; bands not
seen by then keep time 0 and the host reports them. Launch every other kernel of the observed
run once before it: CUDA loads a kernel's module at its first launch, and that load waits for
the kernels running, i.e. for this one's time-out (benchmarks/band_times.py does so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from systems.overlap.kernels.primitives import globaltimer, uniform_now


@triton.jit
def _observe_kernel(ready, target, times, clock, n_bands, timeout_ns, BLOCK_B: tl.constexpr):
    offs = tl.arange(0, BLOCK_B)
    mask = offs < n_bands
    t0 = uniform_now(clock)
    seen = tl.zeros([BLOCK_B], dtype=tl.int64)
    pending = tl.sum(mask.to(tl.int32), axis=0)
    now = t0
    while (pending > 0) & (now - t0 < timeout_ns):
        c = tl.load(ready + offs, mask=mask, other=0, volatile=True)
        now = uniform_now(clock)
        seen = tl.where(mask & (seen == 0) & (c >= target), now, seen)
        pending = tl.sum((mask & (seen == 0)).to(tl.int32), axis=0)
    tl.store(times + offs, seen, mask=mask)
    tl.store(times + n_bands, t0)


@triton.jit
def _stamp_kernel(out):
    tl.store(out, globaltimer())


def stamp(out: torch.Tensor) -> None:
    """out[0] (int64, on the device) = %globaltimer ns when this one-thread kernel runs on the
    current stream: placed right before the producer, it marks the producer's start."""
    _stamp_kernel[(1,)](out, num_warps=1)


def launch_observer(ready: torch.Tensor, target: int, timeout_ns: int = 2_000_000_000):
    """Launch the observer on the current stream. ready [B] int32 (the producer's band_ready);
    returns times [B + 1] int64 on the device: the %globaltimer ns at which band b's counter was
    first seen >= target (0: not within timeout_ns), then the observer's own start."""
    b = ready.numel()
    times = torch.zeros(b + 1, dtype=torch.int64, device=ready.device)
    clock = torch.zeros(1, dtype=torch.int64, device=ready.device)
    block = triton.next_power_of_2(max(b, 128))  # >= one element per thread of its 4 warps
    _observe_kernel[(1,)](ready, target, times, clock, b, timeout_ns, BLOCK_B=block, num_warps=4)
    return times
