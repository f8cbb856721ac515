"""The kernels' configurations, importable without Triton: the producer's TileConfig and its
tile table (pick_config), the consumer's ConsumerConfig and its presets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from harness.kernels.ints import cdiv


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and schedule knobs of the producer. block_m must equal the plan's tile_m."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 1  # 1 = band-major (the paper's order); >1 = L2 swizzle over schedule entries
    use_tma: bool = True
    flatten: bool = True  # tl.range(flatten=True): one pipelined loop over tiles x K steps
    flag: str = "thread"  # readiness flags: modes.FLAG_CODES (cta / thread / deferred: producer.py)
    epi_split: int = 1  # the epilogue stores the tile in 1, 2 or 4 column slices
    #: swizzle groups = runs of one expert's bands in the visiting order, at most group_m long
    #: (the plan's `groups`), instead of fixed groups of group_m positions
    expert_groups: bool = False

    def tiles_n(self, n: int) -> int:
        """Column tiles per band."""
        return cdiv(n, self.block_n)

    def tile_increment(self) -> int:
        """What one finished tile adds to its band's ready counter."""
        return 1 if self.flag == "cta" else 32 * self.num_warps

    def band_increment(self, n: int) -> int:
        """What one run adds to a signalled band's ready counter (tiles_n * tile_increment)."""
        return self.tiles_n(n) * self.tile_increment()

    @property
    def group_cap(self) -> int:
        """The plan builders' group_cap for this config: group_m with expert groups, else 0."""
        return self.group_m if self.expert_groups else 0


# Hopper (H200), bf16/fp16, TMA loads, flattened tile loop; why each (docs/measurements.md):
# narrow N: 128-wide tiles keep every SM busy, thread flags (short tiles); mid N (the layer's
# fc1): 256-wide tiles; wide N: expert groups (tile_m 128) or fixed groups of 4 (tile_m 64),
# deferred flags and the 4-slice epilogue (docs/method.md, Stage B: Producer, Flags)
TILE_TABLE: dict[tuple[int, int], TileConfig] = {
    (128, 0): TileConfig(128, 128, 64, 8, 4, group_m=1, flag="thread"),
    (128, 1): TileConfig(128, 256, 64, 8, 3, group_m=1, flag="deferred", epi_split=4),
    (128, 2): TileConfig(128, 256, 64, 8, 3, 16, flag="deferred", epi_split=4, expert_groups=True),
    (128, 3): TileConfig(128, 256, 64, 8, 3, 16, flag="deferred", epi_split=4, expert_groups=True),
    (64, 0): TileConfig(64, 128, 64, 4, 4, group_m=1, flag="thread"),
    (64, 1): TileConfig(64, 128, 64, 4, 4, group_m=1, flag="thread"),
    (64, 2): TileConfig(64, 256, 64, 4, 4, group_m=4, flag="deferred", epi_split=4),
    (64, 3): TileConfig(64, 256, 64, 4, 4, group_m=4, flag="deferred", epi_split=4),
}


def n_class(n: int) -> int:
    """TILE_TABLE's N class: 0 (N < 2048), 1 (N < 4096), 2 (N < 8192), 3 (N >= 8192)."""
    return 0 if n < 2048 else 1 if n < 4096 else 2 if n < 8192 else 3


def pick_config(tile_m: int, k: int, n: int, dtype: torch.dtype) -> TileConfig:
    """The table's TileConfig for (tile_m, K, N) in fp16/bf16 (else a generic one of tile_m)."""
    cfg = TILE_TABLE.get((tile_m, n_class(n)))
    if cfg is None:
        cfg = TileConfig(tile_m, 128, 64, 4, 3, group_m=4, flag="deferred")
    if k % cfg.block_k != 0:  # no TMA: pointer loads pipeline best without flattening
        cfg = replace(cfg, use_tma=False, flatten=False, flag="cta")
    if dtype == torch.float32:
        cfg = replace(cfg, block_k=32, num_stages=2)
    return cfg


def interpreter_config(tile_m: int) -> TileConfig:
    """Small tiles for the CPU interpreter (TRITON_INTERPRET=1)."""
    return TileConfig(tile_m, 32, 16, 4, 1, 1, use_tma=False, flatten=False)


@dataclass(frozen=True)
class ConsumerConfig:
    """Copy knobs of the consumer. block: elements per copy step. The default (1024 threads,
    128 KiB in flight per CTA in bf16) owns its SM (runner.py's placement)."""

    block: int = 65536
    num_warps: int = 32
    timeout_s: float = 5.0  # the time bound of every spin
    use_timer: bool = True  # False in the CPU interpreter (the host clock bounds the spins)


def shared_consumer_config() -> ConsumerConfig:
    """A consumer CTA small enough to sit next to a producer CTA on one SM (consumer="shared"):
    128 threads, 16 KiB in flight per step (bf16), no shared memory."""
    return ConsumerConfig(block=8192, num_warps=4)


def interpreter_consumer_config() -> ConsumerConfig:
    """Small blocks for TRITON_INTERPRET=1, its spins bounded by the host clock; peers in other
    processes run at the interpreter's speed, so the bound is long."""
    return ConsumerConfig(block=256, num_warps=4, timeout_s=60.0, use_timer=False)
