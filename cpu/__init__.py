"""CPU kernels (placeholder docstring)."""
