"""Benchmarks of the overlap method's pieces, run as modules (`python -m benchmarks.plan_time`),
each checking its result before timing it; a paper figure or a study is a harness experiment."""
