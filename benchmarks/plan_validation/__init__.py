"""acco-plan's predictions against what the other benchmarks measured on this machine (their
committed raw JSON), and against the paper's reported ratios (``python -m benchmarks.plan_validation``)."""
