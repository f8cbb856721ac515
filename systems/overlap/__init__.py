"""The paper's method: tile-level computation-communication overlap of the MoE combine.

Stage A (metadata, no communication): `plan.build_plan` gives the remote-aligned row layout, the
remote-first band schedule and the combine plan (per band and per segment device arrays).
`oracle_cpu` is the CPU oracle of the whole overlapped combine built on that plan.
Imports nothing heavy here, so reading the package pulls in no GPU code.
"""
