"""The paper's method: tile-level computation-communication overlap of the MoE combine.

The public layer: `OverlapMoE` (layer.py), a torch module with one context sized once and one
call; `OverlapParams` (params.py) its knobs. RankExperts (rank_experts.py) is one rank's expert
part of it; steps.py and system.py are the harness's client.
Stage A (metadata, no communication): `plan` (the CombinePlan: the remote-aligned row layout,
the remote-first band schedule and the combine plan), built on the device by `plan_device`.
Stage B: `kernels/` (the Triton producer and consumer, their shared device primitives and thin
launchers), `runner` (OverlapRunner: one rank's host state and launches), `transport` (where the
bands land), `modes` (named put and flag modes, no Triton), `errors` (device error records).
Imports nothing heavy here, so reading the package pulls in no GPU code.
"""

__all__ = ["OverlapMoE", "OverlapParams"]


def __getattr__(name: str):
    """`from systems.overlap import OverlapMoE` (the public layer) imports it on first use."""
    if name == "OverlapMoE":
        from systems.overlap.layer import OverlapMoE

        return OverlapMoE
    if name == "OverlapParams":
        from systems.overlap.params import OverlapParams

        return OverlapParams
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
