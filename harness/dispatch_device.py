"""The host-free dispatch where one process plays every rank (docs/method.md, "The host-free
layer"). The counts exchange is a transpose of the stacked metadata [W_src, W_dst, 2E]; labels at
the bound W*T*k (rows past n_rows -1); rows gathered in one index_select from the played ranks'
stacked tokens [W*T, H].
"""

from __future__ import annotations

import os

import torch

from harness import dispatch as ld

#: a layer's dispatch: auto (= device), device (no host sync: this module where one process
#: plays every rank, harness/dispatch_peer.py with one process per rank) or nccl
#: (harness/dispatch.py LayerDispatch: one host sync a step)
DISPATCHES = ("auto", "device", "nccl")


def dispatch_used(
    choice: object, world_size: int, plays_every_rank: bool, triton: bool = True
) -> str:
    """The dispatch a layer step runs for the asked `choice`, or a one-line ValueError where it
    cannot run (nccl with one process playing W > 1 ranks; device across processes where
    Triton cannot run, `triton` False: there auto takes nccl)."""
    if choice not in DISPATCHES:
        raise ValueError(f"dispatch must be one of {', '.join(DISPATCHES)}, got {choice!r}")
    if choice == "nccl" and plays_every_rank and world_size > 1:
        raise ValueError("dispatch=nccl needs one process per rank at W > 1")
    across = world_size > 1 and not plays_every_rank
    if across and not triton:
        if choice == "device":
            raise ValueError(
                "dispatch=device with one process per rank runs Triton kernels: a GPU, or "
                "TRITON_INTERPRET=1 on the CPU"
            )
        return "nccl"
    return "device" if choice == "auto" else str(choice)


def triton_runs(device_type: str) -> bool:
    """Whether Triton kernels run on `device_type` here (on the CPU: the interpreter)."""
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def recv_bytes(world_size: int, tokens: int, top_k: int, hidden: int, elem_bytes: int) -> int:
    """Bytes of the worst-case receive buffers of every played rank: W * (W*T*k) * H."""
    return world_size * world_size * tokens * top_k * hidden * elem_bytes


class PlayedDispatch:
    """dispatch(xs, ids), host-free, for every rank of a cell this process plays: xs[r] [T, H]
    and ids[r] [T, k] (global experts) of rank r = 0..W-1, T <= tokens -> one Dispatched per rank
    with x_recv [bound, H] (rows past n_rows are junk), labels at the bound, no host lists. The
    receive buffers are allocated once (their addresses stay, for graphs and launch memos)."""

    def __init__(
        self, world_size: int, experts_per_rank: int, tokens: int, top_k: int, like: torch.Tensor
    ) -> None:
        W, H = world_size, like.shape[1]
        self.W, self.E, self.T, self.k = W, experts_per_rank, tokens, top_k
        self.bound = W * tokens * top_k
        need = recv_bytes(W, tokens, top_k, H, like.element_size())
        if like.is_cuda:
            free = torch.cuda.mem_get_info(like.device)[0]
            if need > free:
                raise ValueError(
                    f"dispatch: the worst-case receive buffers need {need / 2**30:.1f} GiB "
                    f"(W={W} ranks x W*T*k={self.bound} rows x H={H}), the GPU has "
                    f"{free / 2**30:.1f} GiB free"
                )
            from harness.kernels.dispatch import recv_rows, sort_meta, split_sizes

            self._ops = (sort_meta, split_sizes, recv_rows)
        else:  # torch's ops (_labels)
            self._ops = (ld.sort_meta_torch, ld.split_sizes_torch, None)
        self.recv_mib = need / 2**20
        self.x_recv = like.new_empty(W, self.bound, H)

    def _labels(self, counts: torch.Tensor, off: torch.Tensor, epos: bool):
        """recv_rows at the bound; the torch path needs the real row count on the host (CPU
        only) and pads its labels with -1 to the bound."""
        recv_rows = self._ops[2]
        if recv_rows is not None:
            return recv_rows(counts, off, self.bound, epos)
        *rows, offs = ld.recv_rows_torch(counts, off, int(counts.sum()), epos)
        pad = self.bound - rows[0].numel()
        rows = [None if t is None else torch.cat([t, t.new_full((pad,), -1)]) for t in rows]
        return *rows, offs

    def __call__(
        self, xs: list[torch.Tensor], ids: list[torch.Tensor], gather: bool = True
    ) -> list[ld.Dispatched]:
        """gather=False: no x_recv; the caller gathers the rows it needs from `tokens` by
        `token_rows` (the overlap system straight into its padded layout: one copy, not two)."""
        W, E, k = self.W, self.E, self.k
        T = ids[0].shape[0]  # any T <= the tokens the buffers were sized for
        if T > self.T:
            raise ValueError(f"dispatch: {T} tokens a rank, sized for at most {self.T}")
        sort_meta, split_sizes, _ = self._ops
        # each source's send side: (order, pos, token, meta)
        sends = [sort_meta(ids[r], W, E, k) for r in range(W)]
        metas = torch.stack([m for *_, m in sends])  # [W_src, W_dst, 2E]
        # source s's send-order row j is row s*T + token_s[j] of the stacked tokens
        shift = torch.arange(W, device=metas.device).view(W, 1) * T
        token_all = (torch.stack([t for _, _, t, _ in sends]) + shift).reshape(-1)  # [W*S]
        x_all = torch.cat(xs) if W > 1 else xs[0]
        S, epos = T * k, W > 1 and E > 1
        out = []
        for d in range(W):
            got = metas[:, d].contiguous()  # [W_src, 2E]: what every source sends rank d
            counts, off = got.view(W, E, 2)[..., 0], got.view(W, E, 2)[..., 1]
            sizes = split_sizes(metas[d], got, W, E)
            labels = self._labels(counts, off, epos)
            src, dst = labels[0], labels[2]
            rows = token_all.index_select(0, (src * S + dst).clamp_min(0))
            x_recv = self.x_recv[d] if gather else None
            if gather:
                torch.index_select(x_all, 0, rows, out=x_recv)
            send = (sends[d][0], sends[d][1].view(T, k))  # (order, pos)
            extra = dict(tokens=x_all, token_rows=rows)
            out.append(ld.host_free(x_recv, send, sizes, counts, labels, W, E, **extra))
        return out
