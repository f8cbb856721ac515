"""Benchmarks of the overlap method's pieces (scripts, not harness experiments).

Run from the repository root as modules, e.g. `python -m benchmarks.kernels_h200`,
`python -m benchmarks.plan_time`; each prints a short table and writes parquet. Synthetic plans
and expectations come from systems.overlap.testing. A measurement that is one of the paper's
figures is a harness experiment instead (Fig 3a: `python -m harness.run experiment=bandwidth`).
"""
