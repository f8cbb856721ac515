"""Benchmarks of the overlap method's pieces (scripts, not harness experiments): plan_time
(stage A against the expert GEMM), scale_bound (the fused scale against its memory bound),
host_profile and step_profile (where a timed step's host and device time go), table_summary
(a results table in short). Run from the repository root as modules, e.g.
`python -m benchmarks.plan_time`; each checks its result before timing it. A measurement that
is one of the paper's figures or a study is a harness experiment (conf/experiment/) instead.
"""
