"""Benchmarks of the overlap method's pieces: scripts run as modules from the repository root
(`python -m benchmarks.plan_time`), each checking its result before timing it. A measurement
that is one of the paper's figures or a study is a harness experiment (conf/experiment/) instead.
"""
