"""Test tiers: gpu-marked tests are skipped where no CUDA GPU is present. The files that spawn
ranks run first: with `--dist loadfile` a file runs in one worker, so the long ones started last
would leave the other worker idle at the end (`make test` passes --no-loadscope-reorder, else
xdist reorders files by their number of tests)."""

from __future__ import annotations

import pytest
import torch

from tests.fast_interpreter import install

#: the slowest files of the CPU tier, slowest first (each 30-160 s on 2 cores)
FIRST = ("test_shm_ranks.py", "test_dispatch_gloo.py", "test_backward.py", "test_layer.py",
         "test_peer_dispatch.py", "test_failing_ranks.py", "test_fail_together.py",
         "test_models.py")  # fmt: skip


def pytest_collection_modifyitems(config, items):
    install()  # where a test module set TRITON_INTERPRET=1 at its import (collected by now)
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest in order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
