"""Tests of the benchmarks (``benchmarks/``): their pure parts, short real runs, and re-rendering from JSON."""

QUICK_RUN_HANG_S = 1500
"""How long a benchmark's ``--quick`` run may take before its test calls it hung, kills it and fails. A hang guard,
not a timing: alone on 2 cores a quick run takes 1-4 minutes, but with the whole suite on the same cores (three test
workers, each launching ranks) a topology quick run once took over 600 s and failed a run that was not hung."""
