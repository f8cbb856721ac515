"""The kinds of failure the runner tells apart from a failing cell (each class says which)."""

from __future__ import annotations

import torch.distributed as dist


class HarnessUserError(ValueError):
    """Bad input, found before any work (or a table damaged while the run went on):
    `harness.run` prints one line `error: <message>` and exits with code 2."""


class CommFailure(RuntimeError):
    """A collective failed (a peer gone or stalled): the run stops, the cell in flight unwritten."""


#: text of the errors gloo and NCCL raise when a peer dies, stalls or times out (they are plain
#: RuntimeErrors in torch 2.13, not always torch.distributed.DistError)
COMM_MARKERS = (
    "third_party/gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "pair closure",
    "Timed out waiting",
    "ProcessGroupNCCL",
    "NCCL communicator was aborted",
    "DistBackendError",
)


class ContextLost(RuntimeError):
    """A sticky CUDA error (an illegal memory access...) ended a cell: its `error` row is
    written, then the rank ends (every later CUDA call in that process fails or aborts)."""


#: CUDA errors that poison the process's context (cudaGetLastError cannot clear them)
STICKY_CUDA_MARKERS = (
    "illegal memory access",
    "unspecified launch failure",
    "misaligned address",
    "device-side assert",
    "illegal instruction",
)


def is_sticky_cuda_error(text: str) -> bool:
    return "CUDA" in text and any(m in text for m in STICKY_CUDA_MARKERS)


def looks_like_comm_failure(text: str) -> bool:
    return any(m in text for m in COMM_MARKERS)


def is_comm_failure(exc: BaseException) -> bool:
    return isinstance(exc, (CommFailure, dist.DistError)) or looks_like_comm_failure(str(exc))
