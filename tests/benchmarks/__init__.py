"""Tests of the benchmarks (``benchmarks/``): their pure parts, short real runs, and re-rendering from JSON."""
