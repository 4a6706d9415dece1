"""Shared helpers of the benchmarks (not a benchmark: `make bench` runs only benchmarks/*.py)."""
