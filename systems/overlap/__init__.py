"""The paper's method: tile-level computation-communication overlap of the MoE combine.

Stage A (metadata, no communication): `plan.build_plan` gives the remote-aligned row layout, the
remote-first band schedule and the combine plan (per band and per segment device arrays).
`oracle_cpu` is the CPU oracle of the whole overlapped combine built on that plan.
Stage B: `kernels/` (the Triton producer and consumer, their shared device primitives and thin
launchers), `runner` (OverlapRunner: one rank's host state and launches), `transport` (where the
bands land), `modes` (named put and flag modes, no Triton), `errors` (device error records),
`system` (the harness system). `testing`: synthetic plans (through `plan.build_plan`) and
expectations shared by the kernel tests and the benchmarks.
Imports nothing heavy here, so reading the package pulls in no GPU code.
"""
