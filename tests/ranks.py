"""CPU ranks for the gloo tests, forked from one server process that imports torch once.

`torch.multiprocessing.spawn` starts every rank as a fresh interpreter that imports torch again
(2-3 s each, W of them at once on a 2-core CI machine). Here the ranks are forked from
multiprocessing's fork server, which imported torch when it started (once per test process), so
a rank starts in milliseconds, in a process that has never run a torch op or a thread pool.
The rank's own test module is still imported in the rank, as with spawn.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

#: modules the fork server imports before it forks any rank (nothing that imports triton: a
#: test may set TRITON_INTERPRET for its ranks, which triton reads once, at its import)
PRELOAD = ["torch", "torch.distributed"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def context() -> Any:
    """The fork server's context (for queues shared with the ranks)."""
    return mp.get_context("forkserver")


def run_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """fn(rank, *args) in nprocs forked processes, as torch.multiprocessing.spawn(join=True): it
    returns when every rank ended and raises (with the rank's trace) when one failed. Each rank
    gets this process's environment of now, as a spawned one would (the fork server holds the
    one it started with)."""
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts
    env = dict(os.environ)
    mp.start_processes(_entry, args=(fn, env, *args), nprocs=nprocs, start_method="forkserver")


def _entry(rank: int, fn: Callable[..., None], env: dict, *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)
