"""The producer's tile table (systems/overlap/tuning.py): which entry a problem gets."""

import torch

from systems.overlap.tuning import n_class, pick_config


def test_n_classes_split_at_2048_4096_8192():
    assert [n_class(n) for n in (768, 2047, 2048, 3072, 4095, 4096, 8191, 8192)] == [
        0, 0, 1, 1, 1, 2, 2, 3
    ]  # fmt: skip


def test_fc1_at_mid_n_gets_256_wide_tiles_without_groups():
    """The layer's fc1 at F=2048-3072: 256-wide tiles, fixed band-major order (its plan is
    fc2's, whose groups need not match)."""
    mid = pick_config(128, 768, 3072, torch.bfloat16)
    assert (mid.block_n, mid.group_m, mid.expert_groups) == (256, 1, False)
    narrow = pick_config(128, 3072, 768, torch.bfloat16)
    assert narrow.block_n == 128
    wide = pick_config(128, 2048, 4096, torch.bfloat16)
    assert (wide.block_n, wide.expert_groups) == (256, True)
    assert pick_config(64, 768, 3072, torch.bfloat16).block_n == 128  # tile_m 64 as before
