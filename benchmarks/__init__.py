"""Kernel benchmarks (python -m benchmarks.<name>), checked before timed; figures: experiments/."""
