"""Device code every system shares: Triton kernels and their thin launchers (one per module)."""
